"""Timing a method on prompts: one ``Measurement`` per prompt, and their summary.

Every generation is timed as a whole (device-synchronised before and after on CUDA; the text is
decoded after the window closes); the decoding loop only marks its draft/verify phases. Speedups are
paired: vanilla and the method run on the same prompt minutes apart (``paired_speedup``). Terms follow vLLM: ``mean_accepted_tokens`` = 1 +
accepted / target forwards (bonus included, vanilla = 1); ``acceptance_rate`` = accepted / drafted;
``block_efficiency`` = new tokens / target forwards (Ouroboros App. C).
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from decoding import generate
from tuner.measure.energy import EnergyReading


@dataclass(frozen=True)
class Measurement:
    """One method run on one prompt."""

    prompt_id: str
    category: str
    tokens: tuple[int, ...]             # [new_tokens]
    text: str
    wall_s: float                       # synchronised around the generation (decoding excluded)
    steps: int                          # target forwards
    drafted: int
    accepted: int
    draft_time_s: float
    verify_time_s: float
    accepted_per_position: tuple[int, ...]
    drafted_per_position: tuple[int, ...]
    speedup: float | None = None        # paired: vanilla's s/token over this run's s/token
    matches_vanilla: bool | None = None  # temperature 0 only
    near_tie: bool = False              # bf16/fp16 divergence explained by a near-tie
    truncated: bool = False             # stopped by max_new_tokens, not by EOS
    energy_j: float | None = None       # NVML energy of this generation (GPU only)
    mean_log_prob: float | None = None  # mean log p(token) under the unwarped target (lossy
    #                                     methods; tuner.measure.quality, after the timed window)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s

    @property
    def s_per_token(self) -> float:
        return self.wall_s / max(self.new_tokens, 1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Timer = Callable[[Any, list[int], int, torch.device], tuple[Any, float]]


def time_generation(method: Any, ids: list[int], max_new_tokens: int,
                    device: torch.device) -> tuple[Any, float]:
    """Generate (token ids only: text decoding stays outside the window) and time it."""
    synchronize(device)
    began = time.perf_counter()
    out = generate(method, ids, max_new_tokens)
    synchronize(device)
    return out, time.perf_counter() - began


def measure_prompt(method: Any, prompt: Any, ids: list[int], max_new_tokens: int,
                   tokenizer: Any, device: torch.device,
                   timer: Timer = time_generation) -> Measurement:
    out, wall = timer(method, ids, max_new_tokens, device)
    text = tokenizer.decode(out.tokens, skip_special_tokens=True) if tokenizer is not None else ""
    s = out.stats
    return Measurement(prompt.id, prompt.category, out.tokens, text, wall, s.steps,
                       s.drafted, s.accepted, s.draft_time_s, s.verify_time_s,
                       s.accepted_per_position, s.drafted_per_position,
                       truncated=len(out.tokens) >= max_new_tokens)


def paired_speedup(vanilla: Measurement, method: Measurement) -> float:
    """Vanilla's seconds per generated token over the method's, measured minutes apart.

    Per token, not per generation: at temperature > 0 (or after a bf16 near-tie) the two outputs
    differ in length, and a method that happens to stop earlier must not look faster. At
    temperature 0 a lossless method emits vanilla's tokens, so this equals the wall-time ratio.
    """
    return vanilla.s_per_token / method.s_per_token


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA allocator stats; Linux VmHWM via clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    """Peak GPU memory allocated (CUDA) or the process's peak RSS since the last reset (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in open("/proc/self/status", encoding="ascii"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(ms: Sequence[Measurement], energy: EnergyReading | None,
              device: torch.device) -> dict[str, float]:
    """The numbers logged per trial; ``speedup`` is the paired geometric mean."""
    tokens = sum(m.new_tokens for m in ms)
    wall = sum(m.wall_s for m in ms)
    steps = sum(m.steps for m in ms)
    drafted, accepted = sum(m.drafted for m in ms), sum(m.accepted for m in ms)
    out = {"tokens_per_s": tokens / wall, "new_tokens": float(tokens), "wall_s": wall,
           "mean_accepted_tokens": 1.0 + accepted / steps, "block_efficiency": tokens / steps,
           "acceptance_rate": accepted / drafted if drafted else 0.0,
           "draft_time_s": sum(m.draft_time_s for m in ms),
           "verify_time_s": sum(m.verify_time_s for m in ms),
           "peak_memory_bytes": float(peak_memory_bytes(device)), "prompts": float(len(ms))}
    speedups = [m.speedup for m in ms if m.speedup is not None]
    if speedups:
        out["speedup"] = geometric_mean(speedups)
        out["speedup_min"], out["speedup_max"] = min(speedups), max(speedups)
        out["speedup_log_std"] = statistics.pstdev([math.log(s) for s in speedups])
    checks = [m.matches_vanilla for m in ms if m.matches_vanilla is not None]
    if checks:
        out["matches_vanilla"] = sum(checks) / len(checks)
        out["near_ties"] = float(sum(m.near_tie for m in ms))
    out["truncated_fraction"] = sum(m.truncated for m in ms) / len(ms)
    width = max((len(m.drafted_per_position) for m in ms), default=0)
    for i in range(width):     # zero-padded so the MLflow UI sorts them in order
        d = sum(m.drafted_per_position[i] for m in ms if i < len(m.drafted_per_position))
        a = sum(m.accepted_per_position[i] for m in ms if i < len(m.accepted_per_position))
        out[f"acceptance_pos_{i + 1:02d}"] = a / d if d else 0.0
    if energy is not None and energy.available and energy.joules is not None:
        out["energy_j"] = energy.joules
        out["energy_j_per_token"] = energy.joules / tokens
    out.update(per_category(ms))
    return out


def per_category(ms: Sequence[Measurement]) -> dict[str, float]:
    """tokens/s and paired speedup per prompt category (Spec-Bench, MT-bench), when categories exist."""
    groups: dict[str, list[Measurement]] = {}
    for m in ms:
        if m.category:
            groups.setdefault(m.category, []).append(m)
    out = {}
    for category, group in sorted(groups.items()):
        out[f"tokens_per_s_{category}"] = sum(m.new_tokens for m in group) / \
            sum(m.wall_s for m in group)
        speedups = [m.speedup for m in group if m.speedup is not None]
        if speedups:
            out[f"speedup_{category}"] = geometric_mean(speedups)
    return out


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
