"""A user's own prompts (``+task=prompts task.data.local=FILE``): the common export formats.

One record per line (JSON Lines), or one JSON array of records (as ShareGPT dumps often are), or
plain text with one prompt per line. Each record becomes chat messages ending with the turn to
generate after:

* OpenAI chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}``;
  content is a string or a list of ``{"type": "text", "text": ...}`` parts; a multi-turn record
  is cut after its last user turn (that turn is the one generated for).
* ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}, ...]}``,
  cut after the last ``human`` turn.
* ``{"prompt": "..."}``: one user turn.
* plain text (``format: text``, or ``auto`` on a file not ending in .json/.jsonl): each
  non-blank line is one user turn.

``format: auto`` reads each JSON record by its keys (messages, conversations, prompt). A prompt's
id is its line number (``record N`` in a JSON array), so ids stay put when the file grows at the
end. A malformed record is refused with one line naming the file, the line and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

FORMATS = ("auto", "chat", "sharegpt", "prompt", "text")
KEYS = {"chat": "messages", "sharegpt": "conversations", "prompt": "prompt"}
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant"}
ALLOWED = {
    "chat": 'allowed is {"messages": [{"role": "system"|"user"|"assistant", "content": TEXT}, '
            '...]} with at least one user turn',
    "sharegpt": 'allowed is {"conversations": [{"from": "system"|"human"|"gpt", "value": TEXT}, '
                '...]} with at least one human turn',
    "prompt": 'allowed is {"prompt": TEXT} with a non-empty TEXT',
    "auto": 'allowed is one JSON object per line with "messages" (OpenAI chat), '
            '"conversations" (ShareGPT) or "prompt"',
}


class PromptFileError(ValueError):
    """A user prompt file that cannot be read; the message is one line."""


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_prompts(path: Path, fmt: str = "auto", setting: str | None = None
                 ) -> list[dict[str, Any]]:
    """The prompts of ``path`` as records ``{"line": N, "messages": [[role, content], ...]}``,
    in file order; every message list ends with a user turn.

    ``setting``: how the user named the file, opening every message (default
    ``task.data.local='<path>'``)."""
    if fmt not in FORMATS:
        raise PromptFileError(f"task.data.format={fmt!r} is invalid: allowed are "
                              f"{', '.join(FORMATS)}")
    where = f"{setting or f'task.data.local={str(path)!r}'}: {path}"
    if not path.is_file():
        raise PromptFileError(f"{where}: no such file: allowed is a JSON Lines, JSON or text file "
                              "of prompts")
    text = path.read_text(encoding="utf-8", errors="replace")
    if fmt == "text" or (fmt == "auto" and path.suffix.lower() not in (".json", ".jsonl")):
        records = [{"line": n, "messages": [["user", line.strip()]]}
                   for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    else:
        records = [{"line": n, "messages": _messages(record, fmt, f"{where} {label}")}
                   for n, label, record in _json_records(text, where)]
    if not records:
        raise PromptFileError(f"{where}: the file holds no prompts: allowed is a file with at "
                              "least one")
    return records


def _json_records(text: str, where: str) -> Iterator[tuple[int, str, Any]]:
    """(number, "line N" / "record N", parsed record) for JSON Lines or one JSON array."""
    if text.lstrip().startswith("["):
        try:
            found = json.loads(text)
        except ValueError as err:
            raise PromptFileError(f"{where} line {err.lineno} is not valid JSON ({err.msg}, "
                                  f"column {err.colno}): allowed is one JSON array of records or "
                                  "one JSON object per line") from None
        for number, record in enumerate(found, 1):
            yield number, f"record {number}", record
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, f"line {number}", json.loads(line)
        except ValueError as err:
            raise PromptFileError(f"{where} line {number} is not valid JSON ({err.msg}, column "
                                  f"{err.colno}): allowed is one JSON object per line") from None


def _messages(record: Any, fmt: str, where: str) -> list[list[str]]:
    if not isinstance(record, dict):
        raise PromptFileError(f"{where} is a JSON {type(record).__name__}, not an object: "
                              f"{ALLOWED[fmt]}")
    kind = fmt if fmt != "auto" else next((k for k, key in KEYS.items() if key in record), None)
    if kind is None or KEYS[kind] not in record:
        raise PromptFileError(f"{where} has none of the fields "
                              f"{'/'.join(KEYS[k] for k in ((fmt,) if fmt != 'auto' else KEYS))}"
                              f" ({sorted(record)[:6]} found): {ALLOWED[fmt]}")
    if kind == "prompt":
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptFileError(f"{where}: prompt={prompt!r:.60} is not a non-empty string: "
                                  f"{ALLOWED['prompt']}")
        return [["user", prompt]]
    turns = record[KEYS[kind]]
    if not isinstance(turns, list) or not turns:
        raise PromptFileError(f"{where}: {KEYS[kind]} is not a non-empty list: {ALLOWED[kind]}")
    messages = [_turn(turn, kind, f"{where}: {KEYS[kind]}[{i}]") for i, turn in enumerate(turns)]
    last_user = max((i for i, (role, _) in enumerate(messages) if role == "user"), default=None)
    if last_user is None:
        raise PromptFileError(f"{where} has no {'human' if kind == 'sharegpt' else 'user'} turn "
                              f"to generate after: {ALLOWED[kind]}")
    return messages[:last_user + 1]


def _turn(turn: Any, kind: str, where: str) -> list[str]:
    role_key, text_key = ("role", "content") if kind == "chat" else ("from", "value")
    if not isinstance(turn, Mapping) or role_key not in turn or text_key not in turn:
        raise PromptFileError(f"{where} is not an object with {role_key!r} and {text_key!r}: "
                              f"{ALLOWED[kind]}")
    names = {r: r for r in ROLES} if kind == "chat" else SHAREGPT_ROLES
    role = names.get(turn[role_key]) if isinstance(turn[role_key], str) else None
    if role is None:
        allowed = tuple(names)
        raise PromptFileError(f"{where}: {role_key}={turn[role_key]!r} is not one of "
                              f"{', '.join(allowed)}: {ALLOWED[kind]}")
    return [role, _text(turn[text_key], f"{where}.{text_key}", kind)]


def _text(content: Any, where: str, kind: str) -> str:
    if isinstance(content, str):
        return content
    if kind == "chat" and isinstance(content, list) and content and all(
            isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise PromptFileError(f"{where} is not text (a string, or a list of {{\"type\": \"text\", "
                          f"\"text\": ...}} parts; images and other parts cannot be replayed "
                          f"by a text model): {ALLOWED[kind]}")
