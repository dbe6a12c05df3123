"""An engine server's decode-phase speedup per concurrency level, predicted from the engine's
own cost surface (``tuner.predict.synthetic``: a step's whole time at each level and number of
drafted tokens) and an acceptance: the trial's own counts (then the comparison with the trial's
measurement checks the cost side only), or another trial's, or another level's.

At level c, over the requests measured there (their ``decoding.acceptance.AcceptanceCounts``
summed; the first token of each request is its prefill's):
    decode steps  = Σ (generated − 1 − accepted)
    mean length L = tokens per decode step, 1 + Σ accepted / decode steps
    drafted d     = Σ drafted / decode steps                (per verification step)
    drafting s    = Σ drafts / decode steps                 (steps that drafted at all)
    predicted decode-phase speedup = L · T_c(1) / E[T_c]
with T_c(rows) the profile's step time at batch size c (linear between its batch sizes) at its
own context (the synthetic surface's rows are k + 1 for k drafted tokens per step), and E[T_c]
the expected step: each of the c requests in a step drafts ℓ = d / s tokens with chance s and
none otherwise, independently, so

    E[T_c] = Σ_j C(c, j) s^j (1 − s)^(c − j) · T_c(1 + j · ℓ / c)

(j requests drafting: 1 + j·ℓ/c rows per request). A draft model drafts at every step (s = 1):
E[T_c] = T_c(d + 1), the rows it really fed on average (``--spec-draft-p-min`` and short drafts
at the end included). N-gram drafting is all or nothing: a match drafts its length, no match
drafts nothing. Priced at the mean rows instead, a deployment drafting 4 tokens in a fifth of
its steps was priced T(1.8) where it paid 0.2·T(5) + 0.8·T(1): on a step time that rises
steeply from 1 row to 2 and slowly after (vLLM on this CPU: +47 % then +16 % to 5 rows), 12 %
too dear; the watch recommended k = 1 for +11 % and an A B measured 0.99x (docs/watch.md).
Where an engine does not count its drafts (llama.cpp's per-request timings beyond
concurrency 1), s = 1: the mean rows.
"""

from __future__ import annotations

import math
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
DRAFTING = "prediction_drafting_share"      # the s it used, per level (absent before: 1)


@dataclass(frozen=True)
class LevelAcceptance:
    """What the engine counted at one level (see the module docstring)."""

    level: int
    mean_length: float                      # L
    drafted_per_step: float                 # d
    drafting_share: float = 1.0             # s

    @classmethod
    def of(cls, level: int, ms: Sequence[Measurement]) -> LevelAcceptance | None:
        """From the method's measurements at ``level``; None without a decode step."""
        counts = total([m.counts for m in ms])
        if not counts.decode_steps:
            return None
        return cls(level, counts.tokens_per_decode_step, counts.drafted_per_decode_step,
                   drafting_share(counts.drafts, counts.drafted, counts.decode_steps))


def drafting_share(drafts: int, drafted: int, steps: int) -> float:
    """s = drafts / decode steps (at most 1); 1 where drafts were not counted but tokens were
    (the mean rows: module docstring), 0 where nothing was drafted."""
    if drafted <= 0 or steps <= 0:
        return 0.0
    return min(drafts / steps, 1.0) if drafts > 0 else 1.0


def step_s(profile: HardwareProfile, level: int, rows: float) -> float:
    """T_c(rows): the profile's step time at batch size ``level`` (linear between its batch
    sizes; ValueError outside them), at its own context."""
    surface = profile.at_batch(level).target
    return surface.step_s(surface.contexts[0], rows)


def expected_step_s(profile: HardwareProfile, level: int, drafted_per_step: float,
                    share: float = 1.0) -> float:
    """E[T_c]: a step's expected time at batch size ``level`` where each request drafts
    ``drafted_per_step / share`` tokens with chance ``share``, else none (module docstring)."""
    share = min(max(share, 0.0), 1.0)
    if drafted_per_step <= 0 or share <= 0:
        return step_s(profile, level, 1)
    length = drafted_per_step / share
    return sum(math.comb(level, j) * share ** j * (1.0 - share) ** (level - j) *
               step_s(profile, level, 1.0 + j * length / level) for j in range(level + 1))


def decode_speedup(profile: HardwareProfile, level: int, mean_length: float,
                   drafted_per_step: float, share: float = 1.0) -> float:
    """L · T_c(1) / E[T_c] at batch size ``level`` (ValueError outside the profile's batch
    sizes; ``share`` s = 1: T_c(d + 1))."""
    return mean_length * step_s(profile, level, 1) / expected_step_s(
        profile, level, drafted_per_step, share)


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
                                                                got.drafted_per_step,
                                                                got.drafting_share),
                    level_key(LENGTH, level): got.mean_length,
                    level_key(DRAFTED, level): got.drafted_per_step,
                    level_key(DRAFTING, level): got.drafting_share})
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
                                             got.drafted_per_step, got.drafting_share)
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
    return LevelAcceptance(level, float(length), float(drafted),
                           float(figures.get(level_key(DRAFTING, level), 1.0)))
