"""Intervals of paired ratios: the one place they are computed.

``log_interval``: a ratio's geometric mean over paired values and its two-sided t interval on
their logs (the A/A control's, ``tuner.measure.control``); ``lower_bound``: the one-sided lower
bound a recommendation's held-out ratio must exceed 1.00 with (``tuner.measure.measurement``,
``tuner.measure.levels``). Below the records and the control, so that neither imports the other
for them.

At a concurrency level c > 1 the unit of either is the batch, not the request
(``per_batch``): the c requests of one batch are served together and share its schedule and
the machine's speed at that moment, so their ratios move together (one slow batch moves all c),
and an interval over requests would count one observation c times.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

CONFIDENCE = 0.99          # the control's two-sided interval
TOLERANCE = 0.03           # |ratio - 1| allowed once MANY requests were measured
MANY = 6


def load() -> None:
    """Import what the intervals compute with (``scipy.stats``: about a second on a 2-core CPU)
    now, in the study's opening: otherwise the first trial pays it, and the estimate made from
    that trial counts it once per trial left (5-point grids of ~0.5 s trials read 1.6x)."""
    import scipy.stats  # noqa: F401


def t_quantile(probability: float, freedom: int) -> float:
    """Student's t quantile (scipy)."""
    from scipy.stats import t
    return float(t.ppf(probability, freedom))


@dataclass(frozen=True)
class Interval:
    """A ratio's geometric mean over ``n`` paired values and its interval."""

    ratio: float
    low: float
    high: float
    n: int
    log_sd: float            # the sample sd of the values' logs (0.0 for one value)

    def within(self, tolerance: float = TOLERANCE, many: int = MANY) -> bool:
        """1.00 inside the interval, and within ±tolerance where ``many`` values were paired."""
        held = self.low <= 1.0 <= self.high
        return held and (self.n < many or abs(self.ratio - 1.0) <= tolerance)

    def text(self) -> str:
        return f"{self.ratio:.3f}x ({self.low:.3f}-{self.high:.3f}, {self.n})"


def log_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """The geometric mean of ``values`` (ratios > 0) and a two-sided t interval of their logs;
    with one value the interval is unbounded (nothing is known of its noise)."""
    logs = [math.log(v) for v in values]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return Interval(math.exp(mean), 0.0, math.inf, len(logs), 0.0)
    sd = statistics.stdev(logs)
    half = t_quantile(0.5 + confidence / 2, len(logs) - 1) * sd / math.sqrt(len(logs))
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs), sd)


def per_batch(ratios: Sequence[float | None], level: int) -> list[float]:
    """Per batch of ``level`` consecutive requests (in the order measured), the geometric mean
    of their ratios (None: not measured, left out; a batch with none is left out): the
    independent units of an interval at that level (module docstring)."""
    out = []
    for start in range(0, len(ratios), level):
        got = [math.log(r) for r in ratios[start:start + level] if r is not None]
        if got:
            out.append(math.exp(statistics.fmean(got)))
    return out


def lower_bound(values: Sequence[float], confidence: float = 0.95) -> float:
    """A one-sided lower confidence bound of the geometric mean of ``values`` (t on their
    logs): the held-out ratio a recommendation must exceed 1.00 with. 0.0 with one value."""
    logs = [math.log(v) for v in values]
    if len(logs) < 2:
        return 0.0
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    return math.exp(mean - t_quantile(confidence, len(logs) - 1) * sd / math.sqrt(len(logs)))
