"""Exact two-token laws of a target and the chi-square test of sampled pairs against them.

Shared by the end-to-end sampling tests of every method (tests/test_methods.py and the per-method
files): the first two generated tokens of a lossless method are distributed as the target says.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from scipy.stats import chisquare

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


def pair_pvalue(counts: Mapping[tuple, int], law: Mapping[tuple, float]) -> float:
    """Chi-square p-value of observed pair counts against ``law``; bins expecting < 5 draws are
    pooled. A pair outside the law's support fails outright (p = 0)."""
    draws = sum(counts.values())
    if any(law.get(key, 0.0) == 0.0 for key in counts):
        return 0.0
    keys = sorted(law)
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    expected = np.array([law[k] for k in keys]) * draws
    big = expected >= 5
    observed = np.append(observed[big], observed[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)
