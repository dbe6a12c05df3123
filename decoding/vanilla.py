"""Vanilla KV-cached autoregressive decoding: the reference every other method must reproduce.

At temperature 0 any lossless method must emit exactly these tokens; the tuner re-checks that on
every trial (``matches_vanilla``). One target forward per token, prompt prefilled in one forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from decoding.base import DecodingMethod, Step
from decoding.runtime import check_request, make_generator, phase
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
    replayable = False            # nothing drafted
    traceable = False             # nothing drafted: nothing to predict
    keeps_history = False
    supports_compiled = True
    head_version = None
    draft_size_params = ()

    def __init__(self, target: nn.Module, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        super().__init__(target, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         eos_token_ids=eos_token_ids)

    @torch.inference_mode()
    def stream(self, prompt_ids: torch.Tensor, max_new_tokens: int,
               clock: PhaseClock | None = None) -> Iterator[Step]:
        inputs = check_request(self.target, prompt_ids, max_new_tokens)          # [L] prefill
        generator = make_generator(self.seed, inputs.device)
        cache = self.target_cache(inputs.shape[0] + max_new_tokens)
        start = 0
        for _ in range(max_new_tokens):
            with phase(clock, "verify"):
                logits = cache.chain(inputs, start, 1, False)[0][-1]                 # [V]
                token, _ = next_token(logits, self.sampling, generator)            # [V] -> []
                token_id = int(token)
            yield Step(tokens=(token_id,), drafted=0, accepted=0)
            if token_id in self.eos_ids:
                return
            start += inputs.shape[0]
            inputs = token.view(1)
