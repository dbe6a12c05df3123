"""Toy next-token models for exact enumeration of verification laws (tests/test_verify.py,
tests/test_trees.py, tests/test_mjsd.py).

The next-token distribution is a Dirichlet row seeded by a hash of the prefix (some with exact
zeros), so laws over short sequences can be enumerated exactly.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np
import torch


class ToyModel:
    """p(· | prefix): Dirichlet row seeded by (seed, prefix); ``sparse`` zeroes some entries."""

    def __init__(self, vocab: int, seed: int, sparse: bool = False, constant=None) -> None:
        self.vocab, self.seed, self.sparse, self.constant = vocab, seed, sparse, constant

    @lru_cache(maxsize=None)
    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if self.constant is not None:
            return torch.tensor(self.constant, dtype=torch.float64)
        rng = np.random.default_rng(zlib.crc32(repr((self.seed, prefix)).encode()))
        row = rng.dirichlet(np.full(self.vocab, 0.7))
        if self.sparse:
            keep = rng.random(self.vocab) < 0.6
            keep[rng.integers(self.vocab)] = True
            row = np.where(keep, row, 0.0)
        return torch.tensor(row / row.sum(), dtype=torch.float64)


def target_joint(target: ToyModel, context: tuple, length: int) -> dict[tuple, float]:
    law = {(): 1.0}
    for _ in range(length):
        law = {seq + (v,): p * float(target(context + seq)[v])
               for seq, p in law.items() for v in range(target.vocab)}
    return law


def complete(block_law: dict[tuple, float], target: ToyModel, context: tuple,
             length: int) -> dict[tuple, float]:
    """Extend each emitted block with target sampling (or truncate it) to ``length`` tokens."""
    out: dict[tuple, float] = {}
    for block, prob in block_law.items():
        partial = {block[:length]: prob}
        while len(next(iter(partial))) < length:
            partial = {seq + (v,): p * float(target(context + seq)[v])
                       for seq, p in partial.items() for v in range(target.vocab)}
        for seq, p in partial.items():
            out[seq] = out.get(seq, 0.0) + p
    return out
