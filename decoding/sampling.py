"""Sampling settings and logits warping, in one place.

Every method (and both models of a pair) turns logits into the *warped* distribution the same way:
temperature, then top-k, then top-p, renormalised. Verification rules rely on this (requirement R1 of
``docs/verification.md``): losslessness holds relative to the warped target distribution.

Temperature 0 means greedy decoding: the distribution is the point mass on the argmax, lowest index
on ties (``torch.argmax`` returns the first maximal index), the same tie-break everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a next-token distribution.

    Attributes:
        temperature: 0 for greedy decoding, > 0 to sample.
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 keeps all.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} is invalid: allowed is a finite "
                             "number >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} is invalid: allowed is an integer >= 0 "
                             "(0 = no top-k filtering)")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r} is invalid: allowed is a number in (0, 1] "
                             "(1 = no nucleus filtering)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k and top-p applied to logits; filtered entries become -inf.

    The rules of transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
    ``TopPLogitsWarper`` (in that order), with ties kept together: top-k keeps every token tied
    with the k-th; top-p keeps a token when the tokens *strictly* more likely hold less than
    ``top_p`` of the mass, so tokens of equal logit are kept or dropped together, whatever order
    a sort puts them in (transformers keeps one of them by position there).

    Args:
        logits: [..., V] raw logits (any float dtype; computed in float32).
        cfg: sampling settings with temperature > 0.

    Returns:
        [..., V] float32 warped logits.
    """
    out = logits.float() / cfg.temperature
    vocab = out.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(out, cfg.top_k, dim=-1).values[..., -1:]       # [..., 1]
        out = out.masked_fill(out < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)     # [..., V]
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs     # mass ahead in order
        ascending = (-sorted_logits).contiguous()
        first_tied = torch.searchsorted(ascending, ascending, side="left")  # [..., V] group start
        strictly_better = mass_before.gather(-1, first_tied)               # ties: the same mass
        drop_sorted = strictly_better >= cfg.top_p                          # the best never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The warped next-token distribution.

    Args:
        logits: [..., V] raw logits.
        cfg: sampling settings; temperature 0 gives the one-hot argmax.

    Returns:
        [..., V] float32 probabilities, each row summing to 1.
    """
    if cfg.greedy:
        top = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
            -1, top, 1.0)
    return torch.softmax(warp_logits(logits, cfg), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``probs`` ([..., V]); returns [...] int64 token ids (no device sync)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``probs`` ([m, V]) by inverting each row's CDF with one uniform.

    The same law as ``torch.multinomial(probs, 1)``, whose CPU path draws one exponential per
    vocabulary entry (m·V random numbers, 11 ms per SpecInfer step on SmolLM2's 49 152 tokens);
    this draws m. Returns [m] int64 (no device sync).
    """
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device,
                   dtype=probs.dtype)                                              # [m, 1]
    return invert_cdf(probs, u)


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval holds ``u`` · (row total): probs [m, V], u [m, 1] in [0, 1)
    -> [m]. A zero-probability token owns an empty interval, so it is never chosen (``right=True``
    skips the plateau at u = 0; a product rounded up to the total falls back to the row's last
    token of positive probability)."""
    cdf = probs.cumsum(-1)                                                          # [m, V]
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)         # [m]
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)             # [m]
    return torch.minimum(index, last)


def next_token(logits: torch.Tensor, cfg: SamplingConfig,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose the next token from one row of logits.

    Args:
        logits: [V] raw logits.

    Returns:
        (token [] int64, probs [V] or None). ``probs`` is the exact distribution the token was drawn
        from; None under greedy decoding (a point mass, requirement R2).
    """
    if cfg.greedy:
        return logits.argmax(dim=-1), None
    probs = logits_to_probs(logits, cfg)
    return sample(probs, generator), probs
