"""Ouroboros (Zhao et al. 2024): phrase-level drafting, lengthened drafts, phrase mining, history.

One round (paper §3; reference behaviour and its bugs in notes/phrase_drafting.md §2):
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
Each component has a switch, reproducing the ablation ladder of Table 4.

Symbols → arguments: γ ``num_draft_tokens``, W ``window``, β ``phrase_length`` (a phrase is its key
token + β−1 tokens, the paper's p_1..p_β; it is also the draft's lookahead n-gram size N), K
``num_phrases``, G ``guess_set`` (pool capacity per key and draft candidates per step; default W,
as the reference asserts).
Reference bugs avoided: the bonus token is kept on a full match; the post-rejection pool update runs;
EOS is found in emitted-token coordinates; no logits are stored (argmax ids only, per round); no
global RNG is touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from decoding.base import Step
from decoding.lookahead import GREEDY, Forest, LookaheadEngine, check_lookahead_params
from decoding.phrases import PhrasePool
from decoding.runtime import (check_positive_int, check_request, make_generator, new_cache, phase,
                              truncate_at_eos, stop_ids)
from decoding.sampling import SamplingConfig
from decoding.tree import keep_cache_rows, tree_forward, verify_tree

if TYPE_CHECKING:
    from torch import nn

    from decoding.clock import PhaseClock


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


class PhraseDrafter:
    """The draft model drafting γ greedy tokens, phrase by phrase (lookahead) or token by token."""

    def __init__(self, model: nn.Module, window: int, phrase_length: int, guess_set: int,
                 pool: PhrasePool, use_phrases: bool, seed: int) -> None:
        self.engine = LookaheadEngine(model, window if use_phrases else 0, phrase_length, pool,
                                      guess_set if use_phrases else 0, seed)

    def reset(self) -> None:
        self.engine.reset()

    def propose(self, seq: Sequence[int], num_tokens: int) -> tuple[list[int], int]:
        local, draft, forwards = list(seq), [], 0
        while len(draft) < num_tokens:
            step = self.engine.advance(local, num_tokens - len(draft), GREEDY)
            draft += step.tokens
            local += step.tokens
            forwards += 1
        return draft, forwards

    def commit(self, num_valid: int) -> None:
        self.engine.rollback(num_valid)


class Ouroboros:
    """Draft + target speculative decoding with phrases.

    Args:
        target, draft: causal LMs sharing a vocabulary.
        num_draft_tokens: γ. window: W. phrase_length: β (≥ 2). num_phrases: K (0 = no lengthening).
        guess_set: G (None = W).
        draft_lookahead, lengthen_drafts, verification_phrases, reuse_history: ablation switches.
        temperature, top_k, top_p, seed, eos_token_ids: as for every method (drafting stays greedy).
    """

    name = "ouroboros"

    def __init__(self, target: nn.Module, draft: nn.Module, *, num_draft_tokens: int = 4,
                 window: int = 15, phrase_length: int = 6, num_phrases: int = 3,
                 guess_set: int | None = None, draft_lookahead: bool = True,
                 lengthen_drafts: bool = True, verification_phrases: bool = True,
                 reuse_history: bool = True, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        if draft is None:
            raise ValueError("method 'ouroboros' needs a draft model; load a pair with a draft")
        self.num_draft_tokens = check_positive_int("num_draft_tokens", num_draft_tokens, "γ")
        guess_set = window if guess_set is None else guess_set
        check_lookahead_params(window, phrase_length, guess_set)
        if isinstance(num_phrases, bool) or not isinstance(num_phrases, int) or num_phrases < 0:
            raise ValueError(f"num_phrases (K)={num_phrases!r} is invalid: allowed is an integer "
                             ">= 0")
        self.target, self.phrase_length, self.num_phrases = target, phrase_length, num_phrases
        self.lengthen, self.mine, self.history = lengthen_drafts, verification_phrases, \
            reuse_history
        self.sampling = SamplingConfig(temperature, top_k, top_p)
        self.seed = seed
        self.pool = PhrasePool(guess_set)
        self.drafter = PhraseDrafter(draft, window, phrase_length, guess_set, self.pool,
                                     draft_lookahead, seed)
        self.eos_ids = stop_ids(target, eos_token_ids)

    def reset(self) -> None:
        """Forget the phrase history (e.g. after untimed warm-up runs)."""
        self.pool.reset()

    def _suffixes(self, key: int, room: int) -> list[tuple[int, ...]]:
        if not self.lengthen or self.num_phrases == 0 or room < 1:
            return []
        trimmed = [p[:room] for p in self.pool.get(key, self.num_phrases, newest=True)]
        return list(dict.fromkeys(trimmed))

    @torch.inference_mode()
    def stream(self, prompt_ids: torch.Tensor, max_new_tokens: int,
               clock: PhaseClock | None = None) -> Iterator[Step]:
        prompt = check_request(self.target, prompt_ids, max_new_tokens)
        generator = make_generator(self.seed, prompt.device)
        if not self.history:
            self.pool.reset()
        self.drafter.reset()
        cache, cached = new_cache(self.target), 0
        seq, produced = prompt.tolist(), 0
        while produced < max_new_tokens:
            remaining = max_new_tokens - produced
            gamma = min(self.num_draft_tokens, remaining - 1)
            # 1. phrase-level drafting with the draft model
            draft, forwards = [], 0
            if gamma:
                with phase(clock, "draft"):
                    draft, forwards = self.drafter.propose(seq, gamma)
            with phase(clock, "verify"):
                # 2. the tree: uncached committed chain, draft chain, K suffixes after the draft
                forest = Forest()
                c_node = forest.chain(seq[cached:], -1)[-1]
                draft_nodes = forest.chain(draft, c_node)
                anchor = draft_nodes[-1] if draft_nodes else c_node
                suffixes = self._suffixes(draft[-1] if draft else seq[-1], remaining - 1 - gamma)
                suffix_nodes, suffix_paths = forest.trie(suffixes, anchor)
                candidates = draft_nodes + suffix_nodes
                logits = tree_forward(self.target, forest.tokens, forest.parents, cache,
                                      [c_node] + candidates)                # [1+n, V]
                # 3. verify the whole tree
                local = {node: i for i, node in enumerate(candidates)}
                verdict = verify_tree([forest.tokens[n] for n in candidates],
                                      [local.get(forest.parents[n], -1) for n in candidates],
                                      logits, self.sampling, generator)
                path = [candidates[i] for i in verdict.path]
                accepted_draft = min(len(path), gamma)   # suffixes hang below the draft
                keep_cache_rows(cache, len(seq), [cached + n for n in path])
                self.drafter.commit(len(seq) + accepted_draft)
                # 4. phrases from verification (target argmax ids only)
                extras = self._learn(draft, accepted_draft, suffixes, suffix_paths, logits,
                                     local)
            emitted = [forest.tokens[n] for n in path] + [verdict.next_token]
            tokens, finished = truncate_at_eos(emitted, self.eos_ids)
            cached = len(seq) + len(path)
            seq += tokens
            produced += len(tokens)
            extras.update({"suffix_drafted": float(len(suffix_nodes)),
                           "suffix_accepted": float(len(path) - accepted_draft),
                           "pool_lookups": 1.0, "pool_hit": float(bool(suffixes)),
                           "pool_size_last": float(len(self.pool))})
            yield Step(tokens=tuple(tokens), drafted=len(candidates), accepted=len(path),
                       draft_forwards=forwards, extras=extras)
            if finished:
                return

    def _learn(self, draft: list[int], accepted_draft: int, suffixes: list[tuple[int, ...]],
               suffix_paths: list[list[int]], logits: torch.Tensor,
               local: dict[int, int]) -> dict[str, float]:
        """Mine the verification results into the pool; returns #Match for the statistics."""
        choice = logits.argmax(dim=-1).tolist()       # row 0: after c; row i+1: after node i
        gamma = len(draft)
        match = sum(draft[i] == choice[i] for i in range(gamma))   # #Match(d, v), Eq. 10
        if not self.mine:
            return {"match": float(match)}
        if accepted_draft < gamma:
            tail = draft[accepted_draft:]
            after = [choice[1 + i] for i in range(accepted_draft, gamma)]
            self.pool.insert_all(mine_misplaced_phrases(tail, after, self.phrase_length - 1))
        elif suffixes:
            bonus = choice[gamma]                      # the target's token after the whole draft
            key = draft[-1] if draft else None
            for phrase, nodes in zip(suffixes, suffix_paths):
                corrected = (bonus, *(choice[1 + local[n]] for n in nodes[:-1]))
                if key is not None and corrected != phrase:
                    self.pool.replace(key, phrase, corrected)
        return {"match": float(match)}
