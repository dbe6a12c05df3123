"""The oracle EAGLE head: the head interface answered by the target itself, so that a drafter
that aligns features, shifted tokens, positions and tree masks correctly is always right
(tests/test_eagle.py; tests/test_eagle3.py wraps it as an EAGLE-3 head). ``PROMPT``: the prompt
both use (the oracle's cache holds its first token)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from decoding.runtime import cache_argument

PROMPT = [3, 4, 5, 6, 7]


class OracleCache:
    """The target's own cache, holding the prompt's first token before the head's rows."""

    def __init__(self, target: torch.nn.Module, first: int) -> None:
        self.inner = DynamicCache(config=target.config)
        with torch.no_grad():
            target(input_ids=torch.tensor([[first]]), **cache_argument(target, self.inner), use_cache=True)

    @property
    def length(self) -> int:
        return self.inner.get_seq_length() - 1

    def crop(self, length: int) -> None:
        excess = self.inner.get_seq_length() - (length + 1)
        if excess > 0:
            self.inner.crop(-excess)


class OracleHead:
    """The head interface answered by the target itself: head row i (input t_{i+1}) is the
    target's row at position i + 1, so the 'predicted' feature is the true one. A drafter that
    aligns features, shifted tokens, positions and tree masks correctly is then always right."""

    def __init__(self, target: torch.nn.Module, first: int) -> None:
        self.target, self.first = target, first

    def new_cache(self) -> OracleCache:
        return OracleCache(self.target, self.first)

    def parameters(self):
        return self.target.parameters()

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.target.get_output_embeddings()(features)

    def __call__(self, features, tokens, positions, mask, cache):
        start = cache.inner.get_seq_length()
        first = torch.zeros(mask.shape[:-1] + (1,), dtype=mask.dtype)       # t_0: seen by all
        out = self.target(input_ids=tokens, position_ids=(positions + 1)[None],
                          attention_mask=torch.cat([first, mask], dim=-1),
                          **cache_argument(self.target, cache.inner), use_cache=True, output_hidden_states=True,
                          cache_position=torch.arange(start, start + tokens.shape[1]))
        return out.hidden_states[-1]
