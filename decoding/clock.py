"""Phase timing without per-step device synchronisation.

On CUDA each phase is bracketed by a pair of recorded events and nothing waits until ``totals()``
is read once, at the end of a generation. On CPU the work is synchronous and ``perf_counter`` is
exact. Methods only mark phases ("draft", "verify"); the tuner owns the wall clock.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch


class PhaseClock:
    """Accumulates time per named phase for one generation."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._cuda = torch.device(device).type == "cuda"
        self._seconds: dict[str, float] = defaultdict(float)
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = \
            defaultdict(list)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[name].append((start, end))
        else:
            began = time.perf_counter()
            yield
            self._seconds[name] += time.perf_counter() - began

    def totals(self) -> dict[str, float]:
        """Seconds per phase (one device synchronisation on CUDA, none on CPU)."""
        if self._cuda and self._events:
            torch.cuda.synchronize()
            for name, pairs in self._events.items():
                self._seconds[name] += sum(s.elapsed_time(e) for s, e in pairs) / 1000.0
            self._events.clear()
        return dict(self._seconds)
