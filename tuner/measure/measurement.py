"""One ``Measurement`` per prompt and their summary (the numbers logged per trial).

Speedups are paired: vanilla and the method run on the same prompt minutes apart
(``paired_speedup``). Each measurement's speculation counters are one
``decoding.acceptance.AcceptanceCounts`` (``counts``: every target forward a step, its prefill
one of them), which defines every figure read from them. Terms follow vLLM:
``mean_accepted_tokens`` = tokens per forward, 1 + accepted / target forwards with the prefill
counted (bonus included, vanilla = 1); ``decode_tokens_per_step`` = the same over the decode steps
alone (what bounds a decode-phase speedup: ``tuner.measure.bounds``); ``acceptance_rate`` =
accepted / drafted; ``block_efficiency`` = new tokens / target forwards (Ouroboros App. C).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

from decoding.acceptance import AcceptanceCounts, total
from tuner.measure.intervals import lower_bound, per_batch
from tuner.measure.energy import EnergyReading
from tuner.measure.timing import peak_memory_bytes


@dataclass(frozen=True)
class Measurement:
    """One method run on one prompt."""

    prompt_id: str
    category: str
    tokens: tuple[int, ...]             # [new_tokens]
    text: str
    wall_s: float                       # synchronised around the generation (decoding excluded)
    counts: AcceptanceCounts            # target forwards (the prefill one of them), drafts, ...
    draft_time_s: float
    verify_time_s: float
    speedup: float | None = None        # paired: vanilla's s/token over this run's s/token
    matches_vanilla: bool | None = None  # temperature 0 only
    near_tie: bool = False              # bf16/fp16 divergence explained by a near-tie
    engine_varies: bool = False         # an engine's own non-speculative output was not
    #                                     reproducible up to the divergence (batching numerics)
    truncated: bool = False             # stopped by max_new_tokens, not by EOS
    energy_j: float | None = None       # NVML energy of this generation (GPU only)
    mean_log_prob: float | None = None  # mean log p(token) under the unwarped target (lossy
    #                                     methods; tuner.measure.quality, after the timed window)
    other_load: float | None = None     # share of the allowed CPUs other processes used just
    #                                     before this pair was measured (tuner.measure.hygiene)
    contended: bool = False             # measured although the machine stayed busy (flagged)
    waited_s: float = 0.0               # waited for the machine to be quiet (contention=wait)
    concurrency: int = 1                # requests in flight together (engine servers)
    batch_wall_s: float | None = None   # first send to last answer of its batch (engines)
    prompt_s: float | None = None       # prefill: the server's own time to the first token
    #                                     (engines); in process, the first step's time
    decode_s: float | None = None       # the decode phase after it: the server's own (engines;
    #                                     TPOT from it); in process, wall_s - prompt_s
    decode_tokens: int | None = None    # the tokens emitted in decode_s: new_tokens minus the
    #                                     first step's (1 in an engine; in process 1 for vanilla
    #                                     and EAGLE, whose first step is the prefill alone, up to
    #                                     γ + 1 where it is fused with the first verification)
    decode_speedup: float | None = None  # paired, decode phase only (paired_decode_speedup)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def steps(self) -> int:
        """Target forwards, the prefill included."""
        return self.counts.steps

    @property
    def drafted(self) -> int:
        return self.counts.drafted

    @property
    def accepted(self) -> int:
        return self.counts.accepted

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s

    @property
    def s_per_token(self) -> float:
        return self.wall_s / max(self.new_tokens, 1)

    @property
    def decode_s_per_token(self) -> float | None:
        """Seconds per token of the decode phase (None: not timed, or no token after the first
        step). vLLM's serving benchmark calls it TPOT: (end-to-end - TTFT) / (tokens - 1)."""
        if self.decode_s is None or not self.decode_tokens or self.decode_s <= 0:
            return None
        return self.decode_s / self.decode_tokens


def paired_speedup(vanilla: Measurement, method: Measurement) -> float:
    """Vanilla's seconds per generated token over the method's, measured minutes apart.

    Per token, not per generation: at temperature > 0 (or after a bf16 near-tie) the two outputs
    differ in length, and a method that happens to stop earlier must not look faster. At
    temperature 0 a lossless method emits vanilla's tokens, so this equals the wall-time ratio.
    """
    return vanilla.s_per_token / method.s_per_token


def paired_decode_speedup(vanilla: Measurement, method: Measurement) -> float | None:
    """``paired_speedup`` of the decode phase only: the prefill (time to the first token) is
    left out, so long prompts do not pull the ratio towards 1 (speculation changes only the
    decode phase). None where either side has no decode-phase time."""
    ref, got = vanilla.decode_s_per_token, method.decode_s_per_token
    return None if ref is None or got is None else ref / got


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def unit_ratios(ms: Sequence[Measurement], name: str) -> list[float]:
    """The paired ratio ``name`` (``speedup``, ``decode_speedup``) per independent unit of
    ``ms`` (in the order measured): a request at concurrency 1, a batch's geometric mean at a
    higher level (``tuner.measure.intervals.per_batch``); what a lower bound is taken over."""
    out: list[float] = []
    for level in sorted({m.concurrency for m in ms}):
        out += per_batch([getattr(m, name) for m in ms if m.concurrency == level], level)
    return out


def summarize(ms: Sequence[Measurement], energy: EnergyReading | None,
              device: torch.device) -> dict[str, float]:
    """The numbers logged per trial; ``speedup`` is the paired geometric mean, ``*_lcb`` its
    one-sided 95 % lower confidence bound (``tuner.measure.intervals.lower_bound``) over the
    independent units (``unit_ratios``)."""
    tokens = sum(m.new_tokens for m in ms)
    wall = sum(m.wall_s for m in ms)
    counts = total([m.counts for m in ms])
    out = {"tokens_per_s": tokens / wall, "new_tokens": float(tokens), "wall_s": wall,
           "mean_accepted_tokens": counts.tokens_per_forward,
           "decode_tokens_per_step": counts.tokens_per_decode_step,
           "block_efficiency": tokens / counts.steps if counts.steps else 1.0,
           "acceptance_rate": counts.acceptance_rate,
           "draft_time_s": sum(m.draft_time_s for m in ms),
           "verify_time_s": sum(m.verify_time_s for m in ms),
           "peak_memory_bytes": float(peak_memory_bytes(device)), "prompts": float(len(ms))}
    speedups = [m.speedup for m in ms if m.speedup is not None]
    if speedups:
        out["speedup"] = geometric_mean(speedups)
        out["speedup_min"], out["speedup_max"] = min(speedups), max(speedups)
        out["speedup_log_std"] = statistics.pstdev([math.log(s) for s in speedups])
        out["speedup_lcb"] = lower_bound(unit_ratios(ms, "speedup"))
    decode = [m.decode_speedup for m in ms if m.decode_speedup is not None]
    if decode:
        out["decode_speedup"] = geometric_mean(decode)
        out["decode_speedup_min"], out["decode_speedup_max"] = min(decode), max(decode)
        out["decode_speedup_lcb"] = lower_bound(unit_ratios(ms, "decode_speedup"))
    firsts = [m.prompt_s for m in ms if m.prompt_s is not None]
    if firsts:
        out["ttft_ms"] = 1e3 * statistics.fmean(firsts)
    checks = [m.matches_vanilla for m in ms if m.matches_vanilla is not None]
    if checks:
        out["matches_vanilla"] = sum(checks) / len(checks)
        out["near_ties"] = float(sum(m.near_tie for m in ms))
        varies = sum(m.engine_varies for m in ms)
        if varies:
            out["engine_varies"] = float(varies)
    out["truncated_fraction"] = sum(m.truncated for m in ms) / len(ms)
    loads = [m.other_load for m in ms if m.other_load is not None]
    if loads:
        out["other_load_max"] = max(loads)
        out["contended_prompts"] = float(sum(m.contended for m in ms))
    for i, rate in enumerate(counts.position_rates()):   # zero-padded: the MLflow UI sorts
        out[f"acceptance_pos_{i + 1:02d}"] = rate
        out[f"drafted_pos_{i + 1:02d}"] = float(counts.position_drafted(i))   # what it rests on
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


