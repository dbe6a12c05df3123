"""Vanilla KV-cached autoregressive decoding: the reference every other method must reproduce.

At temperature 0 any lossless method must emit exactly these tokens; the tuner re-checks that on
every trial (``matches_vanilla``). One target forward per token, prompt prefilled in one forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from decoding.base import DecodingMethod, Step
from decoding.runtime import check_request, forward_logits, make_generator, new_cache, phase
from decoding.sampling import next_token

if TYPE_CHECKING:
    from torch import nn

    from decoding.clock import PhaseClock


class Vanilla(DecodingMethod):
    """Plain decoding with the target alone.

    Args:
        target: a causal LM (Hugging Face ``PreTrainedModel``).
        temperature, top_k, top_p: sampling settings (temperature 0 = greedy).
        seed: seeds the ``torch.Generator`` created for each generation.
        eos_token_ids: stop ids; default: the model's generation config.
    """

    name = "vanilla"

    def __init__(self, target: nn.Module, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        super().__init__(target, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         eos_token_ids=eos_token_ids)

    @torch.inference_mode()
    def stream(self, prompt_ids: torch.Tensor, max_new_tokens: int,
               clock: PhaseClock | None = None) -> Iterator[Step]:
        inputs = check_request(self.target, prompt_ids, max_new_tokens)[None]   # [1, L] prefill
        generator = make_generator(self.seed, inputs.device)
        cache = new_cache(self.target)
        for _ in range(max_new_tokens):
            with phase(clock, "verify"):
                logits = forward_logits(self.target, inputs, cache, cache.get_seq_length(), 1)[-1]
                token, _ = next_token(logits, self.sampling, generator)            # [V] -> []
                token_id = int(token)
            yield Step(tokens=(token_id,), drafted=0, accepted=0)
            if token_id in self.eos_ids:
                return
            inputs = token.view(1, 1)
