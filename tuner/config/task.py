"""The task: its class, template, metric, prompt counts, and its shipped data file.

The shipped files are small (at most a few hundred KB), so each line is parsed here: a broken
record is named by file and line before anything is loaded (the ``datasets`` JSON builder would
say only "An error occurred while generating the dataset").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tuner.config.errors import ConfigError
from tuner.config.values import integer

SOURCES = ("auto", "local", "hub")


def check_task(task: Mapping[str, Any]) -> None:
    from tuner.tasks.task import METRICS, TEMPLATES
    name = task.get("name")
    if task.get("task_class", "LH") not in ("HH", "LH"):
        raise ConfigError(f"task.task_class={task.get('task_class')!r} is invalid: allowed are "
                          "HH, LH")
    if task.get("template") not in TEMPLATES:
        raise ConfigError(f"task.template={task.get('template')!r} is unknown for task {name}: "
                          f"allowed are {sorted(TEMPLATES)}")
    if task.get("metric", "none") not in METRICS:
        raise ConfigError(f"task.metric={task.get('metric')!r} is unknown: allowed are "
                          f"{sorted(METRICS)}")
    integer("task.n_prompts", task.get("n_prompts"), 1, "an integer >= 1")
    integer("task.n_held_out", task.get("n_held_out"), 0, "an integer >= 0")
    integer("task.max_new_tokens", task.get("max_new_tokens"), 1, "an integer >= 1")
    check_data(task)


def check_data(task: Mapping[str, Any]) -> None:
    """The local file the task will read (``data.source`` auto or local), when there is one."""
    data = task.get("data") or {}
    source = data.get("source", "auto")
    if source not in SOURCES:
        raise ConfigError(f"task.data.source={source!r} is invalid: allowed are auto, local, hub")
    local = data.get("local")
    if data.get("format") is not None or task.get("template") == "messages":
        check_prompt_file(task)
        return
    if not local or source == "hub":
        return
    from tuner.tasks.task import data_path  # where load_records resolves relative paths
    path = data_path(local)
    if path.is_file():
        check_data_file(path, f"task.data.local={local!r}",
                        {f"task.{k}": task.get(k) for k in ("id_field", "category_field")})
    elif source == "local" or not data.get("hub"):
        raise ConfigError(f"task {task.get('name')}: no data available; tried: shipped file "
                          f"{path} (missing): allowed is task.data.local naming a JSON Lines "
                          "file" + ("" if source == "local" else ", or a task.data.hub dataset"))


def check_prompt_file(task: Mapping[str, Any]) -> None:
    """A user's prompt file (``+task=prompts``): read whole here (it is small), so a malformed
    record is named by file and line before anything loads."""
    from tuner.tasks.prompts import PromptFileError, read_prompts
    from tuner.tasks.task import data_path
    data = task.get("data") or {}
    if data.get("format") is None or task.get("template") != "messages":
        raise ConfigError(f"task.data.format={data.get('format')!r} with task.template="
                          f"{task.get('template')!r}: allowed is both set (a file of your own "
                          "prompts: +task=prompts) or neither")
    if data.get("source", "local") != "local":
        raise ConfigError(f"task.data.source={data.get('source')!r} is invalid for a prompt file:"
                          " allowed is local")
    if not data.get("local"):
        raise ConfigError(f"task.data.local={data.get('local')!r} is empty: allowed is the path "
                          "of your prompt file (relative to where you run, or absolute)")
    try:
        read_prompts(data_path(str(data["local"])), str(data["format"]),
                     f"task.data.local={data['local']!r}")
    except PromptFileError as err:
        raise ConfigError(str(err)) from None


def check_data_file(path: Path, setting: str, fields: Mapping[str, Any]) -> None:
    """Every line of a JSON Lines file is a JSON object (blank lines are skipped) holding the
    ``fields`` the task reads ({setting: field name or None}); a file holding one JSON array of
    objects is accepted too, as the ``datasets`` JSON builder reads both."""
    text = path.read_text(encoding="utf-8", errors="replace")
    allowed = "allowed is one JSON object per line (JSON Lines)"
    records: list[tuple[str, Any]] = []
    if text.lstrip().startswith("["):
        try:
            found = json.loads(text)
        except ValueError as err:
            raise ConfigError(f"{setting}: {path} line {err.lineno} is not valid JSON ({err.msg},"
                              f" column {err.colno}): {allowed}") from None
        records = [(f"record {i}", r) for i, r in enumerate(found if isinstance(found, list)
                                                             else [found], 1)]
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append((f"line {number}", json.loads(line)))
            except ValueError as err:
                raise ConfigError(f"{setting}: {path} line {number} is not valid JSON ({err.msg},"
                                  f" column {err.colno}): {allowed}") from None
    if not records:
        raise ConfigError(f"{setting}: {path} holds no records: {allowed}, at least one")
    for where, record in records:
        if not isinstance(record, dict):
            raise ConfigError(f"{setting}: {path} {where} holds a JSON {type(record).__name__}, "
                              f"not an object: {allowed}")
        for name, field in fields.items():
            if field and field not in record:
                raise ConfigError(f"{setting}: {path} {where} has no field {field!r} ({name}): "
                                  f"allowed are records that all have it, or another {name}")
