"""SpecInfer (Miao et al. 2024): several drafts merged into one token tree, verified in one forward.

Each draft model (one or several, ``pair.drafts``) samples ``num_drafts`` independent sequences
of γ = ``num_draft_tokens`` tokens; all sequences are merged into one token tree (identical
prefixes share a forward slot, ``decoding.tree.merge_duplicates``) and verified by the target in
one forward with a topology-aware mask (``decoding.loop``).

Verification (arXiv 2305.09781, Alg. 2):
  * greedy (temperature 0): VerifyGreedy, descend while a child is the target's argmax;
  * stochastic: VerifyStochastic (multi-step speculative sampling). At a node the sampled children
    are tried in draw order (sequence order, then model order, independent of the coins); child x
    drawn from q_j is accepted with probability min(1, p(x)/q_j(x)); on rejection
    p ← norm(max(p − q_j, 0)). Each draw counts, duplicates included, and when a token is accepted
    the children of every draw of it are tried below it. Exactly lossless (docs/verification.md
    §3.1–3.2: given the accepted path, the continuations are fresh independent draws).

Drafting temperature: the sequences are drawn from each draft's distribution warped with
``draft_temperature`` (default: the method's temperature, or 1.0 at temperature 0, where identical
greedy drafts would be useless). The verifier uses exactly that distribution as q.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from decoding.base import Draft, DraftContext, Drafter
from decoding.cached_model import CachedModel
from decoding.loop import DraftVerifyLoop
from decoding.runtime import check_positive_int
from decoding.sampling import SamplingConfig, logits_to_probs, sample_rows
from decoding.tree import Forest

if TYPE_CHECKING:
    from torch import nn


class SampledSequences:
    """``num_drafts`` i.i.d. sequences of up to γ tokens from one draft model (own KV cache)."""

    def __init__(self, model: nn.Module, sampling: SamplingConfig, num_drafts: int,
                 num_tokens: int) -> None:
        self.model, self.sampling = CachedModel(model), sampling
        self.num_drafts, self.num_tokens = num_drafts, num_tokens

    def reset(self) -> None:
        self.model.reset()

    def commit(self, num_valid: int) -> None:
        self.model.rollback(num_valid)

    def sample(self, ids: torch.Tensor, gamma: int, generator: torch.Generator | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [γ, m] and their draft distributions [γ, m, V] (step-major); γ forwards."""
        q = logits_to_probs(self.model.feed(ids), self.sampling)                   # [V]
        q = q.expand(self.num_drafts, -1)                                            # [m, V]
        tree = Forest()                 # the fed draws: node d·m + s is step d of sequence s
        tokens, probs = [], []
        for step in range(gamma):
            drawn = sample_rows(q, generator)                                        # [m]
            tokens.append(drawn)
            probs.append(q)
            if step + 1 < gamma:
                nodes = [tree.add(t, s + (step - 1) * self.num_drafts if step else -1)
                         for s, t in enumerate(drawn.tolist())]
                depths = [step + 1] * len(tree.tokens)  # (read for the fed nodes only)
                logits = self.model.extend_tree(nodes, tree.tokens, tree.parents, depths)
                q = logits_to_probs(logits, self.sampling)                         # [m, V]
        self.model.discard_tree()
        return torch.stack(tokens), torch.stack(probs)


class MultiDrafter(Drafter):
    """Every draft model's sequences, merged into one tree ``Draft`` (node = one draw)."""

    def __init__(self, models: Sequence[nn.Module], sampling: SamplingConfig, num_drafts: int,
                 num_tokens: int) -> None:
        self.sources = [SampledSequences(m, sampling, num_drafts, num_tokens) for m in models]
        self.num_tokens = num_tokens

    def reset(self) -> None:
        for source in self.sources:
            source.reset()

    def commit(self, num_valid: int) -> None:
        for source in self.sources:
            source.commit(num_valid)

    def propose(self, context: DraftContext) -> Draft:
        gamma = min(self.num_tokens, context.budget)
        drawn = [s.sample(context.ids, gamma, context.generator) for s in self.sources]
        tokens = torch.cat([t for t, _ in drawn], dim=1)                 # [γ, M·m]
        probs = torch.cat([q for _, q in drawn], dim=1)                  # [γ, M·m, V]
        width = tokens.shape[1]
        node = torch.arange(gamma * width, device=tokens.device).view(gamma, width)
        parents = torch.cat([torch.full((1, width), -1, device=tokens.device), node[:-1]])
        return Draft(tokens=tokens.reshape(-1), probs=probs.reshape(gamma * width, -1),
                     parents=parents.reshape(-1), forwards=gamma * len(self.sources))


class SpecInfer(DraftVerifyLoop):
    """Target + one or several draft models, merged multi-draft token trees.

    Args:
        target: the target causal LM.
        draft: a draft causal LM or a sequence of them (``load_pair`` with a list of draft specs).
        num_drafts: sampled sequences per draft model per step (SpecInfer's expansion width).
        num_draft_tokens: γ, tokens per sequence.
        draft_temperature: drafting temperature (None: the method's, or 1.0 when greedy).
        temperature, top_k, top_p, seed, eos_token_ids: as for every method.
    """

    name = "specinfer"
    replayable = False            # several sampled drafts
    traceable = True              # target and draft-model forwards only
    keeps_history = False
    supports_compiled = True
    head_version = None
    draft_size_params = ("num_drafts", "num_draft_tokens")

    def __init__(self, target: nn.Module, draft: nn.Module | Sequence[nn.Module], *,
                 num_drafts: int = 3, num_draft_tokens: int = 4,
                 draft_temperature: float | None = None, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        drafts = list(draft) if isinstance(draft, (list, tuple)) else [draft]
        if not drafts or any(d is None for d in drafts):
            raise ValueError("method 'specinfer' needs a draft model; load a pair with a draft")
        check_positive_int("num_drafts", num_drafts)
        check_positive_int("num_draft_tokens", num_draft_tokens, "γ")
        super().__init__(target, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         eos_token_ids=eos_token_ids)
        if draft_temperature is None:
            draft_temperature = temperature if temperature > 0 else 1.0
        if not draft_temperature > 0:
            raise ValueError(f"draft_temperature={draft_temperature!r} is invalid: allowed is a "
                             "number > 0 (drafts are sampled)")
        draft_sampling = SamplingConfig(draft_temperature, top_k, top_p)
        self.drafter = MultiDrafter(drafts, draft_sampling, num_drafts, num_draft_tokens)
