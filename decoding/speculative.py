"""Draft-model speculative decoding with token verification or block verification.

Runs the shared loop (``decoding.loop``) with a chain drafter. One step (Leviathan et al. 2023;
Chen et al. 2023; Sun et al. 2024):
  1. the draft model proposes γ tokens autoregressively (γ draft forwards);
  2. the target scores the uncached committed tokens + the γ drafts in ONE forward ([γ+1] rows);
  3. a pure verify function (``decoding.verify``) accepts a prefix and emits one more token;
  4. both KV caches are cropped to the committed prefix (never re-encoded).

Cache invariant: the target cache holds every committed token except the last (which is fed again
with the next draft); the draft cache holds at most the committed prefix plus its own draft.
γ is capped at ``max_new_tokens − produced − 1`` so a step never overshoots the budget; EOS inside a
draft is handled by verifying normally and truncating after the first committed EOS (a deterministic
function of a lossless sample, so the law is preserved; docs/verification.md §1.3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from decoding.base import Draft, DraftContext, Drafter
from decoding.cached_model import CachedModel
from decoding.loop import DraftVerifyLoop, VerifyRule
from decoding.runtime import check_positive_int
from decoding.sampling import SamplingConfig, next_token
from decoding.verify import block_verify, token_verify

if TYPE_CHECKING:
    from torch import nn


def single_draft(draft: object, method: str) -> nn.Module:
    """The one draft model a chain method needs (clear errors for none or several)."""
    if draft is None:
        raise ValueError(f"method {method!r} needs a draft model; load a pair with a draft")
    if isinstance(draft, (list, tuple)):
        if len(draft) != 1:
            raise ValueError(f"method {method!r} takes one draft model, got {len(draft)}; "
                             "several drafts are for method 'specinfer'")
        draft = draft[0]
    return draft


class ModelDrafter(Drafter):
    """A small causal LM proposing a chain of up to ``num_tokens``, with its own KV cache."""

    def __init__(self, model: nn.Module, sampling: SamplingConfig, num_tokens: int) -> None:
        self.model = CachedModel(model)
        self.sampling = sampling
        self.num_tokens = num_tokens

    def reset(self) -> None:
        self.model.reset()

    def propose(self, context: DraftContext) -> Draft:
        """Draw γ_eff = min(γ, budget) tokens after ``context.ids``; no host sync in the loop.

        γ_eff draft forwards: the committed tokens not cached yet, then every draft token but the
        last (the fed draft tokens stay in the cache: ``commit`` keeps the accepted ones).
        """
        num_tokens = min(self.num_tokens, context.budget)
        logits = self.model.feed(context.ids)                                    # [V]
        tokens, probs = [], []
        for i in range(num_tokens):
            token, token_probs = next_token(logits, self.sampling, context.generator)
            tokens.append(token)
            probs.append(token_probs)
            if i + 1 < num_tokens:
                logits = self.model.append(token.view(1))                        # [V]
        return Draft(tokens=torch.stack(tokens),
                     probs=None if self.sampling.greedy else torch.stack(probs),
                     forwards=num_tokens)

    def commit(self, num_valid: int) -> None:
        self.model.rollback(num_valid)


class SpeculativeDecoding(DraftVerifyLoop):
    """Draft model + target, token verification.

    Args:
        target: the target causal LM.
        draft: the draft causal LM (same vocabulary).
        num_draft_tokens: γ, draft tokens per target forward (≥ 1).
        temperature, top_k, top_p, seed, eos_token_ids: as for every method
            (``decoding.base.DecodingMethod``).
    """

    name = "speculative"
    replayable = True             # drafts read only the committed prefix
    traceable = True              # target and draft-model forwards only
    keeps_history = False
    supports_compiled = True
    head_version = None
    draft_size_params = ("num_draft_tokens",)
    verify_rule: VerifyRule = staticmethod(token_verify)

    def __init__(self, target: nn.Module, draft: nn.Module, *, num_draft_tokens: int = 4,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        draft = single_draft(draft, self.name)
        self.num_draft_tokens = check_positive_int("num_draft_tokens", num_draft_tokens, "γ")
        super().__init__(target, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         eos_token_ids=eos_token_ids)
        self.drafter = ModelDrafter(draft, self.sampling, self.num_draft_tokens)


class BlockVerification(SpeculativeDecoding):
    """Draft model + target, block verification (Sun et al. 2024); same drafting and caches."""

    name = "block"
    replayable = True             # speculative's drafter
    traceable = True              # target and draft-model forwards only
    keeps_history = False
    supports_compiled = True
    head_version = None
    draft_size_params = ("num_draft_tokens",)
    verify_rule: VerifyRule = staticmethod(block_verify)
