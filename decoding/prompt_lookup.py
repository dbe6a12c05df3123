"""Prompt lookup decoding (Saxena 2023; HF ``prompt_lookup_num_tokens``, vLLM ``ngram``): no draft model.

    method = build_method("prompt_lookup", pair, max_ngram=3, num_draft_tokens=10)

Drafting: the last n committed tokens (n from ``max_ngram`` down to ``min_ngram``) are looked up
in the committed sequence itself (prompt + generated text); the tokens that followed an earlier
occurrence are the draft. The latest occurrence of the longest matching n-gram wins; with
``num_matches`` > 1 the distinct continuations of several occurrences (latest first, longer n-grams
first) are merged into a trie and verified as a token tree in the same single target forward.

Every draft token is a deterministic function of the context, i.e. a point mass (``Draft.probs``
None, requirement R2 of docs/verification.md): greedy match at temperature 0, token verification
with q = δ_x (accept x with probability p(x)) at temperature > 0, EAGLE's point-mass rule at every
node of a trie. Lossless in both modes. What wins on extractive tasks (summaries, code edits)
where the output copies the input; costs nothing when nothing matches (an empty draft is one plain
target step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from decoding.base import Draft, DraftContext, Drafter
from decoding.loop import DraftVerifyLoop
from decoding.runtime import check_positive_int
from decoding.tree import Forest

if TYPE_CHECKING:
    from torch import nn


def find_continuations(ids: torch.Tensor, min_ngram: int, max_ngram: int, length: int,
                       count: int) -> list[list[int]]:
    """Up to ``count`` distinct continuations (≤ ``length`` tokens) of earlier n-gram matches.

    Args:
        ids: [L] committed token ids; the n-gram is its suffix, matches end before its last token.

    Returns:
        Continuations, longest n-gram first, then latest occurrence first; none is a prefix of
        another (a prefix adds no node to the trie, so it does not use up ``count``).
    """
    total = int(ids.shape[0])
    sequence: list[int] | None = None      # one device->host copy, only once something matched
    found: list[list[int]] = []
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        windows = ids[: total - 1].unfold(0, n, 1)                  # [L−n, n] starts 0..L−1−n
        hits = (windows == ids[total - n:]).all(dim=1).nonzero().flatten().tolist()
        if hits and sequence is None:
            sequence = ids.tolist()
        for start in reversed(hits):
            follow = sequence[start + n: start + n + length]
            if any(other[: len(follow)] == follow for other in found):
                continue                     # already a path of the trie: no new node
            # a found continuation that is a prefix of this one would add no node either
            found = [other for other in found if follow[: len(other)] != other] + [follow]
            if len(found) == count:
                return found
    return found


class PromptLookupDrafter(Drafter):
    """Point-mass drafts copied from the committed sequence (no model, no state: the base's
    ``reset`` and ``commit`` are no-ops)."""

    def __init__(self, min_ngram: int, max_ngram: int, num_tokens: int, num_matches: int) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.num_tokens, self.num_matches = num_tokens, num_matches

    def propose(self, context: DraftContext) -> Draft:
        ids = context.ids
        found = find_continuations(ids, self.min_ngram, self.max_ngram,
                                   min(self.num_tokens, context.budget), self.num_matches)
        if len(found) <= 1:                          # a chain (possibly empty)
            tokens = found[0] if found else []
            return Draft(tokens=torch.tensor(tokens, dtype=torch.long, device=ids.device))
        forest = Forest()
        forest.trie(found, -1)
        return Draft(tokens=torch.tensor(forest.tokens, dtype=torch.long, device=ids.device),
                     parents=torch.tensor(forest.parents, dtype=torch.long, device=ids.device))


class PromptLookup(DraftVerifyLoop):
    """The target alone, drafting by n-gram lookup in its own context.

    Args:
        target: the target causal LM.
        max_ngram: longest suffix n-gram looked up (HF ``max_matching_ngram_size``).
        min_ngram: shortest one tried when longer ones do not match.
        num_draft_tokens: γ, tokens copied after a match (HF ``prompt_lookup_num_tokens``).
        num_matches: distinct continuations verified together as a trie (1 = a chain).
        temperature, top_k, top_p, seed, eos_token_ids: as for every method.
    """

    name = "prompt_lookup"
    replayable = True             # drafts read only the committed prefix
    traceable = True              # target forwards only
    keeps_history = False
    supports_compiled = True
    head_version = None
    draft_size_params = ("num_draft_tokens", "num_matches")   # γ × the trie's matches

    def __init__(self, target: nn.Module, *, max_ngram: int = 3, min_ngram: int = 1,
                 num_draft_tokens: int = 10, num_matches: int = 1, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        check_positive_int("num_draft_tokens", num_draft_tokens, "γ")
        for name, value in (("min_ngram", min_ngram), ("max_ngram", max_ngram),
                            ("num_matches", num_matches)):
            check_positive_int(name, value)
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram={min_ngram} > max_ngram={max_ngram} is invalid: allowed "
                             "is min_ngram <= max_ngram")
        super().__init__(target, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         eos_token_ids=eos_token_ids)
        self.drafter = PromptLookupDrafter(min_ngram, max_ngram, num_draft_tokens, num_matches)
