"""The task: its class, template, metric, prompt counts and data source."""

from __future__ import annotations

from typing import Any, Mapping

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
    source = (task.get("data") or {}).get("source", "auto")
    if source not in SOURCES:
        raise ConfigError(f"task.data.source={source!r} is invalid: allowed are auto, local, hub")
