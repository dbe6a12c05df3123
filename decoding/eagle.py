"""EAGLE (Li et al. 2024; EAGLE-2 dynamic trees): a feature-level draft head, one loop, tree verify.

    method = build_method("eagle", pair, head="yuhuili/EAGLE-Vicuna-7B-v1.3")   # or a local dir
    method = build_method("eagle", pair, head="smollm2-135m-instruct", width=4, depth=4)

The head (``decoding.eagle_head``; an EAGLE-3 head, ``decoding.eagle3_head``, reads three target
layers fused and drafts over its own vocabulary; ``method=eagle3`` names its knobs as SGLang does)
reads the target's features through the loop's drafter context
(``DraftContext.hidden``: the states of every row the target fed and kept in its last forward) and
grows a token tree with the same machinery as ``method=tree`` (``decoding.token_tree.TreeDrafter``):
a static shape (a chain is ``shape=(1, 1, 1, 1)`` or ``"chain4"``) or an EAGLE-2 dynamic tree
(``width`` = EAGLE's top_k, ``depth``, ``total_tokens``). The target verifies the tree in ONE forward
(``decoding.loop``): greedy walk at temperature 0, multi-round speculative sampling at every node
otherwise (top-k siblings are point masses, EAGLE's own rule; sampled siblings use the rule that
matches how they were drawn), so the method is lossless in both modes.

Head positions (``EagleSource``): head row i holds the input (f_i, t_{i+1}) and outputs f̂_{i+1}.
After a step with L committed tokens the target has fed positions 0..L−2, so the head's cache holds
exactly those L−1 rows of true features; the last row's output gives the tree's root distribution
(for t_L), and a tree node at depth d sits at position L−2+d with its parent's predicted feature
as input. The tree's rows are dropped after drafting (the accepted path's true features arrive with
the next context).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

import torch

from decoding.base import DraftContext
from decoding.eagle3_head import Eagle3Head
from decoding.eagle_head import EagleHead
from decoding.eagle_weights import check_fits, load_head, place, target_name
from decoding.eagle_weights import head_version as file_head_version
from decoding.loop import DraftVerifyLoop
from decoding.token_tree import Shape, TreeDrafter, check_tree_settings
from decoding.tree import additive_mask, ancestor_slots, extend_mask

if TYPE_CHECKING:
    from torch import nn


class EagleSource:
    """An EAGLE head as a tree's source of next-token logits (``TreeDrafter``'s source interface).

    Not a ``decoding.cached_model.CachedModel``: the head is fed (feature, token) pairs rather than
    token ids, the features of committed rows arrive from the target after the fact (``fed`` must
    match them exactly), and its cache is the head's own ``HeadCache``.
    """

    def __init__(self, head: Any) -> None:
        self.head = head
        self.reset()

    def reset(self) -> None:
        self.cache = self.head.new_cache()
        self.fed = 0                       # head rows of true features held in the cache
        self.features: dict[int, torch.Tensor] = {}
        self.slot: dict[int, int] = {}

    def commit(self, num_valid: int) -> None:
        if self.fed > num_valid:
            self.cache.crop(num_valid)
            self.fed = num_valid

    def root(self, context: DraftContext) -> torch.Tensor:
        """Feed the new true features; [V] logits for the token after the last committed one."""
        ids, hidden = context.ids, context.hidden                    # [L], [m, H]
        length, rows = int(ids.shape[0]), int(hidden.shape[0])
        start = length - 1 - rows
        if start != self.fed:
            raise RuntimeError(f"EAGLE head holds {self.fed} positions but got target states for "
                               f"positions {start}..{length - 2}")
        dtype = self._dtype()
        allowed = torch.ones(rows, start + rows, dtype=torch.bool, device=ids.device).tril(start)
        positions = torch.arange(start, length - 1, device=ids.device)
        features = self.head.features(hidden)          # [m, H] (EAGLE-3: fused from [m, 3·H_t])
        out = self.head(features[None], ids[start + 1:][None], positions,
                        additive_mask(allowed, dtype), self.cache)[0]               # [m, H]
        self.fed, self.features, self.slot = length - 1, {}, {}
        self.root_feature = out[-1]
        return self.head.logits(out[-1])

    def extend(self, nodes: list[int], tokens: list[int], parents: list[int],
               depths: list[int]) -> torch.Tensor:
        """One head forward over tree ``nodes`` (ancestors fed earlier); [len(nodes), V]."""
        start, device = self.cache.length, self.root_feature.device
        inputs = [self.root_feature if parents[n] < 0 else self.features[parents[n]]
                  for n in nodes]
        mask = extend_mask(start, self.fed, ancestor_slots(nodes, parents, self.slot, start),
                           self._dtype())
        positions = torch.tensor([self.fed - 1 + depths[n] for n in nodes], device=device)
        node_tokens = torch.tensor([[tokens[n] for n in nodes]], device=device)
        out = self.head(torch.stack(inputs)[None], node_tokens, positions, mask.to(device),
                        self.cache)[0]
        for i, node in enumerate(nodes):
            self.features[node] = out[i]
        return self.head.logits(out)                                                # [q, V]

    def finish(self) -> None:
        self.cache.crop(self.fed)

    def _dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype


class EagleDrafter(TreeDrafter):
    """A token tree grown by an EAGLE head (``EagleSource``), which reads the target's states
    (the last layer's for EAGLE-1/2, the head's ``layer_ids`` for EAGLE-3)."""

    needs_hidden = True


class EagleDecoding(DraftVerifyLoop):
    """Target + EAGLE head: feature-level token trees verified in one target forward.

    Args:
        target: the target causal LM (its embedding and LM head are shared with the head).
        head: a head reference (shipped name, "random[:seed]", "auto", local directory, hub id
            ``id[@revision]``; see ``decoding.eagle_weights``) or a loaded ``EagleHead`` /
            ``Eagle3Head``. EAGLE-1/2 and EAGLE-3 files both load (the format is detected).
        shape, siblings, width, depth, total_tokens, confidence_threshold: the tree, as for
            ``method=tree`` (``decoding.token_tree.TreeDecoding``); EAGLE-2's top_k is ``width``,
            its total_token − 1 is ``total_tokens``.
        temperature, top_k, top_p, seed, eos_token_ids: as for every method.
    """

    name = "eagle"
    replayable = False            # its head reads the target's hidden states
    traceable = False             # the head's forwards are priced by no profile yet
    keeps_history = False
    supports_compiled = True      # EAGLE-1/2 heads (an EAGLE-3 one: compiled_refusal)
    head_version: ClassVar[int | None] = None   # the head format "random"/"auto" make (None:
                                                # EAGLE-1/2; files of either format load)
    draft_size_params = ("total_tokens",)        # a dynamic tree's size

    @classmethod
    def compiled_refusal(cls, params: Mapping[str, Any]) -> str | None:
        """An EAGLE-3 head (``head_version`` 3, or a head file in that format) reads middle
        target layers the compiled decoder does not return (see ``use_compiled``)."""
        head = params.get("head")
        version = cls.head_version or (file_head_version(head) if isinstance(head, str) and head
                                       else None)
        if version != 3:
            return super().compiled_refusal(params)
        return ("{method} with an EAGLE-3 head cannot run with {compile}: the head reads target "
                "layers the compiled decoder does not return; allowed is {off}")

    def __init__(self, target: nn.Module, *, head: str | EagleHead = "auto",
                 shape: Shape = "dynamic", siblings: str = "topk", width: int = 4,
                 depth: int = 4, total_tokens: int = 8, confidence_threshold: float = 0.0,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        check_tree_settings(siblings, width, depth, total_tokens, confidence_threshold)
        super().__init__(target, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         eos_token_ids=eos_token_ids)
        if isinstance(head, str):
            head = load_head(head, target, self.head_version)
        elif isinstance(head, (EagleHead, Eagle3Head)):
            check_fits(head.config, None, target, "(loaded head)", target_name(target))
            head = place(head, target)                 # the target's device and dtype
        elif not all(hasattr(head, a) for a in ("new_cache", "logits", "features",
                                                "parameters")):
            raise ValueError(f"head={head!r} is invalid: allowed is a head reference (shipped "
                             "name, 'random', 'auto', local directory, hub id), an EagleHead or "
                             "an Eagle3Head")
        if self.head_version == 3 and isinstance(head, EagleHead):
            raise ValueError(f"method {self.name} runs EAGLE-3 heads; this head is "
                             f"{type(head).__name__}: run it with method=eagle")
        self.head = head
        self.drafter = EagleDrafter(EagleSource(head), self.sampling, shape, siblings, width,
                                    depth, total_tokens, float(confidence_threshold))
        self.drafter.hidden_layers = getattr(head, "layer_ids", None)
