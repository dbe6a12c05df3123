"""Predicted speed = acceptance × cost: a replayed sequence of verification steps (or the forwards
of an untimed generation, ``tuner.predict.trace``) priced by a cost surface, against vanilla on the
same surface.

A generation's predicted seconds are the sum over its steps of
  * the target forward: the prompt's prefill (plus the first draft) on the first step, else
    ``rows`` = uncached committed tokens + draft after ``context − 1`` cached tokens;
  * the draft model's forwards (methods with one): its prefill on the first step, then one
    forward per drafted token;
  * the loop's own time per step (``HardwareProfile.step_overhead_s``: ``draft_loop`` with a
    draft model, else ``loop``), which may be negative (the surface timed the forwards slower
    than the loop runs them) but never prices a step below half its forwards (``priced``).
Vanilla's are its prefill plus one 1-row forward per further token (with vanilla's overhead). The
predicted paired speedup of a prompt is vanilla's seconds over the method's for the same tokens;
a trial's is the geometric mean over its prompts, as the measured ``speedup`` is
(``tuner.measure.measurement.summarize``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from decoding.acceptance import AcceptanceCounts
from tuner.measure.measurement import geometric_mean

if TYPE_CHECKING:
    from decoding.replay import ReplayedStep
    from tuner.predict.surface import CostSurface, HardwareProfile
    from tuner.predict.trace import TracedForward, TracedGeneration


def priced(forwards_s: float, overhead_s: float) -> float:
    """One step: its forwards plus the loop's overhead, at least half its forwards."""
    return max(forwards_s + overhead_s, 0.5 * forwards_s)


def forward_seconds(steps: Sequence[ReplayedStep], target: CostSurface,
                    draft: CostSurface | None, overhead_s: float = 0.0) -> float:
    """Predicted seconds of a method's generation (see the module docstring)."""
    total = 0.0
    for i, step in enumerate(steps):
        if i == 0:
            forwards = target.prefill_s(step.fed)
        else:
            forwards = target.step_s(step.context - 1, step.fed)
        if draft is not None and step.draft_forwards:
            later = step.draft_forwards - (1 if i == 0 else 0)
            if i == 0:
                forwards += draft.prefill_s(step.context)
            forwards += later * draft.step_s(step.context, 1)
        total += priced(forwards, overhead_s)
    return total


def traced_forward_seconds(forward: TracedForward, target: CostSurface,
                           draft: CostSurface | None) -> float:
    """One traced forward priced: a prefill over an empty cache, else a cached step."""
    surface = target if forward.model == "target" else draft
    if surface is None:
        raise ValueError("a draft-model forward needs a profile with a draft surface")
    if forward.context == 0:
        return surface.prefill_s(forward.rows)
    return surface.step_s(forward.context, forward.rows)


def traced_seconds(generation: TracedGeneration, target: CostSurface,
                   draft: CostSurface | None, overhead_s: float) -> float:
    """Predicted seconds of a traced generation: every step's forwards plus the loop's overhead
    (``priced``)."""
    return sum(priced(sum(traced_forward_seconds(f, target, draft) for f in step), overhead_s)
               for step in generation.grouped())


def vanilla_forward_seconds(target: CostSurface, prompt_len: int, new_tokens: int,
                            overhead_s: float = 0.0) -> float:
    """Predicted seconds of vanilla's ``new_tokens`` after a prompt of ``prompt_len``."""
    total = priced(target.prefill_s(prompt_len), overhead_s)
    for i in range(1, new_tokens):
        total += priced(target.step_s(prompt_len + i - 1, 1), overhead_s)
    return total


@dataclass(frozen=True)
class Prediction:
    """A trial's predicted figures and where their acceptance came from."""

    speedup: float                       # geometric mean over prompts
    mean_accepted_tokens: float          # 1 + accepted / steps, over all prompts
    source: str                          # "replay" (vanilla trajectory + drafter), or
                                         # "untimed" (the method's own untimed run, traced)
    per_prompt: tuple[float, ...] = ()   # [prompts] predicted paired speedups


def predict(generations: Sequence[tuple[int, Sequence[ReplayedStep]] | TracedGeneration],
            profile: HardwareProfile, uses_draft: bool) -> Prediction:
    """``generations``: per prompt, (prompt length, replayed steps), or the forwards of an
    untimed generation (``tuner.predict.trace``); the ``source`` follows from which."""
    from tuner.predict.trace import TracedGeneration
    overhead = profile.step_overhead_s
    loop = overhead.get("draft_loop", overhead.get("loop", 0.0)) if uses_draft else \
        overhead.get("loop", 0.0)
    draft = profile.draft if uses_draft else None
    ratios, counts, source = [], AcceptanceCounts(), "replay"
    for generation in generations:
        if isinstance(generation, TracedGeneration):
            source = "untimed"
            prompt_len, new_tokens = generation.prompt_len, generation.new_tokens
            method_s = traced_seconds(generation, profile.target, draft, loop)
            counts += AcceptanceCounts(steps=generation.steps, accepted=generation.accepted)
        else:
            prompt_len, replayed = generation
            new_tokens = sum(s.committed for s in replayed)
            method_s = forward_seconds(replayed, profile.target, draft, loop)
            counts += AcceptanceCounts(steps=len(replayed),
                                       accepted=sum(s.accepted for s in replayed))
        vanilla_s = vanilla_forward_seconds(profile.target, prompt_len, new_tokens,
                                            overhead.get("vanilla", 0.0))
        ratios.append(vanilla_s / method_s)
    speedup = geometric_mean(ratios)
    return Prediction(speedup, counts.tokens_per_forward, source, tuple(ratios))


def calibration(pairs: Sequence[tuple[float, float]], names: Sequence[str] | None = None,
                tolerance: float = 0.15) -> dict[str, object]:
    """Predicted vs measured: median |predicted / measured − 1|, Spearman's ρ (None with fewer
    than 3 points or no spread), and the names of the points off by more than ``tolerance``."""
    errors = [abs(p / m - 1.0) for p, m in pairs]
    out: dict[str, object] = {"points": len(pairs),
                              "median_abs_error": statistics.median(errors) if errors else None,
                              "spearman": spearman([p for p, _ in pairs], [m for _, m in pairs])}
    if names is not None:
        out["off"] = [n for n, e in zip(names, errors) if e > tolerance]
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (scipy; average ranks for ties); None with fewer than 3
    points or no spread."""
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    from scipy.stats import spearmanr
    return float(spearmanr(xs, ys).statistic)


def summary_line(calib: Mapping[str, object], what: str = "trials") -> str:
    """E.g. 'prediction vs measurement over 12 trials: median error 6.1 %, Spearman 0.83'
    (``what``: what a point is, e.g. "trial-levels" in an engine)."""
    err, rho = calib.get("median_abs_error"), calib.get("spearman")
    text = (f"prediction vs measurement over {calib['points']} {what}: median error "
            f"{100 * err:.1f} %" if err is not None else "no prediction to compare")
    if rho is not None:
        text += f", Spearman {rho:.2f}"
    off = calib.get("off") or []
    if off:
        text += f"; off by > 15 %: {', '.join(map(str, off))}"
    return text
