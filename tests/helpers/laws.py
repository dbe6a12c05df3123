"""Exact two-token laws of a target and the chi-square test of sampled pairs against them.

Shared by the end-to-end sampling tests of every method (tests/test_methods.py and the per-method
files): the first two generated tokens of a lossless method are distributed as the target says.
Each such test also runs a mutant of the real rule (``tests.helpers.mutations``) at the same
draws and must reject it; ``ChiSquare.power`` estimates the power that achieves (the table in
docs/verification.md §0.4, made by ``python -m tests.helpers.law_power``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
from scipy.stats import chi2, chisquare, ncx2

from decoding.sampling import SamplingConfig


def reference_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The warped next-token distribution by transformers' own logits processors
    (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, the order
    ``generate`` applies them in), not by the code under test; ties at the top-p boundary kept
    together (transformers keeps one of equal logits by sort position there; the project's rule
    keeps all: see ``decoding.sampling.warp_logits``). ``logits``: [..., V] -> [..., V]."""
    from transformers import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)
    vocab = logits.shape[-1]
    rows = logits.float().reshape(-1, vocab)                                  # [B, V]
    if sampling.greedy:
        return torch.nn.functional.one_hot(rows.argmax(-1), vocab).float().reshape(logits.shape)
    processors = LogitsProcessorList([TemperatureLogitsWarper(float(sampling.temperature))])
    if 0 < sampling.top_k < vocab:
        processors.append(TopKLogitsWarper(int(sampling.top_k)))
    if sampling.top_p < 1.0:
        processors.append(TopPLogitsWarper(float(sampling.top_p)))
    warped = processors(torch.zeros((rows.shape[0], 1), dtype=torch.long), rows.clone())
    scaled = rows / float(sampling.temperature)
    kept = warped > float("-inf")
    for row in range(rows.shape[0]):                       # close the kept set under ties
        kept[row] |= torch.isin(scaled[row], scaled[row][kept[row]])
    probs = scaled.masked_fill(~kept, float("-inf")).softmax(-1)
    return probs.reshape(logits.shape)


def two_token_law(model: torch.nn.Module, prompt: list[int],
                  sampling: SamplingConfig) -> dict[tuple[int, int], float]:
    """P(a, b) = p(a | prompt) · p(b | prompt, a) after the sampling warps (``reference_probs``:
    transformers' processors), by enumeration."""
    with torch.inference_mode():
        first = reference_probs(model(torch.tensor([prompt])).logits[0, -1], sampling)   # [V]
        law = {}
        for a in range(first.shape[0]):
            if first[a] == 0:
                continue
            second = reference_probs(model(torch.tensor([prompt + [a]])).logits[0, -1], sampling)
            for b in range(first.shape[0]):
                law[(a, b)] = float(first[a] * second[b])
    return law


ALPHA = 1e-3      # every law test: the right rule must give p > ALPHA, its mutant p < ALPHA


@dataclass(frozen=True)
class ChiSquare:
    """Pearson's chi-square of ``draws`` sampled outcomes against an exact law (rare bins pooled)."""

    statistic: float
    dof: int
    pvalue: float
    draws: int

    def power(self, draws: int | None = None, alpha: float = ALPHA) -> float:
        """The estimated power, at ``draws`` (default: these), to reject the exact law when the
        outcomes follow the law these counts came from (a mutant's): the noncentral chi-square
        with λ = (X² − dof) · draws / self.draws (E[X²] = dof + λ; λ ∝ draws at a fixed
        alternative). A plug-in estimate from one run, not a bound: λ's own standard error is
        about √(2·dof + 4λ) (≈ 30 at λ = 220, dof 23). Meaningless for counts from the right
        rule (its λ is noise; its false-failure rate is alpha by construction). An outcome
        outside the law's support (statistic ∞) is rejected at any draws: power 1."""
        if not np.isfinite(self.statistic):
            return 1.0
        if self.dof < 1:
            raise ValueError("a chi-square with no degree of freedom has no power")
        scale = (draws or self.draws) / self.draws
        noncentrality = max(self.statistic - self.dof, 0.0) * scale
        return float(ncx2.sf(chi2.isf(alpha, self.dof), self.dof, max(noncentrality, 1e-12)))

    def draws_for(self, power: float = 0.99, alpha: float = ALPHA) -> int | None:
        """The fewest draws at which ``power`` (estimated as above) is reached; None where that
        is not estimable (an outcome outside the support: any draws reject)."""
        if not np.isfinite(self.statistic):
            return None
        if self.power(10 * self.draws, alpha) < power:
            return 10 * self.draws + 1                # out of reach: say so, do not search on
        low, high = 1, 10 * self.draws
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if self.power(middle, alpha) < power else (low, middle)
        return low


def chi_square(observed, expected) -> ChiSquare:
    """Pearson's chi-square of observed counts against expected counts (both [cells], expected
    rescaled to the observed total; the caller pools rare cells)."""
    observed = np.asarray(observed, dtype=float)
    expected = np.asarray(expected, dtype=float)
    result = chisquare(observed, expected * observed.sum() / expected.sum())
    return ChiSquare(float(result.statistic), len(observed) - 1, float(result.pvalue),
                     int(observed.sum()))


def pair_chi_square(counts: Mapping[tuple, int], law: Mapping[tuple, float]) -> ChiSquare:
    """Chi-square of observed pair counts against ``law``; bins expecting < 5 draws are pooled.
    A pair outside the law's support fails outright (statistic ∞, p = 0)."""
    if any(law.get(key, 0.0) == 0.0 for key in counts):
        return ChiSquare(float("inf"), max(len(law) - 1, 1), 0.0, sum(counts.values()))
    return pooled_chi_square(counts, law)


def pooled_chi_square(counts: Mapping[tuple, int], law: Mapping[tuple, float]) -> ChiSquare:
    """Chi-square of the counts of ``law``'s outcomes against it (outcomes outside the law are
    not counted), the bins expecting < 5 draws pooled into one."""
    draws = sum(counts.values())
    keys = sorted(law)
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    expected = np.array([law[k] for k in keys]) * draws
    big = expected >= 5
    observed = np.append(observed[big], observed[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return chi_square(observed, expected)


def pair_counts(method, prompt: list[int], draws: int, new_tokens: int = 3,
                check: Callable | None = None) -> dict[tuple[int, int], int]:
    """The first two generated tokens of ``draws`` generations, seeds 0..draws−1 (a fresh
    generator per generation; ``reset`` first where the method keeps state across prompts).
    ``check(output)`` is called on every generation."""
    from decoding import generate
    counts: dict[tuple, int] = {}
    for seed in range(draws):
        method.seed = seed
        if hasattr(method, "reset"):
            method.reset()
        out = generate(method, prompt, new_tokens)
        if check is not None:
            check(out)
        key = out.tokens[:2]
        counts[key] = counts.get(key, 0) + 1
    return counts
