"""A KV cache whose rows are written in place into storage reserved ahead of time.

transformers' ``DynamicLayer`` appends every forward's keys and values with ``torch.cat``, so each
step copies the whole cache of every layer (2 × layers copies of a growing tensor per forward),
and a rollback (``crop``) leaves a view that the next ``cat`` copies again. ``ReservedLayer`` is a
``DynamicLayer`` that reserves storage for the generation and writes the new rows into it: a step
copies only its own rows, a rollback only moves the length back, and the model attends over a
view of the first ``length`` rows: the same values a ``DynamicLayer`` would hold, in a strided
view instead of a contiguous tensor. ``tests/test_reserved_cache.py`` checks the values against a
``DynamicLayer``; the time saved is measured in ``docs/performance.md``.

Storage grows (doubling, one copy of the valid rows) if a generation needs more than was reserved,
so the reservation is a hint, never a limit. The storage is allocated in the grad mode of the first
update (under ``torch.inference_mode()`` in every loop), so a cache is updated in that mode only;
each generation makes a fresh one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, DynamicLayer

if TYPE_CHECKING:
    from torch import nn

__all__ = ["RESERVE_SLACK", "ReservedLayer", "reserved_cache"]

MIN_RESERVATION = 128      # rows reserved at least when the caller gives no hint
# Rows reserved past a generation's length for the drafts its last verification may feed beyond
# max_new_tokens; a larger tree or window grows the storage instead.
RESERVE_SLACK = 64


class ReservedLayer(DynamicLayer):
    """One layer's keys and values as views of the first ``length`` rows of reserved storage.

    Args:
        capacity: rows to reserve at the first update (at least the rows that update brings;
            0 = twice those rows, at least ``MIN_RESERVATION``).
    """

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity = int(capacity)
        self.length = 0
        self.key_storage: torch.Tensor | None = None      # [B, H_kv, capacity, D]
        self.value_storage: torch.Tensor | None = None    # [B, H_kv, capacity, D]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows = key_states.shape[-2]
        capacity = max(self.capacity, rows) if self.capacity else max(2 * rows, MIN_RESERVATION)
        self.device = key_states.device
        self.key_storage = key_states.new_empty(key_states.shape[:-2] + (capacity,)
                                                + key_states.shape[-1:])
        self.value_storage = value_states.new_empty(value_states.shape[:-2] + (capacity,)
                                                    + value_states.shape[-1:])
        self.is_initialized = True
        self._expose()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new rows after the valid ones; return the valid rows ([B, H_kv, length, D])."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.key_storage.shape[-2]:
            self._grow(max(end, 2 * self.key_storage.shape[-2]))
        self.key_storage[..., self.length:end, :].copy_(key_states)
        self.value_storage[..., self.length:end, :].copy_(value_states)
        self.length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` rows (``DynamicLayer``'s convention: negative)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}) is not supported: give a negative count "
                             "of rows to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)
        self._expose()

    def keep(self, prefix: int, rows: Sequence[int], index: torch.Tensor | None = None) -> None:
        """Keep rows [0, prefix) followed by ``rows`` (ascending, in [prefix, length)), in place.

        ``index``: ``rows`` as a long tensor on the cache's device, if the caller has it already.
        """
        if not self.is_initialized:
            return
        if prefix > self.length or (rows and (rows[0] < prefix or rows[-1] >= self.length)):
            raise ValueError(f"keep(prefix={prefix}, rows={list(rows)}) is invalid: allowed is a "
                             f"prefix <= {self.length} and rows in [prefix, {self.length})")
        if rows and (rows[0] != prefix or rows[-1] != prefix + len(rows) - 1):  # else in place
            if index is None:
                index = torch.tensor(list(rows), dtype=torch.long, device=self.key_storage.device)
            kept_keys = self.key_storage.index_select(-2, index)   # [B, H_kv, k, D], a copy
            kept_values = self.value_storage.index_select(-2, index)
            self.key_storage[..., prefix:prefix + len(rows), :].copy_(kept_keys)
            self.value_storage[..., prefix:prefix + len(rows), :].copy_(kept_values)
        self.length = prefix + len(rows)
        self._expose()

    def reset(self) -> None:
        self.key_storage = self.value_storage = None
        self.length = 0
        super().reset()

    def _grow(self, capacity: int) -> None:
        self.key_storage = self._moved(self.key_storage, capacity)
        self.value_storage = self._moved(self.value_storage, capacity)

    def _moved(self, storage: torch.Tensor, capacity: int) -> torch.Tensor:
        """New storage of ``capacity`` rows holding the valid rows of ``storage``."""
        new = storage.new_empty(storage.shape[:-2] + (capacity,) + storage.shape[-1:])
        new[..., :self.length, :].copy_(storage[..., :self.length, :])
        return new

    def _expose(self) -> None:
        self.keys = self.key_storage[..., :self.length, :]
        self.values = self.value_storage[..., :self.length, :]

    def _unsupported(self, *args, **kwargs) -> None:
        raise NotImplementedError("a ReservedLayer holds one sequence for a decoding loop: beam "
                                  "reordering, batch edits and offloading are not supported "
                                  "(use transformers' DynamicCache)")

    # Inherited, these would replace ``keys``/``values`` without the storage behind them.
    reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported
    offload = prefetch = _unsupported


def reserved_cache(model: nn.Module, capacity: int = 0) -> DynamicCache:
    """``DynamicCache(config=model.config)`` with every full-attention layer a ``ReservedLayer``.

    Other layer kinds (sliding-window, linear attention) are kept as transformers builds them.
    """
    cache = DynamicCache(config=model.config)
    cache.layers = [ReservedLayer(capacity) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache
