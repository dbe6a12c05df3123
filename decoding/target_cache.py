"""The target's KV cache for one generation, behind the three operations the loops need.

``DraftVerifyLoop`` and ``Vanilla`` score tokens with the target and then keep part of what they
fed. ``TargetCache`` is that contract; two implementations exist:

  * ``EagerTargetCache`` (the default): a ``DynamicCache`` whose layers write every forward's rows
    in place into storage reserved for the generation (``decoding.reserved_cache``), the model
    called eagerly at whatever shape the step has, rejected rows cropped away;
  * ``decoding.compiled.CompiledTarget``: a preallocated static cache and the target's decoder
    compiled once per shape bucket (opt-in, ``compiled=`` on a method).

Both return the same rows, so a loop never knows which one it drives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from decoding.runtime import Hidden, crop_cache, forward_states, new_cache
from decoding.tree import keep_cache_rows, tree_forward_states

if TYPE_CHECKING:
    from torch import nn

__all__ = ["EagerTargetCache", "Hidden", "TargetCache"]


class TargetCache(Protocol):
    """The target with its cache for one generation."""

    def chain(self, input_ids: torch.Tensor, start: int, num_logits: int, hidden: Hidden
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One causal forward of ``input_ids`` ([n]) at positions start..start+n−1.

        Returns (logits [num_logits, V] of the last rows, states or None): ``hidden`` False for
        none, True for the last layer's [n, H], layer ids for those states side by side
        [n, k·H] (``decoding.runtime.hidden_rows``).
        """

    def tree(self, tokens: Sequence[int], parents: Sequence[int], rows: Sequence[int],
             hidden: Hidden) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of a forest after the cached prefix (``decoding.tree.tree_inputs``).

        Returns (logits [len(rows), V] of the given nodes, states [q, ·] or None as ``chain``).
        """

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions."""

    def keep(self, prefix: int, rows: Sequence[int]) -> None:
        """Keep positions [0, prefix) followed by the cache positions ``rows`` (ascending)."""


class EagerTargetCache:
    """``TargetCache`` over a ``DynamicCache``: the model at every step's own shape."""

    def __init__(self, model: nn.Module, capacity: int = 0) -> None:
        self.model = model
        self.cache = new_cache(model, capacity)

    def chain(self, input_ids: torch.Tensor, start: int, num_logits: int, hidden: Hidden
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return forward_states(self.model, input_ids[None], self.cache, start, num_logits, hidden)

    def tree(self, tokens: Sequence[int], parents: Sequence[int], rows: Sequence[int],
             hidden: Hidden) -> tuple[torch.Tensor, torch.Tensor | None]:
        return tree_forward_states(self.model, tokens, parents, self.cache, rows, hidden)

    def crop(self, length: int) -> None:
        crop_cache(self.cache, length)

    def keep(self, prefix: int, rows: Sequence[int]) -> None:
        keep_cache_rows(self.cache, prefix, rows)
