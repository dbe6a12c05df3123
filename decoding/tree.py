"""Token trees in one forward: attention masks, positions, KV-row selection, tree verification.

A forward over new tokens arranged as a forest hanging off the cached prefix (lookahead windows,
n-gram candidates, Ouroboros' lengthened drafts, token trees) is described by ``parents``: for node i,
the index of its parent node (< i), or -1 when it follows the cached prefix directly. Every node sees
the whole cached prefix, its ancestors and itself; its position is ``prefix_len + depth`` so RoPE
positions are those plain decoding would give. The mask is additive float (0 / dtype min): boolean
4D masks are silently misread by eager attention in transformers 5.x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache

from decoding.sampling import SamplingConfig, logits_to_probs


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
    mask = torch.zeros(q, prefix_len + q, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None], prefix_len + depth


def tree_forward(model: torch.nn.Module, tokens: Sequence[int], parents: Sequence[int],
                 cache: DynamicCache, rows: Sequence[int]) -> torch.Tensor:
    """One forward of a forest of new tokens; returns logits [len(rows), V] for the given nodes."""
    device = next(model.parameters()).device
    prefix = cache.get_seq_length()
    mask, positions = tree_inputs(parents, prefix, model.dtype, device)
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    slots = torch.arange(prefix, prefix + len(tokens), device=device)
    keep = torch.tensor(list(rows), dtype=torch.long, device=device)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions[None],
                 cache_position=slots, past_key_values=cache, use_cache=True,
                 logits_to_keep=keep).logits[0]


def keep_cache_rows(cache: DynamicCache, prefix: int, extra: Sequence[int]) -> None:
    """Keep cache positions [0, prefix) followed by the positions in ``extra`` (ascending)."""
    extra = list(extra)
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None:
            continue
        keys, values = layer.keys[..., :prefix, :], layer.values[..., :prefix, :]
        if extra:
            index = torch.tensor(extra, dtype=torch.long, device=layer.keys.device)
            keys = torch.cat([keys, layer.keys.index_select(-2, index)], dim=-2)
            values = torch.cat([values, layer.values.index_select(-2, index)], dim=-2)
        layer.keys, layer.values = keys, values


@dataclass(frozen=True)
class TreeVerdict:
    """Accepted root-to-node path (node indices) and the token emitted after it."""

    path: tuple[int, ...]
    next_token: int


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """Children per node in creation order; key -1 is the root (the last committed token)."""
    kids: dict[int, list[int]] = {-1: []}
    for node, parent in enumerate(parents):
        kids.setdefault(parent, []).append(node)
        kids.setdefault(node, [])
    return kids


def verify_tree(tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor,
                sampling: SamplingConfig, generator: torch.Generator | None) -> TreeVerdict:
    """Walk a tree of point-mass candidates (q = δ at every node), keeping the target's law.

    ``logits`` [n+1, V]: row 0 is the target after the root, row i+1 the target after node i.
    Greedy: descend while a child's token equals the argmax; emit the argmax where it stops.
    Sampling (EAGLE's rule for deterministic candidates, exact by enumeration in
    notes/verification.md §3.1): at a node, try its children in order; accept child t with
    probability p(t); on rejection set p(t) = 0 and renormalise; if no child is accepted emit a draw
    from the residual p; at a leaf emit a draw from the target row.
    """
    kids = children_of(parents)
    node, path = -1, []
    if sampling.greedy:
        choice = logits.argmax(dim=-1).tolist()                       # [n+1]
        while True:
            want = choice[node + 1]
            nxt = next((c for c in kids[node] if tokens[c] == want), None)
            if nxt is None:
                return TreeVerdict(tuple(path), want)
            path.append(nxt)
            node = nxt
    while True:
        probs = logits_to_probs(logits[node + 1], sampling).double()  # [V]
        accepted = None
        for child in kids[node]:
            token = tokens[child]
            mass = float(probs[token])
            if mass <= 0.0:
                continue
            if float(torch.rand((), generator=generator, dtype=torch.float64,
                                device=probs.device)) < mass / float(probs.sum()):
                accepted = child
                break
            probs[token] = 0.0
        if accepted is None:
            token = torch.multinomial(probs / probs.sum(), 1, generator=generator)
            return TreeVerdict(tuple(path), int(token))
        path.append(accepted)
        node = accepted
