"""The A/A control: vanilla against itself through a measuring path, and what it reads.

A measuring path is trusted once vanilla against itself reads 1.00 through it within its noise.
The control measures exactly the path a method's trials take, with a sibling of equal cost on
the method's side (``Evaluator.control``):

* in process: vanilla against a second vanilla, right after the method ran (untimed) in the same
  process, so that its history, caches, allocator state and resident models are in play;
* an engine server: the baseline as the study runs it beside that method's server, against a
  second server launched with the method's line and drafting off (``tuner.engines.serving``).

Per concurrency level, per figure (end to end, the decode phase, the time to the first token)
and per request rate (TPOT, TTFT, end to end, request by request of the same schedule):

    ratio     the geometric mean of the per-request paired ratios (the baseline's seconds over
              the sibling's: 1.00 when the two sides run alike)
    interval  a two-sided t interval of their logs at ``CONFIDENCE``, over the independent
              units (``tuner.measure.measurement.unit_ratios``): the requests at concurrency 1,
              the batches above it (a batch's requests share its schedule and move together)
    bound     the interval holds 1.00, and where ``MANY`` or more units were measured the
              ratio is within ±``TOLERANCE`` as well

The intervals themselves (``log_interval``, ``lower_bound``) are computed in one place,
``tuner.measure.intervals`` (the study's recommendation reads ``lower_bound`` of the held-out
ratios).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tuner.measure.figures import rate_text
from tuner.measure.intervals import (CONFIDENCE, MANY, TOLERANCE, Interval, log_interval,
                                     per_batch)

if TYPE_CHECKING:
    from tuner.measure.evaluator import Paired
    from tuner.measure.traffic import StreamedRequest

FIGURES = (("speedup", "end to end"), ("decode_speedup", "decode phase"),
           ("ttft_ratio", "time to first token"))


@dataclass(frozen=True)
class ControlRow:
    """One figure at one level or rate."""

    at: str                  # "concurrency 1", "request rate 2/s"
    figure: str              # "end to end", "decode phase", "time to first token", "TPOT"
    interval: Interval

    @property
    def within(self) -> bool:
        return self.interval.within()


@dataclass(frozen=True)
class ControlReport:
    """One path's A/A control (module docstring)."""

    path: str                                # what was measured against what
    rows: tuple[ControlRow, ...]
    seconds: float = 0.0
    details: Mapping[str, Any] = field(default_factory=dict)   # engine, task, prompts, ...

    @property
    def within(self) -> bool:
        return all(row.within for row in self.rows)

    @property
    def beyond(self) -> tuple[ControlRow, ...]:
        return tuple(row for row in self.rows if not row.within)

    @property
    def pair_log_sd(self) -> float | None:
        """The largest sd of one pair's log ratio over the rows (the path's noise)."""
        sds = [row.interval.log_sd for row in self.rows if row.interval.n >= 2]
        return max(sds) if sds else None

    @property
    def bias(self) -> float:
        """The largest |ratio - 1| over the rows: what the path reads against itself."""
        return max((abs(row.interval.ratio - 1.0) for row in self.rows), default=0.0)

    def lines(self) -> list[str]:
        head = f"A/A control: {self.path}"
        out = [head, f"  {'where':<20} {'figure':<20} {'ratio (interval, n)':<30} bound"]
        for row in self.rows:
            out.append(f"  {row.at:<20} {row.figure:<20} {row.interval.text():<30} "
                       f"{'within' if row.within else 'BEYOND'}")
        verdict = "every ratio within its bound" if self.within else \
            f"{len(self.beyond)} ratio(s) beyond the bound"
        out.append(f"  {verdict} (a {100 * CONFIDENCE:.0f} % interval holds 1.00; within "
                   f"±{100 * TOLERANCE:.0f} % where {MANY} or more were paired; n counts "
                   "requests at concurrency 1, batches above it)"
                   + (f"; {self.seconds:.0f} s" if self.seconds else ""))
        return out

    def gap_line(self) -> str:
        """The first row beyond its bound, in words (for a one-line refusal)."""
        row = self.beyond[0]
        return (f"{self.path}: {row.figure} at {row.at} reads {row.interval.text()} against "
                "itself")

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "within": self.within, "seconds": round(self.seconds, 1),
                "pair_log_sd": self.pair_log_sd, "details": dict(self.details),
                "rows": [{"at": r.at, "figure": r.figure, "ratio": r.interval.ratio,
                          "low": r.interval.low, "high": r.interval.high, "n": r.interval.n,
                          "log_sd": r.interval.log_sd, "within": r.within} for r in self.rows]}


def pair_ratios(pairs: Sequence[Paired]) -> dict[int, dict[str, list[float]]]:
    """Per level: each figure's ratios (baseline over the sibling) per independent unit, a
    request at concurrency 1, a batch above it (``pairs`` in the order measured)."""
    out: dict[int, dict[str, list[float]]] = {}
    for level in sorted({p.method.concurrency for p in pairs}):
        group = [p for p in pairs if p.method.concurrency == level]
        per_request = {
            "speedup": [p.method.speedup for p in group],
            "decode_speedup": [p.method.decode_speedup for p in group],
            "ttft_ratio": [p.baseline.prompt_s / p.method.prompt_s
                           if p.method.prompt_s and p.baseline.prompt_s else None
                           for p in group]}
        out[level] = {name: per_batch(values, level) for name, values in per_request.items()}
    return out


def level_rows(pairs: Sequence[Paired]) -> list[ControlRow]:
    rows = []
    for level, figures in sorted(pair_ratios(pairs).items()):
        for name, label in FIGURES:
            if figures[name]:
                rows.append(ControlRow(f"concurrency {level}", label,
                                       log_interval(figures[name])))
    return rows


def rate_rows(requests: Mapping[float, tuple[Sequence[StreamedRequest],
                                             Sequence[StreamedRequest]]]) -> list[ControlRow]:
    """Per rate, (the sibling's requests, the baseline's) of the same schedule, paired by their
    place in it: TPOT, TTFT and end to end, the baseline's seconds over the sibling's."""
    rows = []
    for rate, (side, base) in sorted(requests.items()):
        by_index = {r.index: r for r in base}
        ratios: dict[str, list[float]] = {"TPOT": [], "time to first token": [],
                                          "end to end": []}
        for r in side:
            ref = by_index.get(r.index)
            if ref is None:
                continue
            for label, a, b in (("TPOT", ref.tpot_s, r.tpot_s),
                                ("time to first token", ref.ttft_s, r.ttft_s),
                                ("end to end", ref.e2e_s, r.e2e_s)):
                if a and b:
                    ratios[label].append(a / b)
        for label, values in ratios.items():
            if values:
                rows.append(ControlRow(f"request rate {rate_text(rate)}/s", label,
                                       log_interval(values)))
    return rows
