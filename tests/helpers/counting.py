"""Counting what a study runs (untimed generations), through the public function it calls."""

from __future__ import annotations

from typing import Any


def count_untimed_runs(monkeypatch: Any) -> list[int]:
    """Patch ``tuner.predict.trace.untimed_runs`` to record the prompts of every call (the
    list returned fills as the study runs)."""
    from tuner.predict import trace
    counted: list[int] = []
    real = trace.untimed_runs

    def counting(method, ids, *args, **kwargs):
        counted.append(len(ids))
        return real(method, ids, *args, **kwargs)
    monkeypatch.setattr(trace, "untimed_runs", counting)
    return counted
