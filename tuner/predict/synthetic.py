"""An engine's cost surface from its synthetic-acceptance mode: the engine drafts k tokens per
step and accepts them at random at an asked rate instead of by the target's verdict (llama.cpp's
``--spec-synth-len``), so a step's time is measured without a drafter of that quality.

Per (concurrency level, k) the engine answers requests in batches of ``level``; each answer
carries the engine's own decode time and counts, from which
    decode steps = generated tokens − 1 − accepted drafts   (the first token is the prefill's)
    step time    = decode seconds / decode steps           (median over the requests)
    mean length  = (generated tokens − 1) / decode steps   (accepted + the target's token)
k = 0 is the engine without speculation (one token per step). In the synthetic mode the mean
length must be the one asked, within sampling error (``SyntheticCell.length_error``); without it
(``--synth-len real``: vLLM's CPU build has none) each k runs at the draft model's own
acceptance. The step times become a hardware profile of that engine (``profile``): at each level
a surface of one context (the requests' mean cached tokens) × rows = k + 1, the step's whole
time (its draft forwards included, so the profile has no separate draft surface and no loop
overhead).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tuner.predict.surface import CostSurface, HardwareProfile

if TYPE_CHECKING:
    from tuner.measure.measurement import Measurement


@dataclass(frozen=True)
class SyntheticCell:
    """One (level, k): what the engine reported over its requests."""

    level: int                          # requests in flight together
    k: int                              # drafted tokens per step (0: no speculation)
    asked_length: float | None          # mean accepted length asked (target token included)
    requests: int
    decode_steps: int                   # summed over the requests
    decode_tokens: int                  # generated after the first token, summed
    step_s: float                       # median over requests of decode s / decode steps
    context: float                      # mean cached tokens over the decode (prompt + half)
    prompt_tokens: float = 0.0          # mean prompt length
    prompt_s: float = 0.0               # median prefill seconds (the engine's own)
    drafted: int = 0                    # drafted tokens, summed over the requests

    @property
    def drafted_per_step(self) -> float:
        """d: the drafted tokens per decode step (k where every step drafted in full)."""
        return self.drafted / self.decode_steps if self.decode_steps else 0.0

    @property
    def mean_length(self) -> float:
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0

    def length_error(self) -> float:
        """Standard error of ``mean_length`` if every step accepted independently at the
        geometric rates the engine resolves the asked length to (0 for k = 0)."""
        if not self.k or self.asked_length is None or not self.decode_steps:
            return 0.0
        p = geometric_rate(self.asked_length, self.k)
        probs = [p ** j * (1 - p) for j in range(self.k)] + [p ** self.k]   # j drafts accepted
        mean = sum(j * q for j, q in enumerate(probs))
        var = sum((j - mean) ** 2 * q for j, q in enumerate(probs))
        return math.sqrt(var / self.decode_steps)


def geometric_rate(length: float, k: int) -> float:
    """p with 1 + p + … + p^k = ``length`` (how llama.cpp resolves ``--spec-synth-len``)."""
    if length >= k + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if sum(mid ** j for j in range(1, k + 1)) < length - 1:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def cell(level: int, k: int, asked: float | None,
         runs: Sequence[tuple[Measurement, int]]) -> SyntheticCell:
    """``runs``: per request the engine's measurement and its prompt's length in tokens."""
    steps = [max(len(m.tokens) - 1 - m.accepted, 1) for m, _ in runs]
    return SyntheticCell(
        level, k, asked, len(runs), sum(steps), sum(max(len(m.tokens) - 1, 0) for m, _ in runs),
        statistics.median((m.decode_s or 0.0) / s for (m, _), s in zip(runs, steps)),
        statistics.fmean(n + len(m.tokens) / 2 for m, n in runs),
        statistics.fmean(n for _, n in runs),
        statistics.median(m.prompt_s or 0.0 for m, _ in runs),
        sum(m.counts.drafted for m, _ in runs))


def profile(cells: Sequence[SyntheticCell], *, machine: str, engine: str,
            build: Mapping[str, str], threads: int, models: Mapping[str, Any], made: str,
            length: float | str, drafting: str = "model") -> HardwareProfile:
    """The cells as a profile: per level a surface of rows k + 1 at the cells' mean context;
    the first level must be 1. ``drafting``: ``model`` (a draft model's steps) or ``ngram``
    (draft-free: n-gram drafting on prompts that repeat, its ``models.draft`` None)."""
    levels = sorted({c.level for c in cells})
    ks = sorted({c.k for c in cells})
    if levels[0] != 1 or ks[0] != 0:
        raise ValueError(f"a synthetic profile needs level 1 and k = 0 (got levels {levels}, "
                         f"k {ks})")
    context = round(statistics.fmean(c.context for c in cells))
    by = {(c.level, c.k): c for c in cells}
    prompt = round(statistics.fmean(by[level, 0].prompt_tokens for level in levels))
    surfaces = [(level, CostSurface((context,), tuple(k + 1 for k in ks),
                                    ((tuple(by[level, k].step_s for k in ks)),),
                                    ((prompt, by[level, 0].prompt_s),)),
                 None) for level in levels]      # one grid at every level: at_batch blends
    asked = f"{length:g}" if isinstance(length, (int, float)) else length
    at_one = [c for c in cells if c.k and c.level == 1]
    if drafting == "ngram":
        how = (f"{engine}, DRAFT-FREE: n-gram drafting without a draft model on prompts that "
               "repeat themselves (the n-gram lookup's own time included; drafted per step "
               + ", ".join(f"k={c.k} {c.drafted_per_step:.2f}" for c in at_one)
               + ", lengths " + ", ".join(f"k={c.k} {c.mean_length:.2f}" for c in at_one)
               + " at level 1)")
    elif length == "real":
        how = (f"{engine}, the draft model's own acceptance (no synthetic mode; lengths "
               + ", ".join(f"k={c.k} {c.mean_length:.2f}" for c in at_one) + " at level 1)")
    else:
        how = f"{engine} synthetic acceptance (mean length {asked} asked, capped at k + 1)"
    what = "the n-gram lookup included" if drafting == "ngram" else "draft forwards included"
    note = (f"{how}: "
            f"a step's whole time with k drafted tokens ({what}) at {context} "
            "cached tokens; rows = k + 1; prefill: the baseline's median at the mean prompt "
            f"({prompt} tokens)")
    return HardwareProfile(kind="measured", machine=machine, engine=engine, build=dict(build),
                           threads=threads, models=dict(models), target=surfaces[0][1],
                           made=made, note=note, batches=tuple(surfaces))
