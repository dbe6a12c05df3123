"""The n-gram / phrase pool shared by lookahead decoding and Ouroboros.

``pool[key]`` holds phrases (tuples of the tokens that followed ``key``), oldest first, at most
``capacity`` per key (lookahead's G). Inserting an existing phrase refreshes it (moves it to the
end); inserting into a full key evicts the oldest. That is the reference implementations' policy,
with O(1) operations (an ordered dict per key instead of list scans). Lookups do not refresh.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class PhrasePool:
    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"pool capacity (G)={capacity!r} is invalid: allowed is an integer "
                             ">= 1")
        self.capacity = capacity
        self._pool: OrderedDict[int, OrderedDict[tuple[int, ...], None]] = OrderedDict()
        self.lookups = 0
        self.hits = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._pool.values())

    def reset(self) -> None:
        self._pool.clear()
        self.lookups = self.hits = 0

    def insert(self, key: int, phrase: Sequence[int]) -> None:
        phrase = tuple(int(t) for t in phrase)
        if not phrase:
            return
        entries = self._pool.get(key)
        if entries is None:
            entries = self._pool[key] = OrderedDict()
        if phrase in entries:
            entries.move_to_end(phrase)
            return
        entries[phrase] = None
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def insert_all(self, items: Iterable[tuple[int, Sequence[int]]]) -> None:
        for key, phrase in items:
            self.insert(key, phrase)

    def replace(self, key: int, old: Sequence[int], new: Sequence[int]) -> None:
        """Swap ``old`` for ``new`` by identity (not by position), keeping the pool consistent."""
        entries = self._pool.get(key)
        if entries is not None:
            entries.pop(tuple(old), None)
        self.insert(key, new)

    def get(self, key: int, limit: int | None = None, newest: bool = False
            ) -> list[tuple[int, ...]]:
        """Phrases for ``key``, oldest first (or the newest ``limit`` when ``newest``)."""
        self.lookups += 1
        entries = list(self._pool.get(key, ()))
        if entries:
            self.hits += 1
        if limit is not None:
            entries = entries[-limit:] if newest else entries[:limit]
        return entries

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0
