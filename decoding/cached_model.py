"""A causal LM with its own KV cache: the "model with undo" every draft-side model is.

``CachedModel`` owns the model, its ``DynamicCache`` and ``length``, the positions of the committed
path the cache holds (their rows are valid as long as the path is committed). Scratch rows may sit
after them while a tree is grown (``extend_tree``); ``discard_tree`` drops them. ``rollback``
undoes rows the target did not accept; ``keep`` keeps a prefix plus selected rows (an accepted
tree path fed in one forward, ``forward_forest``).

Used by the chain, beam, multi-draft and tree drafters (``decoding.speculative``,
``decoding.mjsd``, ``decoding.specinfer``, ``decoding.token_tree``) and by lookahead's engine
(``decoding.lookahead``).
The EAGLE head (``decoding.eagle``) and the target inside ``decoding.loop`` keep their own caches:
see the comments there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from decoding.runtime import crop_cache, forward_logits, new_cache
from decoding.tree import ancestor_slots, extend_forward, keep_cache_rows, tree_forward

if TYPE_CHECKING:
    from torch import nn


class CachedModel:
    """A causal LM, its KV cache and the committed positions that cache holds.

    Args:
        model: the causal LM (Hugging Face ``PreTrainedModel``).
        capacity: cache rows to reserve per sequence (0: twice the first forward's rows, growing
            as needed; ``decoding.reserved_cache``).
    """

    def __init__(self, model: nn.Module, capacity: int = 0) -> None:
        self.model, self.capacity = model, capacity
        self.reset()

    def reset(self) -> None:
        """An empty cache (a new sequence)."""
        self.cache = new_cache(self.model, self.capacity)
        self.length = 0                     # positions of the committed path held in ``cache``
        self.slot: dict[int, int] = {}      # tree node -> cache slot of its scratch row

    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed the committed tokens of ``ids`` ([L]) not held yet; [V] logits after the last.

        The cache must hold no scratch rows (``discard_tree`` after every tree).
        """
        logits = forward_logits(self.model, ids[self.length:][None], self.cache, self.length, 1)
        self.length, self.slot = int(ids.shape[0]), {}
        return logits[-1]

    def append(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ([n]) at the next positions, as part of the path; [V] logits after."""
        logits = forward_logits(self.model, tokens[None], self.cache, self.length, 1)
        self.length += int(tokens.shape[0])
        return logits[-1]

    def extend_tree(self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
                    depths: Sequence[int]) -> torch.Tensor:
        """One forward over tree ``nodes`` as scratch rows (their ancestors fed earlier).

        Args:
            nodes: [q] node indices into ``tokens`` / ``parents`` / ``depths`` (the whole tree so
                far; parent -1 = the last committed token).
            tokens, parents, depths: per tree node (depth 1 = a child of the last committed token).

        Returns:
            [q, V] logits after each of ``nodes``.
        """
        start = self.cache.get_seq_length()
        ancestors = ancestor_slots(nodes, parents, self.slot, start)
        return extend_forward(self.model, self.cache, self.length, [tokens[n] for n in nodes],
                              ancestors, [depths[n] for n in nodes])

    def discard_tree(self) -> None:
        """Drop the scratch rows (the accepted path is fed again with the next context)."""
        crop_cache(self.cache, self.length)
        self.slot = {}

    def rollback(self, num_valid: int) -> None:
        """Only the first ``num_valid`` positions are committed: drop the rows after them."""
        if self.length > num_valid:
            crop_cache(self.cache, num_valid)
            self.length = num_valid

    def forward_forest(self, tokens: Sequence[int], parents: Sequence[int],
                       rows: Sequence[int]) -> torch.Tensor:
        """One forward of a forest of new tokens after the cache (``decoding.tree.tree_forward``).

        Returns [len(rows), V] logits of the given nodes; every fed row stays in the cache until
        ``keep`` or ``rollback``.
        """
        return tree_forward(self.model, tokens, parents, self.cache, rows)

    def keep(self, prefix: int, rows: Sequence[int]) -> None:
        """Keep cache positions [0, prefix) followed by ``rows`` (ascending) as the path."""
        keep_cache_rows(self.cache, prefix, rows)
        self.length = prefix + len(rows)
