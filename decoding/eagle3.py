"""EAGLE-3 (Li et al. 2025): an EAGLE-3 head's dynamic tree, its knobs named as SGLang names them.

    method = build_method("eagle3", pair, head="/path/to/EAGLE3-head", steps=4, topk=4,
                          num_draft_tokens=8)

The same loop, drafter and verification as ``method=eagle`` (``decoding.eagle``); only the head
format (``decoding.eagle3_head``: three fused target layers, its own draft vocabulary mapped by
``d2t``) and the names differ. SGLang's ``--speculative-num-steps`` / ``--speculative-eagle-topk`` /
``--speculative-num-draft-tokens`` are ``steps`` (tree depth = head forwards per step), ``topk``
(EAGLE-2's top_k: nodes expanded per level, children per node) and ``num_draft_tokens`` (tokens
one target forward verifies, the last committed token included, so ``num_draft_tokens − 1`` draft
tokens; EAGLE's ``total_token``). A dynamic tree grows ``topk + (steps − 1)·topk²`` candidates and
keeps the best ``num_draft_tokens − 1`` of them, so with ``topk=1`` it holds at most ``steps``
draft tokens, as SGLang's chain mode. Static shapes (``shape``) ignore the three knobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from decoding.eagle import EagleDecoding
from decoding.runtime import check_positive_int
from decoding.token_tree import Shape

if TYPE_CHECKING:
    from torch import nn


class Eagle3Decoding(EagleDecoding):
    """Target + EAGLE-3 head (``head``: a reference as for ``method=eagle``, which must name an
    EAGLE-3 head; "random[:seed]"/"auto" make EAGLE-3 heads).

    Args:
        steps, topk, num_draft_tokens: SGLang's names for the dynamic tree (see the module
            docstring); ``num_draft_tokens`` ≥ 2.
        shape, siblings, confidence_threshold, temperature, top_k, top_p, seed, eos_token_ids:
            as for ``method=eagle``.
    """

    name = "eagle3"
    replayable = False            # its head reads the target's hidden states
    traceable = False             # the head's forwards are priced by no profile yet
    keeps_history = False
    supports_compiled = True      # the shared loop; its head is refused (compiled_refusal)
    head_version = 3
    draft_size_params = ("num_draft_tokens",)

    def __init__(self, target: nn.Module, *, head: Any = "auto", shape: Shape = "dynamic",
                 siblings: str = "topk", steps: int = 4, topk: int = 4,
                 num_draft_tokens: int = 8, confidence_threshold: float = 0.0,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        check_positive_int("steps", steps)
        check_positive_int("topk", topk)
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) \
                or num_draft_tokens < 2:
            raise ValueError(f"num_draft_tokens={num_draft_tokens!r} is invalid: allowed is an "
                             "integer ≥ 2 (the verified tokens, the last committed one included)")
        super().__init__(target, head=head, shape=shape, siblings=siblings, width=topk,
                         depth=steps, total_tokens=num_draft_tokens - 1,
                         confidence_threshold=confidence_threshold, temperature=temperature,
                         top_k=top_k, top_p=top_p, seed=seed, eos_token_ids=eos_token_ids)
