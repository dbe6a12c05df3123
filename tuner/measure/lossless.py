"""The lossless check at temperature 0: a lossless method's tokens against vanilla's.

In fp32 any divergence is a bug. In bf16/fp16 a divergence is excused only as a rounding near-tie,
judged in units of the dtype's resolution (ulps) at the baseline's own logits.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from tuner.measure.measurement import Measurement


class LosslessViolation(RuntimeError):
    """A lossless method's greedy tokens differ from vanilla's beyond a floating-point near-tie."""


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ulp(value: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype`` numbers next to ``value`` (bf16: 2^(e−7) for |value| in [2^e, 2^(e+1)))."""
    if value == 0:
        return float(torch.finfo(dtype).tiny)
    return float(torch.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(abs(value)))


def logit_gap_ulps(target: Any, ids: list[int], chosen: int, other: int | None) -> float:
    """How far ``other`` trails ``chosen`` in the target's next-token logits after ``ids``, in units
    of the model dtype's resolution at ``chosen``'s logit (``other`` None: the runner-up)."""
    device = next(target.parameters()).device
    with torch.inference_mode():
        logits = target(torch.tensor([ids], device=device), logits_to_keep=1).logits[0, -1]
    if other is None:
        other = int(logits.topk(2).indices[1]) if int(logits.argmax()) == chosen \
            else int(logits.argmax())
    top, runner = float(logits[chosen]), float(logits[other])
    return (top - runner) / ulp(top, logits.dtype)


def check_against_vanilla(m: Measurement, reference: Sequence[int], prompt_ids: list[int],
                          target: Any, tolerance_ulps: float,
                          gap_fn: Callable[[Any, list[int], int, int | None], float]
                          = logit_gap_ulps) -> Measurement:
    """Fill ``matches_vanilla``; raise ``LosslessViolation`` unless a divergence is a near-tie.

    In fp32 any divergence is a bug. In bf16/fp16, verifying many tokens in one forward rounds
    differently from one token at a time and can flip an argmax between two logits that are equal
    up to rounding (Ouroboros App. A). It counts as a near-tie only when, in the baseline's own
    logits at the first differing position, the method's token trails vanilla's by at most
    ``tolerance_ulps`` units of the dtype's resolution there (bf16 has 8 significant bits: logits
    near 20 are 0.125 apart). A probability-gap rule cannot tell these apart: bench/near_ties.py
    measured one-ulp flips with a top-2 probability gap of 2e-2 on the embedded default.
    """
    position = first_difference(m.tokens, reference)
    if position is None:
        return replace(m, matches_vanilla=True)
    dtype = next(target.parameters()).dtype
    where = f"prompt {m.prompt_id} differs from vanilla at new-token position {position}"
    if dtype == torch.float32:
        raise LosslessViolation(f"{where} (fp32: a lossless method must match exactly)")
    if position >= len(reference) or position >= len(m.tokens):
        raise LosslessViolation(f"{where}: one output stops early ({len(m.tokens)} vs "
                                f"{len(reference)} tokens), which no rounding explains")
    ulps = gap_fn(target, list(prompt_ids) + list(reference[:position]), int(reference[position]),
                  int(m.tokens[position]))
    if ulps > tolerance_ulps:
        raise LosslessViolation(f"{where}: its token trails vanilla's by {ulps:.1f} ulp of "
                                f"{dtype} in the baseline's logits (near_tie_ulps="
                                f"{tolerance_ulps:g}), so it is not a rounding near-tie")
    return replace(m, matches_vanilla=False, near_tie=True)
