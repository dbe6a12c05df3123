"""The lossless check at temperature 0: a lossless method's tokens against vanilla's.

In fp32 any divergence is a bug. In bf16/fp16 a divergence is excused only as a rounding near-tie,
judged in units of the dtype's resolution (ulps) at the baseline's own logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class Gap:
    """How far the method's token trails the baseline's at the first differing position, in the
    baseline's own next-token distribution, and the tolerance a rounding near-tie explains.

    ``value`` and ``tolerance`` are in one unit the backend chooses (ulps of the model dtype in
    process; log-probability for a server); ``value`` None: the baseline did not report it;
    ``exact``: no gap is excused (fp32 weights); ``shown``: the failure in words."""

    value: float | None
    tolerance: float
    shown: str
    exact: bool = False

    @property
    def near_tie(self) -> bool:
        return not self.exact and self.value is not None and self.value <= self.tolerance


def judge(m: Measurement, reference: Sequence[int], gap: Callable[[int], Gap], baseline: str,
          varies: Callable[[int], bool] = lambda position: False) -> Measurement:
    """The one near-tie rule: fill ``matches_vanilla``; raise ``LosslessViolation`` unless the
    first divergence is a rounding near-tie (``gap(position)``), or, with several requests in
    flight, where the baseline's own output changes when asked again (``varies(position)``:
    flagged ``engine_varies``, not judged)."""
    position = first_difference(m.tokens, reference)
    if position is None:
        return replace(m, matches_vanilla=True)
    level = f" (concurrency {m.concurrency})" if m.concurrency > 1 else ""
    where = f"prompt {m.prompt_id}{level} differs from {baseline} at new-token position {position}"
    if position >= len(reference) or position >= len(m.tokens):
        raise LosslessViolation(f"{where}: one output stops early ({len(m.tokens)} vs "
                                f"{len(reference)} tokens), which no rounding explains")
    found = gap(position)
    if found.near_tie:
        return replace(m, matches_vanilla=False, near_tie=True)
    if varies(position):
        # the engine's own non-speculative output changes from run to run at or before this
        # position (continuous batching changes its kernels' numerics, e.g. quantised weights):
        # a token comparison at this level cannot tell, so it is not judged
        return replace(m, matches_vanilla=False, engine_varies=True)
    raise LosslessViolation(f"{where}{' ' if found.exact else ': '}{found.shown}")


def model_gap(target: Any, ids: list[int], chosen: int, other: int, tolerance_ulps: float,
              gap_fn: Callable[[Any, list[int], int, int | None], float] = logit_gap_ulps) -> Gap:
    """The in-process baseline's gap: ``gap_fn`` ulps of the target's dtype; fp32: exact."""
    dtype = next(target.parameters()).dtype
    if dtype == torch.float32:
        return Gap(None, 0.0, "(fp32: a lossless method must match exactly)", exact=True)
    ulps = gap_fn(target, ids, chosen, other)
    return Gap(ulps, tolerance_ulps, f"its token trails vanilla's by {ulps:.1f} ulp of {dtype} "
               f"in the baseline's logits (near_tie_ulps={tolerance_ulps:g}), so it is not a "
               "rounding near-tie")


def check_against_vanilla(m: Measurement, reference: Sequence[int], prompt_ids: list[int],
                          target: Any, tolerance_ulps: float,
                          gap_fn: Callable[[Any, list[int], int, int | None], float]
                          = logit_gap_ulps) -> Measurement:
    """``judge`` against the in-process vanilla (the target model itself answers the gap).

    In fp32 any divergence is a bug. In bf16/fp16, verifying many tokens in one forward rounds
    differently from one token at a time and can flip an argmax between two logits that are equal
    up to rounding (Ouroboros App. A). It counts as a near-tie only when, in the baseline's own
    logits at the first differing position, the method's token trails vanilla's by at most
    ``tolerance_ulps`` units of the dtype's resolution there (bf16 has 8 significant bits: logits
    near 20 are 0.125 apart). A probability-gap rule cannot tell these apart: bench/near_ties.py
    measured one-ulp flips with a top-2 probability gap of 2e-2 on the embedded default.
    """
    def gap(position: int) -> Gap:
        return model_gap(target, list(prompt_ids) + list(reference[:position]),
                         int(reference[position]), int(m.tokens[position]), tolerance_ulps,
                         gap_fn)

    return judge(m, reference, gap, "vanilla")
