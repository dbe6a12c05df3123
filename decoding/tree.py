"""Token trees in one forward: the forest of new tokens, attention masks, positions, KV-row selection.

A forward over new tokens arranged as a forest hanging off the cached prefix (lookahead windows,
n-gram candidates, Ouroboros' lengthened drafts, token trees) is described by ``parents``: for node i,
the index of its parent node (< i), or -1 when it follows the cached prefix directly. Every node sees
the whole cached prefix, its ancestors and itself; its position is ``prefix_len + depth`` so RoPE
positions are those plain decoding would give. The mask is additive float (0 / dtype min): boolean
4D masks are silently misread by eager attention in transformers 5.x.

Drafts may hold several draws of the same token under one parent (i.i.d. siblings, several drafts
of SpecInfer). ``merge_duplicates`` maps such nodes onto one *slot* of the forward: the target
scores each distinct path once, and the verifier (``decoding.verify.tree_verify``) still counts
every draw. Verification rules live in ``decoding.verify``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from decoding.reserved_cache import ReservedLayer
from decoding.runtime import Hidden, cache_argument, hidden_rows


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[q, k] booleans (True = attend) -> [1, 1, q, k] additive float mask (0 / dtype min)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def ancestor_slots(nodes: Sequence[int], parents: Sequence[int], slot: dict[int, int],
                   start: int) -> list[list[int]]:
    """Cache slots of each new node's ancestors (tree nodes fed earlier); records the new nodes'
    own slots ``start + i`` in ``slot`` (node -> cache slot) as it goes, so a node may be the
    parent of a later node of the same batch."""
    ancestors = []
    for i, node in enumerate(nodes):
        chain, parent = [], parents[node]
        while parent >= 0:
            chain.append(slot[parent])
            parent = parents[parent]
        ancestors.append(chain)
        slot[node] = start + i
    return ancestors


def extend_mask(cached: int, prefix_len: int, ancestors: Sequence[Sequence[int]],
                dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, q, cached + q] for q tree nodes appended after ``cached`` cache rows:
    each sees the committed prefix [0, prefix_len), its ancestors' slots and itself."""
    q = len(ancestors)
    allowed = torch.zeros(q, cached + q, dtype=torch.bool)
    allowed[:, :prefix_len] = True
    for i, slots in enumerate(ancestors):
        allowed[i, list(slots) + [cached + i]] = True
    return additive_mask(allowed, dtype)


def tree_inputs(parents: Sequence[int], prefix_len: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask [1, 1, q, prefix_len + q] and position ids [q] for a forest of q nodes."""
    q = len(parents)
    parent = torch.tensor(list(parents), dtype=torch.long, device=device)          # [q]
    if q and bool((parent >= torch.arange(q, device=device)).any()):
        raise ValueError("tree nodes must come after their parents")
    visible = torch.eye(q, dtype=torch.bool, device=device)                       # [q, q]
    depth = torch.zeros(q, dtype=torch.long, device=device)
    rows = torch.arange(q, device=device)
    ancestor = parent.clone()
    while bool((ancestor >= 0).any()):
        live = ancestor >= 0
        visible[rows[live], ancestor[live]] = True
        depth += live.long()
        ancestor = torch.where(live, parent[ancestor.clamp(min=0)], ancestor)
    allowed = torch.cat([torch.ones(q, prefix_len, dtype=torch.bool, device=device), visible], 1)
    return additive_mask(allowed, dtype), prefix_len + depth


def tree_forward(model: torch.nn.Module, tokens: Sequence[int], parents: Sequence[int],
                 cache: DynamicCache, rows: Sequence[int]) -> torch.Tensor:
    """One forward of a forest of new tokens; returns logits [len(rows), V] for the given nodes."""
    return tree_forward_states(model, tokens, parents, cache, rows, False)[0]


def tree_forward_states(model: torch.nn.Module, tokens: Sequence[int], parents: Sequence[int],
                        cache: DynamicCache, rows: Sequence[int], hidden: Hidden
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``tree_forward`` plus, when ``hidden``, every node's states: the last layer's [q, H]
    (True) or the given layers' side by side [q, k·H] (``decoding.runtime.hidden_rows``)."""
    device = next(model.parameters()).device
    prefix = cache.get_seq_length()
    mask, positions = tree_inputs(parents, prefix, model.dtype, device)
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    slots = torch.arange(prefix, prefix + len(tokens), device=device)
    keep = torch.tensor(list(rows), dtype=torch.long, device=device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions[None],
                cache_position=slots, **cache_argument(model, cache), use_cache=True,
                logits_to_keep=keep, output_hidden_states=bool(hidden))
    states = hidden_rows(out.hidden_states, hidden) if hidden else None
    return out.logits[0], states


def extend_forward(model: torch.nn.Module, cache: DynamicCache, prefix_len: int,
                   tokens: Sequence[int], ancestors: Sequence[Sequence[int]],
                   depths: Sequence[int]) -> torch.Tensor:
    """Feed tree nodes after earlier tree nodes already in ``cache`` (a draft model growing a tree).

    Args:
        prefix_len: committed context positions at the front of the cache (seen by every node).
        tokens: [q] new node tokens, appended at cache slots cache_len..cache_len+q−1.
        ancestors: per new node, the cache slots of its ancestors (tree nodes fed earlier, or
            earlier new nodes as cache_len + j).
        depths: per new node, its depth (1 = child of the last committed token).

    Returns:
        [q, V] logits of the new nodes.
    """
    device = next(model.parameters()).device
    cached, q = cache.get_seq_length(), len(tokens)
    mask = extend_mask(cached, prefix_len, ancestors, model.dtype)
    positions = torch.tensor([prefix_len - 1 + d for d in depths], device=device)
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    return model(input_ids=ids, attention_mask=mask.to(device),
                 position_ids=positions[None], **cache_argument(model, cache), use_cache=True,
                 cache_position=torch.arange(cached, cached + q, device=device)).logits[0]


def keep_cache_rows(cache: DynamicCache, prefix: int, extra: Sequence[int]) -> None:
    """Keep cache positions [0, prefix) followed by the positions in ``extra`` (ascending)."""
    extra = list(extra)
    index = None                          # [len(extra)] on the cache's device, made once
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None:
            continue
        if extra and index is None:
            index = torch.tensor(extra, dtype=torch.long, device=layer.keys.device)
        if isinstance(layer, ReservedLayer):
            layer.keep(prefix, extra, index)
            continue
        keys, values = layer.keys[..., :prefix, :], layer.values[..., :prefix, :]
        if extra:
            keys = torch.cat([keys, layer.keys.index_select(-2, index)], dim=-2)
            values = torch.cat([values, layer.values.index_select(-2, index)], dim=-2)
        layer.keys, layer.values = keys, values


def merge_duplicates(tokens: Sequence[int], parents: Sequence[int]
                     ) -> tuple[list[int], list[int], list[int]]:
    """Merge draws of the same token under the same (merged) parent into one forward slot.

    Returns:
        slot_of [n] (the slot of every node), slot_tokens [S], slot_parents [S] (-1 = root);
        slots keep creation order, so parents still come before children.
    """
    index: dict[tuple[int, int], int] = {}
    slot_of, slot_tokens, slot_parents = [], [], []
    for token, parent in zip(tokens, parents):
        key = (-1 if parent < 0 else slot_of[parent], int(token))
        if key not in index:
            index[key] = len(slot_tokens)
            slot_tokens.append(key[1])
            slot_parents.append(key[0])
        slot_of.append(index[key])
    return slot_of, slot_tokens, slot_parents


def trials_by_slot(parents: Sequence[int], slot_of: Sequence[int]) -> dict[int, list[int]]:
    """Draft nodes whose parent sits in each slot (key -1: the root), in creation (draw) order."""
    trials: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        trials.setdefault(-1 if parent < 0 else slot_of[parent], []).append(node)
    return trials


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (1 = child of the root); parents come before children."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return depth


@dataclass
class Forest:
    """New tokens of one forward, as a forest over the cached prefix."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        return len(self.tokens) - 1

    def chain(self, tokens: Sequence[int], parent: int) -> list[int]:
        nodes = []
        for token in tokens:
            parent = self.add(token, parent)
            nodes.append(parent)
        return nodes

    def trie(self, phrases: Sequence[Sequence[int]], parent: int) -> tuple[list[int], list[list[int]]]:
        """Merge phrases sharing prefixes under ``parent``; returns (new nodes, nodes per phrase)."""
        index: dict[tuple[int, int], int] = {}
        created, paths = [], []
        for phrase in phrases:
            node, path = parent, []
            for token in phrase:
                if (node, token) not in index:
                    index[(node, token)] = self.add(token, node)
                    created.append(index[(node, token)])
                node = index[(node, token)]
                path.append(node)
            paths.append(path)
        return created, paths
