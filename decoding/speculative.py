"""Draft-model speculative decoding with token verification or block verification.

One step (Leviathan et al. 2023; Chen et al. 2023; Sun et al. 2024):
  1. the draft model proposes γ tokens autoregressively (γ draft forwards);
  2. the target scores the uncached committed tokens + the γ drafts in ONE forward ([γ+1] rows);
  3. a pure verify function (``decoding.verify``) accepts a prefix and emits one more token;
  4. both KV caches are cropped to the committed prefix (never re-encoded).

Cache invariant: the target cache holds every committed token except the last (which is fed again
with the next draft); the draft cache holds at most the committed prefix plus its own draft.
γ is capped at ``max_new_tokens − produced − 1`` so a step never overshoots the budget; EOS inside a
draft is handled by verifying normally and truncating after the first committed EOS (a deterministic
function of a lossless sample, so the law is preserved; notes/verification.md §1.3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from decoding.base import Draft, Step, Verdict
from decoding.runtime import (check_positive_int, check_request, crop_cache, forward_logits,
                              make_generator, new_cache, phase, truncate_at_eos, stop_ids)
from decoding.sampling import SamplingConfig, logits_to_probs, next_token
from decoding.verify import block_verify, greedy_match, token_verify

if TYPE_CHECKING:
    from torch import nn

    from decoding.clock import PhaseClock

VerifyRule = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, "torch.Generator | None"],
                      Verdict]


class ModelDrafter:
    """A small causal LM proposing a chain, with its own KV cache ("model with undo")."""

    def __init__(self, model: nn.Module, sampling: SamplingConfig) -> None:
        self.model = model
        self.sampling = sampling
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.cached = 0            # context positions held in ``cache``

    def propose(self, context: torch.Tensor, num_tokens: int,
                generator: torch.Generator | None) -> Draft:
        """Draw ``num_tokens`` tokens after ``context`` ([L]); no host sync inside the loop."""
        inputs = context[self.cached:][None]                                   # [1, u]
        tokens, probs = [], []
        for i in range(num_tokens):
            start = self.cached if i == 0 else context.shape[0] + i - 1
            logits = forward_logits(self.model, inputs, self.cache, start, 1)[-1]   # [V]
            token, token_probs = next_token(logits, self.sampling, generator)
            tokens.append(token)
            probs.append(token_probs)
            inputs = token.view(1, 1)
        self.cached = context.shape[0] + num_tokens - 1   # the last draft token is not fed
        return Draft(tokens=torch.stack(tokens),
                     probs=None if self.sampling.greedy else torch.stack(probs),
                     forwards=num_tokens)

    def commit(self, num_valid: int) -> None:
        if self.cached > num_valid:
            crop_cache(self.cache, num_valid)
            self.cached = num_valid


class SpeculativeDecoding:
    """Draft model + target, token verification.

    Args:
        target: the target causal LM.
        draft: the draft causal LM (same vocabulary).
        num_draft_tokens: γ, draft tokens per target forward (≥ 1).
        temperature, top_k, top_p: sampling settings shared by draft and target.
        seed: seeds the generation's ``torch.Generator``.
        eos_token_ids: stop ids; default: the target's generation config.
    """

    name = "speculative"
    verify_rule: VerifyRule = staticmethod(token_verify)

    def __init__(self, target: nn.Module, draft: nn.Module, *, num_draft_tokens: int = 4,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        if draft is None:
            raise ValueError(f"method {self.name!r} needs a draft model; load a pair with a draft")
        self.num_draft_tokens = check_positive_int("num_draft_tokens", num_draft_tokens, "γ")
        self.target = target
        self.sampling = SamplingConfig(temperature, top_k, top_p)
        self.drafter = ModelDrafter(draft, self.sampling)
        self.seed = seed
        self.eos_ids = stop_ids(target, eos_token_ids)

    def _verify(self, draft: Draft, logits: torch.Tensor,
                generator: torch.Generator) -> Verdict:
        if self.sampling.greedy:
            return greedy_match(draft.tokens, logits)
        target_probs = logits_to_probs(logits, self.sampling)                  # [γ+1, V]
        return self.verify_rule(draft.tokens, draft.probs, target_probs, generator)

    @torch.inference_mode()
    def stream(self, prompt_ids: torch.Tensor, max_new_tokens: int,
               clock: PhaseClock | None = None) -> Iterator[Step]:
        # 1. state: committed ids in a preallocated buffer; target cache starts empty
        prompt = check_request(self.target, prompt_ids, max_new_tokens)
        generator = make_generator(self.seed, prompt.device)
        sequence = torch.cat([prompt, prompt.new_zeros(max_new_tokens)])       # [L + max_new]
        length, cached, produced = prompt.shape[0], 0, 0
        cache = new_cache(self.target)
        self.drafter.reset()
        empty = Draft(tokens=prompt.new_zeros(0))
        while produced < max_new_tokens:
            # 2. draft γ_eff tokens (never more than the budget can take)
            gamma = min(self.num_draft_tokens, max_new_tokens - produced - 1)
            draft = empty
            if gamma:
                with phase(clock, "draft"):
                    draft = self.drafter.propose(sequence[:length], gamma, generator)
            # 3. one target forward over uncached context + draft, then verify
            with phase(clock, "verify"):
                inputs = torch.cat([sequence[cached:length], draft.tokens])[None]  # [1, u+γ]
                logits = forward_logits(self.target, inputs, cache, cached, gamma + 1)  # [γ+1, V]
                verdict = self._verify(draft, logits, generator)
            # 4. commit, truncate at EOS, roll both caches back to the committed prefix
            emitted = draft.tokens[: verdict.accepted].tolist() + [verdict.next_token]
            tokens, finished = truncate_at_eos(emitted, self.eos_ids)
            cached = length + verdict.accepted
            crop_cache(cache, cached)
            self.drafter.commit(cached)
            sequence[length: length + len(tokens)] = torch.tensor(tokens, device=sequence.device)
            length += len(tokens)
            produced += len(tokens)
            yield Step(tokens=tuple(tokens), drafted=gamma, accepted=verdict.accepted,
                       draft_forwards=draft.forwards)
            if finished:
                return


class BlockVerification(SpeculativeDecoding):
    """Draft model + target, block verification (Sun et al. 2024); same drafting and caches."""

    name = "block"
    verify_rule: VerifyRule = staticmethod(block_verify)
