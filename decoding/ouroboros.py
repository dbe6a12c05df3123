"""Ouroboros (Zhao et al. 2024): phrase-level drafting, lengthened drafts, phrase mining, history.

One round (paper §3; reference behaviour and its bugs in docs/phrase_drafting.md §2):
  1. *accelerating drafting via phrases*: the draft model produces γ tokens with lookahead decoding
     (its own Jacobi window + the shared phrase pool), i.e. its greedy draft in fewer forwards;
  2. *lengthening drafts via phrases*: up to K pool phrases keyed by the last draft token (the K
     newest) are appended; draft chain + K suffixes form a tree verified in ONE target forward;
  3. verification walks the tree (greedy, or the point-mass sampling rule at temperature > 0: the
     draft is greedy, so every candidate is a point mass and the target's law is kept);
  4. *phrases from verification*: after a rejection, the discarded draft tail is mined for
     sub-segments the target agrees with (the #Match observation, §3.3); after a full accept, each
     tried suffix is replaced by the target's own continuation of it;
  5. *reusing history*: the pool survives across prompts (within one method object), ``reset()``
     clears it.
Each component has a switch, reproducing the ablation ladder of Table 4. Steps 1–2 are the drafter
(``PhraseDrafter``: the draft chain and its suffixes form one tree ``Draft`` of point masses), step 3
is the shared loop (``decoding.loop``), step 4 the drafter's ``observe``.

Symbols → arguments: γ ``num_draft_tokens``, W ``window``, β ``phrase_length`` (a phrase is its key
token + β−1 tokens, the paper's p_1..p_β; it is also the draft's lookahead n-gram size N), K
``num_phrases``, G ``guess_set`` (pool capacity per key and draft candidates per step; default W,
as the reference asserts).
Reference bugs avoided: the bonus token is kept on a full match; the post-rejection pool update runs;
EOS is found in emitted-token coordinates; no logits are stored (argmax ids only, per round); no
global RNG is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from decoding.base import Draft, DraftContext, Drafter, Verdict
from decoding.lookahead import GREEDY, LookaheadEngine, check_lookahead_params
from decoding.loop import DraftVerifyLoop
from decoding.phrases import PhrasePool
from decoding.runtime import check_positive_int
from decoding.speculative import single_draft
from decoding.tree import Forest

if TYPE_CHECKING:
    from torch import nn


def mine_misplaced_phrases(tail: Sequence[int], target_next: Sequence[int],
                           length: int) -> list[tuple[int, tuple[int, ...]]]:
    """Phrases from a rejected draft tail (Ouroboros §3.3, Figure 4).

    ``tail`` [m]: the discarded draft tokens from the first wrong one; ``target_next`` [m]: the
    target's greedy token after each of them (in the draft's context). For each i, the phrase keyed
    by tail[i] collects target_next[i], target_next[i+1], ... while the draft's next token agrees
    with the target's previous prediction; only phrases reaching ``length`` tokens are kept.
    """
    found = []
    for start in range(len(tail)):
        phrase, j = [], start
        while len(phrase) < length and j < len(tail):
            phrase.append(target_next[j])
            if j + 1 >= len(tail) or tail[j + 1] != target_next[j]:
                break
            j += 1
        if len(phrase) == length:
            found.append((tail[start], tuple(phrase)))
    return found


@dataclass(frozen=True)
class Proposal:
    """What the last draft was made of (read back when mining phrases)."""

    draft: list[int]                      # [γ_eff] the draft model's greedy chain
    suffixes: list[tuple[int, ...]]       # pool phrases appended after the chain
    suffix_paths: list[list[int]]         # draft node indices of each suffix


class PhraseDrafter(Drafter):
    """The draft model drafting γ greedy tokens, phrase by phrase (lookahead) or token by token,
    then lengthened by up to K pool phrases keyed by its last token (a tree of point masses);
    ``observe`` mines the verification forward into the pool (step 4)."""

    def __init__(self, model: nn.Module, pool: PhrasePool, *, num_tokens: int, window: int,
                 phrase_length: int, guess_set: int, num_phrases: int, use_phrases: bool,
                 lengthen: bool, mine: bool, keep_history: bool, seed: int) -> None:
        self.engine = LookaheadEngine(model, window if use_phrases else 0, phrase_length, pool,
                                      guess_set if use_phrases else 0, seed)
        self.pool, self.num_tokens, self.num_phrases = pool, num_tokens, num_phrases
        self.phrase_length, self.lengthen, self.mine = phrase_length, lengthen, mine
        self.keep_history = keep_history
        self.proposal = Proposal([], [], [])     # the last proposal, read back by ``observe``

    def reset(self) -> None:
        self.engine.reset()
        if not self.keep_history:
            self.pool.reset()

    def _chain(self, seq: list[int], num_tokens: int) -> tuple[list[int], int]:
        local, draft, forwards = list(seq), [], 0
        while len(draft) < num_tokens:
            step = self.engine.advance(local, num_tokens - len(draft), GREEDY)
            draft += step.tokens
            local += step.tokens
            forwards += 1
        return draft, forwards

    def _suffixes(self, key: int, room: int) -> list[tuple[int, ...]]:
        if not self.lengthen or self.num_phrases == 0 or room < 1:
            return []
        trimmed = [p[:room] for p in self.pool.get(key, self.num_phrases, newest=True)]
        return list(dict.fromkeys(trimmed))

    def propose(self, context: DraftContext) -> Draft:
        seq = context.ids.tolist()
        gamma = min(self.num_tokens, context.budget)
        draft, forwards = self._chain(seq, gamma)
        suffixes = self._suffixes(draft[-1] if draft else seq[-1], context.budget - gamma)
        forest = Forest()
        nodes = forest.chain(draft, -1)
        _, suffix_paths = forest.trie(suffixes, nodes[-1] if nodes else -1)
        self.proposal = Proposal(draft, suffixes, suffix_paths)
        device = context.ids.device
        return Draft(tokens=torch.tensor(forest.tokens, dtype=torch.long, device=device),
                     parents=torch.tensor(forest.parents, dtype=torch.long, device=device),
                     forwards=forwards)

    def commit(self, num_valid: int) -> None:
        self.engine.rollback(num_valid)

    def observe(self, draft: Draft, verdict: Verdict, logits: torch.Tensor) -> dict[str, float]:
        """Step 4: mine the verification forward into the pool; suffix and pool counters."""
        last = self.proposal if draft.size else Proposal([], [], [])   # no draft this step
        gamma = len(last.draft)
        accepted_draft = min(verdict.accepted, gamma)      # suffixes hang below the draft
        extras = self._learn(last, accepted_draft, logits)
        extras.update({"suffix_drafted": float(draft.size - gamma),
                       "suffix_accepted": float(verdict.accepted - accepted_draft),
                       "pool_lookups": 1.0, "pool_hit": float(bool(last.suffixes)),
                       "pool_size_last": float(len(self.pool))})
        return extras

    def _learn(self, last: Proposal, accepted_draft: int, logits: torch.Tensor
               ) -> dict[str, float]:
        """Mine the verification results into the pool; returns #Match for the statistics.

        ``logits`` [1+n, V]: row 0 after the last committed token, row i+1 after draft node i (the
        draft's nodes are distinct, so slots are nodes).
        """
        choice = logits.argmax(dim=-1).tolist()
        draft, gamma = last.draft, len(last.draft)
        match = sum(draft[i] == choice[i] for i in range(gamma))   # #Match(d, v), Eq. 10
        if not self.mine:
            return {"match": float(match)}
        if accepted_draft < gamma:
            tail = draft[accepted_draft:]
            after = [choice[1 + i] for i in range(accepted_draft, gamma)]
            self.pool.insert_all(mine_misplaced_phrases(tail, after, self.phrase_length - 1))
        elif last.suffixes:
            bonus = choice[gamma]                      # the target's token after the whole draft
            key = draft[-1] if draft else None
            for phrase, nodes in zip(last.suffixes, last.suffix_paths):
                corrected = (bonus, *(choice[1 + n] for n in nodes[:-1]))
                if key is not None and corrected != phrase:
                    self.pool.replace(key, phrase, corrected)
        return {"match": float(match)}


class Ouroboros(DraftVerifyLoop):
    """Draft + target speculative decoding with phrases.

    Args:
        target, draft: causal LMs sharing a vocabulary.
        num_draft_tokens: γ. window: W. phrase_length: β (≥ 2). num_phrases: K (0 = no lengthening).
        guess_set: G (None = W).
        draft_lookahead, lengthen_drafts, verification_phrases, reuse_history: ablation switches.
        temperature, top_k, top_p, seed, eos_token_ids: as for every method (drafting stays greedy).
    """

    name = "ouroboros"
    replayable = False            # its phrase pool mines the target's forwards
    traceable = True              # target and draft-model forwards only
    supports_compiled = True
    head_version = None
    draft_size_params = ("num_draft_tokens",)

    @property
    def keeps_history(self) -> bool:  # type: ignore[override]  # decided per instance
        """With ``reuse_history`` the pool outlives a generation (``DecodingMethod``)."""
        return self.reuse_history

    def __init__(self, target: nn.Module, draft: nn.Module, *, num_draft_tokens: int = 4,
                 window: int = 15, phrase_length: int = 6, num_phrases: int = 3,
                 guess_set: int | None = None, draft_lookahead: bool = True,
                 lengthen_drafts: bool = True, verification_phrases: bool = True,
                 reuse_history: bool = True, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        draft = single_draft(draft, self.name)
        self.num_draft_tokens = check_positive_int("num_draft_tokens", num_draft_tokens, "γ")
        guess_set = window if guess_set is None else guess_set
        check_lookahead_params(window, phrase_length, guess_set)
        if isinstance(num_phrases, bool) or not isinstance(num_phrases, int) or num_phrases < 0:
            raise ValueError(f"num_phrases (K)={num_phrases!r} is invalid: allowed is an integer "
                             ">= 0")
        super().__init__(target, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         eos_token_ids=eos_token_ids)
        self.pool = PhrasePool(guess_set)
        self.reuse_history = reuse_history
        self.drafter = PhraseDrafter(
            draft, self.pool, num_tokens=self.num_draft_tokens, window=window,
            phrase_length=phrase_length, guess_set=guess_set, num_phrases=num_phrases,
            use_phrases=draft_lookahead, lengthen=lengthen_drafts, mine=verification_phrases,
            keep_history=reuse_history, seed=seed)

    def reset(self) -> None:
        """Forget the phrase history (e.g. after untimed warm-up runs)."""
        self.pool.reset()
