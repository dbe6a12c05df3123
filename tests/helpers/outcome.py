"""What the outcome tests share (tests/test_outcome.py, tests/test_engines.py)."""

from __future__ import annotations

import json


def json_texts(value, where="") -> list[str]:
    """Every string inside ``value`` that is JSON text of an object or a list."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in json_texts(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in json_texts(v, f"{where}[{i}]")]
    if isinstance(value, str) and value.strip()[:1] in "[{":
        try:
            json.loads(value)
        except ValueError:
            return []
        return [where]
    return []
