"""Counting what a study runs (untimed generations), through the public function it calls."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Iterator


class Counted:
    """The prompts of every call, in call order, as a list reads them (``sum``, ``clear``);
    kept in a file appended to by each call, so that calls made in forked processes (the
    ranking's untimed workers, ``tuner.predict.workers``) count as well."""

    def __init__(self) -> None:
        handle, self.path = tempfile.mkstemp(prefix="untimed-runs-")
        os.close(handle)

    def add(self, prompts: int) -> None:
        with open(self.path, "a") as out:        # one short line per call: an atomic append
            out.write(f"{prompts}\n")

    def calls(self) -> list[int]:
        """The prompts of each call so far, in call order."""
        with open(self.path) as lines:
            return [int(line) for line in lines if line.strip()]

    def __iter__(self) -> Iterator[int]:
        return iter(self.calls())

    def clear(self) -> None:
        open(self.path, "w").close()

    def __repr__(self) -> str:
        return repr(self.calls())


def count_untimed_runs(monkeypatch: Any) -> Counted:
    """Patch ``tuner.predict.trace.untimed_runs`` to record the prompts of every call (what it
    returns fills as the study runs, in this process and in its forked workers)."""
    from tuner.predict import trace
    counted = Counted()
    real = trace.untimed_runs

    def counting(method, ids, *args, **kwargs):
        counted.add(len(ids))
        return real(method, ids, *args, **kwargs)
    monkeypatch.setattr(trace, "untimed_runs", counting)
    return counted
