"""Physical bounds: what no undisturbed paired measurement can read.

Every step of a speculative loop, ours or an engine's, runs at least one target forward, and a
forward of k + 1 tokens costs at least what one token costs. Over a request's decode phase the
method's time is therefore at least its decode steps × one forward, and vanilla's is its tokens
after the first × one forward: the decode-phase speedup cannot exceed the method's tokens per
decode step L (``decoding.acceptance.AcceptanceCounts.tokens_per_decode_step``). End to end the
prefill adds the same time to both sides where it is equal, so that speedup (a mediant of L and
1) cannot exceed L either. At several requests in flight a request's last steps may run in a
smaller batch once its neighbours have finished, which costs less; the bound of every request
of a batch is the largest L in it (the fastest request's own gain bounds its neighbours').

A measurement beyond ``L × (1 + slack)`` is impossible beyond the noise: the machine was
disturbed while one side ran (a sibling process, a contention guard that gave up waiting), or
the two sides did not run alike (the prefill gap of docs/engines.md). The paired protocol
(``tuner.measure.paired``) measures such a batch again, both sides; beyond the bound again, the
trial fails with ``ImpossibleMeasurement``, so its figure never ranks, wins or reaches a
summary. ``slack``: ``DEFAULT_SLACK`` (about four standard deviations of one pair's log ratio in
the A/A controls of docs/benchmarks.md: 0.06 on 32-token GSM8K generations on 2 CPUs), or wider
where a study's own A/A control measured more noise (``slack_for``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from tuner.measure.measurement import Measurement

DEFAULT_SLACK = 0.25      # one pair's log ratio: sd ≈ 0.06 in quiet A/A runs here; 4 sd ≈ 27 %
SLACK_SDS = 4.0           # a study's A/A noise widens the slack to this many of its sds


class ImpossibleMeasurement(RuntimeError):
    """A batch read beyond its physical bound twice (the trial fails with this reason)."""


@dataclass(frozen=True)
class Beyond:
    """One request's figure beyond its bound."""

    prompt_id: str
    figure: str                 # "decode-phase speedup" | "end-to-end speedup" | a rate figure
    value: float
    length: float               # the L that bounds it
    bound: float                # L × (1 + slack)
    waited_s: float             # the contention guard's wait before this batch

    def line(self) -> str:
        waited = f", measured after waiting {self.waited_s:.0f} s for a quiet machine" \
            if self.waited_s else ""
        return (f"{self.figure} {self.value:.3f}x on prompt {self.prompt_id} at "
                f"{self.length:.2f} tokens per decode step (at most {self.bound:.3f}x"
                f"{waited})")


def slack_for(pair_log_sd: float | None) -> float:
    """The slack beyond L: ``DEFAULT_SLACK``, or ``SLACK_SDS`` standard deviations of one pair's
    log ratio where an A/A control measured a noisier path."""
    if pair_log_sd is None or not math.isfinite(pair_log_sd):
        return DEFAULT_SLACK
    return max(DEFAULT_SLACK, math.exp(SLACK_SDS * pair_log_sd) - 1.0)


def credible(gain: float, length: float | None) -> float:
    """The part of a measured ratio speculation can account for: no decode phase gains more
    than its tokens per decode step ``length``; a setting that accepted nothing (1.00) cannot be
    faster than vanilla, whatever a pair of server processes read (None: not counted)."""
    return gain if length is None else min(gain, length)


def batch_length(ms: Sequence[Measurement]) -> float:
    """The bound's L for every request of one batch: the largest tokens per decode step in it."""
    return max((m.counts.tokens_per_decode_step for m in ms), default=1.0)


def beyond(ms: Sequence[Measurement], slack: float) -> list[Beyond]:
    """The requests of one batch (their paired speedups set) whose decode-phase or end-to-end
    speedup exceeds the batch's bound."""
    length = batch_length(ms)
    bound = length * (1.0 + slack)
    out = []
    for m in ms:
        for figure, value in (("decode-phase speedup", m.decode_speedup),
                              ("end-to-end speedup", m.speedup)):
            if value is not None and value > bound:
                out.append(Beyond(m.prompt_id, figure, value, length, bound, m.waited_s))
    return out


def rate_beyond(figures: dict[str, float], length: float, slack: float) -> list[str]:
    """Per-rate ratios (``tpot_ratio@r…``, ``throughput_ratio@r…``) beyond the trial's largest L
    (the rates run the same prompts; their requests' acceptance is not counted one by one)."""
    bound = length * (1.0 + slack)
    return [f"{key} {value:.3f}x at most {length:.2f} tokens per decode step (bound "
            f"{bound:.3f}x)" for key, value in figures.items()
            if key.startswith(("tpot_ratio@", "throughput_ratio@")) and value > bound]
