"""Token trees from one draft model (``method=tree``): static shapes and EAGLE-2 dynamic trees.

The draft model grows a tree level by level (one draft forward per level, tree attention mask over
its own cache); the target verifies the whole tree in ONE forward (``decoding.loop``).

Shapes (``shape``):
  * a static shape: a list of paths of sibling ranks, EAGLE/Medusa "choices" style
    (``[[0], [1], [0, 0]]``: two children of the root, one grandchild under the first), or
    branching factors per depth (``(3, 2, 1)``: 3 root children, 2 under each, 1 under each of
    those), or a name from ``SHAPES``;
  * ``"dynamic"`` (EAGLE-2, Li et al. 2024): from the root, keep the ``width`` best frontier nodes by
    cumulative draft log-probability, give each its ``width`` best children, repeat for ``depth``
    levels; then rerank every generated node and keep the best ``total_tokens`` (parents before
    children: a child never scores above its parent, ties go to the earlier node). ``width`` is
    EAGLE-2's ``top_k``, renamed because ``top_k`` is the sampling setting of every method.

Siblings (``siblings``), with the matching verification rule (docs/verification.md §3.1):
  * ``topk``: the r-th child is the draft's r-th most likely token, deterministic, so each node is a
    point mass q = δ_x (EAGLE's rule). Always used at temperature 0 and by dynamic trees;
  * ``iid``: children drawn i.i.d. with replacement from the warped draft distribution q;
  * ``without``: children drawn without replacement from q (draw order = rank order).

Confidence stop (LLMCad; HF ``assistant_confidence_threshold``): a level is only expanded while the
best node to expand has a cumulative draft probability ≥ ``confidence_threshold`` (0 = off). The
tree stays a function of the draft's own draws, so verification stays exact.
"""

from __future__ import annotations

import math
from itertools import product
from typing import TYPE_CHECKING, Sequence, Union

import torch

from decoding.base import Draft, DraftContext, Drafter
from decoding.cached_model import CachedModel
from decoding.loop import DraftVerifyLoop
from decoding.runtime import check_positive_int
from decoding.sampling import SamplingConfig, logits_to_probs
from decoding.speculative import single_draft

if TYPE_CHECKING:
    from torch import nn

Shape = Union[str, Sequence[int], Sequence[Sequence[int]]]
SIBLINGS = ("topk", "iid", "without")

# Named static shapes (the tuner's categorical). Branching tuples or rank-path lists.
SHAPES: dict[str, tuple] = {
    "chain4": (1, 1, 1, 1),                    # a chain: γ = 4 as a tree
    "2-1-1": (2, 1, 1),                        # 6 tokens
    "2-2": (2, 2),                             # 6 tokens
    "3-1-1": (3, 1, 1),                        # 9 tokens
    "2-2-1-1": (2, 2, 1, 1),                   # 14 tokens
    "3-2-1": (3, 2, 1),                        # 15 tokens
    "4-2-1-1": (4, 2, 1, 1),                   # 28 tokens
    # 10 tokens, depth 4: the head of EAGLE's hand-made trees (more width near the root)
    "eagle10": ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
                (0, 0, 0, 0)),
}


def shape_paths(shape: Shape) -> list[tuple[int, ...]]:
    """Rank paths of a static shape, parents before children (validated)."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"shape={shape!r} is unknown: allowed are {sorted(SHAPES)} or "
                             "'dynamic'")
        shape = SHAPES[shape]
    shape = list(shape)
    if shape and all(isinstance(b, int) and not isinstance(b, bool) for b in shape):
        if any(b < 1 for b in shape):
            raise ValueError(f"shape={shape!r} is invalid: branching factors must be >= 1")
        paths = [p for d in range(1, len(shape) + 1)
                 for p in product(*(range(b) for b in shape[:d]))]
    else:
        paths = sorted({tuple(int(r) for r in p) for p in shape}, key=lambda p: (len(p), p))
    if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
        raise ValueError(f"shape={shape!r} is invalid: give non-empty paths of ranks >= 0")
    known = set(paths)
    for p in paths:
        if p[:-1] and p[:-1] not in known or p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in known:
            raise ValueError(f"shape path {list(p)} needs its parent and its elder siblings")
    return paths


class DraftModelSource:
    """A draft causal LM as the source of a tree's next-token logits (its own KV cache).

    The tree algorithm (``TreeDrafter``) asks a source for the logits after the committed context
    (``root``), then for the logits after batches of tree nodes (``extend``), and finally drops the
    tree's rows (``finish``). EAGLE heads are another source (``decoding.eagle.EagleSource``).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = CachedModel(model)

    def reset(self) -> None:
        self.model.reset()

    def commit(self, num_valid: int) -> None:
        self.model.rollback(num_valid)

    def root(self, context: DraftContext) -> torch.Tensor:
        """[V] logits after the last committed token (feeds the uncached committed tokens)."""
        return self.model.feed(context.ids)

    def extend(self, nodes: list[int], tokens: list[int], parents: list[int],
               depths: list[int]) -> torch.Tensor:
        """One forward over ``nodes`` (their ancestors already fed); [len(nodes), V] logits."""
        return self.model.extend_tree(nodes, tokens, parents, depths)

    def finish(self) -> None:
        self.model.discard_tree()                   # tree rows are dropped; the path is re-fed


class TreeDrafter(Drafter):
    """Grows a token tree (static shape or EAGLE-2 dynamic) from a source of next-token logits.

    The source is a draft model (``DraftModelSource``) or an EAGLE head (``decoding.eagle``,
    whose subclass ``EagleDrafter`` declares ``needs_hidden``).
    """

    def __init__(self, source: DraftModelSource, sampling: SamplingConfig, shape: Shape,
                 siblings: str, width: int, depth: int, total_tokens: int,
                 confidence_threshold: float) -> None:
        self.source, self.sampling = source, sampling
        self.dynamic = shape == "dynamic"
        self.paths = [] if self.dynamic else shape_paths(shape)
        self.siblings = "topk" if sampling.greedy or self.dynamic else siblings
        self.width, self.depth, self.total_tokens = width, depth, total_tokens
        self.threshold = confidence_threshold

    def reset(self) -> None:
        self.source.reset()

    def commit(self, num_valid: int) -> None:
        self.source.commit(num_valid)

    def propose(self, context: DraftContext) -> Draft:
        root = self.source.root(context)
        grow = self._dynamic if self.dynamic else self._static
        tokens, parents, probs, forwards = grow(root, context)
        self.source.finish()
        device = context.ids.device
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                     probs=None if probs is None else torch.stack(probs),
                     parents=torch.tensor(parents, dtype=torch.long, device=device),
                     forwards=forwards, without_replacement=self.siblings == "without")

    # -- shared pieces ---------------------------------------------------------------------

    def _children(self, logits: torch.Tensor, count: int, generator: torch.Generator | None
                  ) -> tuple[list[int], torch.Tensor | None, list[float]]:
        """``count`` sibling tokens after one node, their q (None: point masses), log-scores."""
        if self.siblings == "topk":
            picked, logq = top_children(logits[None], count)
            return picked[0], None, logq[0]
        q = logits_to_probs(logits, self.sampling)                                 # [V]
        if self.siblings == "without":
            count = min(count, int((q > 0).sum()))
        picked = torch.multinomial(q, count, replacement=self.siblings == "iid",
                                   generator=generator).tolist()
        return picked, q, torch.log(q[picked]).tolist()

    # -- static shapes ---------------------------------------------------------------------

    def _static(self, root: torch.Tensor, context: DraftContext):
        paths = [p for p in self.paths if len(p) <= context.budget]
        kids: dict[tuple, int] = {}
        for p in paths:
            kids[p[:-1]] = kids.get(p[:-1], 0) + 1
        tokens, parents, depths, score, probs = [], [], [], [], []
        node_of: dict[tuple, int] = {(): -1}
        logits_of = {(): root}
        forwards, max_depth = 1, max((len(p) for p in paths), default=0)
        for depth in range(1, max_depth + 1):
            level = [p for p in [()] + paths if len(p) == depth - 1 and p in kids
                     and p in logits_of]
            for parent_path in level:
                parent = node_of[parent_path]
                picked, q, logq = self._children(logits_of[parent_path], kids[parent_path],
                                                 context.generator)
                base = score[parent] if parent >= 0 else 0.0
                for rank, (token, lq) in enumerate(zip(picked, logq)):
                    node_of[parent_path + (rank,)] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                    depths.append(depth)
                    score.append(base + lq)
                    if q is not None:
                        probs.append(q)
            expand = [p for p in paths if len(p) == depth and p in kids and p in node_of]
            if not expand or depth == max_depth or not self._confident(
                    [score[node_of[p]] for p in expand]):
                break
            logits = self.source.extend([node_of[p] for p in expand], tokens, parents, depths)
            forwards += 1
            logits_of = {p: logits[i] for i, p in enumerate(expand)}
        return tokens, parents, (probs if self.siblings != "topk" else None), forwards

    def _confident(self, scores: list[float]) -> bool:
        return self.threshold <= 0 or max(scores) >= math.log(self.threshold)

    # -- EAGLE-2 dynamic trees -------------------------------------------------------------

    def _dynamic(self, root: torch.Tensor, context: DraftContext):
        depth_cap = min(self.depth, context.budget)
        picked, _, logq = self._children(root, self.width, None)
        tokens, parents, depths, score = picked, [-1] * len(picked), [1] * len(picked), logq
        frontier, forwards = list(range(len(picked))), 1
        for depth in range(2, depth_cap + 1):
            if not self._confident([score[n] for n in frontier]):
                break
            logits = self.source.extend(frontier, tokens, parents, depths)   # [k, V]
            forwards += 1
            created = []
            kid_tokens, kid_logq = top_children(logits, self.width)    # k × width, all at once
            for i, node in enumerate(frontier):
                for token, lq in zip(kid_tokens[i], kid_logq[i]):
                    created.append(len(tokens))
                    tokens.append(token)
                    parents.append(node)
                    depths.append(depth)
                    score.append(score[node] + lq)
            frontier = sorted(created, key=lambda n: (-score[n], n))[: self.width]
        keep = sorted(sorted(range(len(tokens)), key=lambda n: (-score[n], n))
                      [: self.total_tokens])
        index = {node: i for i, node in enumerate(keep)}
        return ([tokens[n] for n in keep], [index.get(parents[n], -1) for n in keep], None,
                forwards)


def top_children(logits: torch.Tensor, count: int) -> tuple[list[list[int]], list[list[float]]]:
    """The ``count`` most likely tokens after each of k nodes ([k, V] logits) and their log
    probabilities, best first: k rows in one log-softmax and one topk (two host syncs)."""
    logp = torch.log_softmax(logits.float(), dim=-1)                                  # [k, V]
    top = torch.topk(logp, min(count, logp.shape[-1]), dim=-1)
    return top.indices.tolist(), top.values.tolist()


def check_tree_settings(siblings: str, width: int, depth: int, total_tokens: int,
                        confidence_threshold: float) -> None:
    """Raise ValueError naming the first invalid tree setting (shapes: ``shape_paths``)."""
    for name, value in (("width", width), ("depth", depth), ("total_tokens", total_tokens)):
        check_positive_int(name, value)
    if siblings not in SIBLINGS:
        raise ValueError(f"siblings={siblings!r} is unknown: allowed are {list(SIBLINGS)}")
    if not 0.0 <= float(confidence_threshold) < 1.0:
        raise ValueError(f"confidence_threshold={confidence_threshold!r} is invalid: allowed "
                         "is a number in [0, 1)")


class TreeDecoding(DraftVerifyLoop):
    """Draft model + target, token-tree drafts verified in one target forward.

    Args:
        target, draft: causal LMs sharing a vocabulary.
        shape: a name in ``SHAPES``, branching factors per depth, rank paths, or "dynamic".
        siblings: "topk", "iid" or "without" (temperature > 0 static shapes only).
        width, depth, total_tokens: the EAGLE-2 dynamic tree (its top_k, levels, kept tokens;
            ``total_tokens`` excludes the root). Ignored by static shapes.
        confidence_threshold: stop growing below this cumulative draft probability (0 = off).
        temperature, top_k, top_p, seed, eos_token_ids: as for every method.
    """

    name = "tree"
    replayable = True             # drafts read only the committed prefix
    traceable = True              # target and draft-model forwards only
    keeps_history = False
    supports_compiled = True
    head_version = None
    draft_size_params = ("total_tokens",)        # a dynamic tree's size

    def __init__(self, target: nn.Module, draft: nn.Module, *, shape: Shape = "dynamic",
                 siblings: str = "topk", width: int = 4, depth: int = 4,
                 total_tokens: int = 8, confidence_threshold: float = 0.0,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, eos_token_ids: Sequence[int] | None = None) -> None:
        draft = single_draft(draft, self.name)
        check_tree_settings(siblings, width, depth, total_tokens, confidence_threshold)
        super().__init__(target, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed, eos_token_ids=eos_token_ids)
        self.drafter = TreeDrafter(DraftModelSource(draft), self.sampling, shape, siblings,
                                   width, depth, total_tokens, float(confidence_threshold))
