"""An engine server's decode-phase speedup per concurrency level, predicted from the engine's
own cost surface (``tuner.predict.synthetic``: a step's whole time at each level and number of
drafted tokens) and an acceptance: the trial's own counts (then the comparison with the trial's
measurement checks the cost side only), or another trial's, or another level's.

At level c, over the requests measured there (their ``decoding.acceptance.AcceptanceCounts``
summed; the first token of each request is its prefill's):
    decode steps  = Σ (generated − 1 − accepted)
    mean length L = tokens per decode step, 1 + Σ accepted / decode steps
    drafted d     = Σ drafted / decode steps                (per verification step)
    predicted decode-phase speedup = L · T_c(1) / T_c(d + 1)
with T_c(rows) the profile's step time at batch size c (linear between its batch sizes) at its
own context: the synthetic surface's rows are k + 1 for k drafted tokens per step, so a setting
that drafts fewer than its cap (llama.cpp's ``--spec-draft-p-min``, a short draft at the end) is
priced at the rows it really fed on average.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from decoding.acceptance import total
from tuner.measure.figures import level_key

if TYPE_CHECKING:
    from tuner.measure.evaluator import Paired
    from tuner.measure.measurement import Measurement
    from tuner.predict.schedule import LevelCheck, Schedule
    from tuner.predict.surface import HardwareProfile

PREDICTED = "predicted_decode_speedup"      # per level, beside decode_speedup there
LENGTH = "prediction_mean_length"           # the L it used, per level
DRAFTED = "prediction_drafted_per_step"     # the d it used, per level


@dataclass(frozen=True)
class LevelAcceptance:
    """What the engine counted at one level (see the module docstring)."""

    level: int
    mean_length: float                      # L
    drafted_per_step: float                 # d

    @classmethod
    def of(cls, level: int, ms: Sequence[Measurement]) -> LevelAcceptance | None:
        """From the method's measurements at ``level``; None without a decode step."""
        counts = total([m.counts for m in ms])
        if not counts.decode_steps:
            return None
        return cls(level, counts.tokens_per_decode_step, counts.drafted_per_decode_step)


def step_s(profile: HardwareProfile, level: int, rows: float) -> float:
    """T_c(rows): the profile's step time at batch size ``level`` (linear between its batch
    sizes; ValueError outside them), at its own context."""
    surface = profile.at_batch(level).target
    return surface.step_s(surface.contexts[0], rows)


def decode_speedup(profile: HardwareProfile, level: int, mean_length: float,
                   drafted_per_step: float) -> float:
    """L · T_c(1) / T_c(d + 1) at batch size ``level`` (ValueError outside the profile's
    batch sizes)."""
    return mean_length * step_s(profile, level, 1) / step_s(profile, level,
                                                            drafted_per_step + 1.0)


def trial_predictions(pairs: Sequence[Paired], profile: HardwareProfile) -> dict[str, float]:
    """Per level the trial measured: ``predicted_decode_speedup@c<level>`` from its own counts
    there, and the L and d it used (``prediction_mean_length@c<level>``,
    ``prediction_drafted_per_step@c<level>``)."""
    out: dict[str, float] = {}
    for level in sorted({p.method.concurrency for p in pairs}):
        got = LevelAcceptance.of(level, [p.method for p in pairs
                                         if p.method.concurrency == level])
        if got is None:
            continue
        out.update({level_key(PREDICTED, level): decode_speedup(profile, level, got.mean_length,
                                                                got.drafted_per_step),
                    level_key(LENGTH, level): got.mean_length,
                    level_key(DRAFTED, level): got.drafted_per_step})
    return out


def plan_levels(by_k: Mapping[int, Mapping[str, Any]], levels: Sequence[int],
                profile: HardwareProfile) -> tuple[Schedule, list[LevelCheck]]:
    """The per-batch-size schedule of ``by_k`` (per drafted-token count k, a trial's recorded
    figures: its acceptance per level, ``acceptance_of``, and its measured
    ``decode_speedup@c<level>``) over ``levels`` (two or more, ascending), and its check per
    level. Each k is predicted at every batch size up to the last level from its acceptance at
    the nearest level at or below it (``tuner.predict.schedule.plan``), then checked against
    the measured decode-phase speedups (``tuner.predict.schedule.check``)."""
    from tuner.predict.schedule import check, plan
    cache: dict[tuple[int, int], float] = {}

    def predicted(k: int, batch: int) -> float:
        if (k, batch) not in cache:
            at = max(c for c in levels if c <= batch)       # the nearest measured level below
            got = acceptance_of(by_k[k], at)
            if got is None:
                raise ValueError(f"k={k}: no acceptance recorded at level {at}")
            cache[k, batch] = decode_speedup(profile, batch, got.mean_length,
                                             got.drafted_per_step)
        return cache[k, batch]

    def measured(k: int, batch: int) -> float | None:
        value = by_k[k].get(level_key("decode_speedup", batch))
        return None if value is None else float(value)

    ks = sorted(by_k)
    planned = plan(predicted, ks, levels)
    return planned, check(planned, measured, ks)


def acceptance_of(figures: Mapping[str, Any], level: int) -> LevelAcceptance | None:
    """A trial's recorded acceptance at ``level`` (None where it recorded none)."""
    length = figures.get(level_key(LENGTH, level))
    drafted = figures.get(level_key(DRAFTED, level))
    if length is None or drafted is None:
        return None
    return LevelAcceptance(level, float(length), float(drafted))
