"""Small helpers every decoding loop shares: request checks, KV-cache cropping, EOS truncation."""

from __future__ import annotations

import functools
import inspect
from contextlib import nullcontext
from typing import TYPE_CHECKING, ContextManager, Sequence

import torch
from transformers import DynamicCache

from decoding.reserved_cache import reserved_cache

if TYPE_CHECKING:
    from torch import nn

    from decoding.clock import PhaseClock

# Which target states a forward returns: False none, True the last layer's, else those layer ids
# side by side (``hidden_rows``; EAGLE-3's low/middle/high states).
Hidden = bool | tuple[int, ...]


def check_request(model: nn.Module, prompt_ids: torch.Tensor | Sequence[int],
                  max_new_tokens: int) -> torch.Tensor:
    """Validate a generation request and return the prompt as [L] int64 on the model's device."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: allowed is an integer >= 1")
    device = next(model.parameters()).device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).to(device)
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    vocab = int(model.config.vocab_size)
    low, high = int(prompt.min()), int(prompt.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"prompt token id {low if low < 0 else high} is outside the model's "
                         f"vocabulary [0, {vocab})")
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if context and prompt.numel() + max_new_tokens > context:
        raise ValueError(
            f"prompt of {prompt.numel()} tokens + max_new_tokens={max_new_tokens} exceeds the "
            f"model's context of {context} tokens: shorten the prompt or lower max_new_tokens")
    return prompt


def stop_ids(model: nn.Module, eos_token_ids: Sequence[int] | None) -> frozenset[int]:
    """The ids that end generation: those given, else every EOS the model declares."""
    from decoding.models import eos_token_ids as declared
    return frozenset(eos_token_ids if eos_token_ids is not None else declared(model))


def new_cache(model: nn.Module, capacity: int = 0) -> DynamicCache:
    """An empty KV cache for ``model`` whose layers write in place into reserved storage
    (``decoding.reserved_cache``; ``capacity``: rows to reserve, 0 = grow as needed)."""
    return reserved_cache(model, capacity)


def cache_argument(model: nn.Module, cache: DynamicCache) -> dict[str, DynamicCache]:
    """The keyword that hands ``cache`` to ``model``'s forward: ``cache`` since transformers 5.24,
    ``past_key_values`` before (5.24 still takes the old name but warns on every run)."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def forward_logits(model: nn.Module, input_ids: torch.Tensor, cache: DynamicCache, start: int,
                   num_logits: int) -> torch.Tensor:
    """One cached forward of ``input_ids`` ([1, n]) at positions start..start+n−1.

    Positions are passed explicitly so the model does not re-derive them from the cache, and only
    the last ``num_logits`` rows go through the LM head. Returns [num_logits, V] logits.
    """
    return forward_states(model, input_ids, cache, start, num_logits, False)[0]


def forward_states(model: nn.Module, input_ids: torch.Tensor, cache: DynamicCache, start: int,
                   num_logits: int, hidden: Hidden
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``forward_logits`` plus the states ``hidden`` asks for (``hidden_rows``; False: None)."""
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
    out = model(input_ids=input_ids, **cache_argument(model, cache), use_cache=True,
                position_ids=positions[None], cache_position=positions,
                logits_to_keep=num_logits, output_hidden_states=bool(hidden))
    return out.logits[0], (hidden_rows(out.hidden_states, hidden) if hidden else None)


def hidden_rows(hidden_states: Sequence[torch.Tensor], layers: Hidden
                ) -> torch.Tensor:
    """A drafter's view of a forward's ``hidden_states`` (batch 1): the last entry [n, H] (what
    the LM head reads) for ``layers=True``, else the given entries side by side [n, k·H]
    (entry j = the input of decoder layer j; EAGLE-3's low/middle/high states)."""
    if layers is True:
        return hidden_states[-1][0]
    return torch.cat([hidden_states[j][0] for j in layers], dim=-1)


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer (no-op if already that short)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def phase(clock: PhaseClock | None, name: str) -> ContextManager[None]:
    return clock.phase(name) if clock is not None else nullcontext()


def truncate_at_eos(tokens: list[int], eos_ids: Sequence[int]) -> tuple[list[int], bool]:
    """Cut ``tokens`` after the first EOS (kept); returns (tokens, finished)."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1], True
    return tokens, False


def check_positive_int(name: str, value: object, symbol: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        label = f"{name} ({symbol})" if symbol else name
        raise ValueError(f"{label}={value!r} is invalid: allowed is an integer >= 1")
    return value
