"""Lookahead decoding (Fu et al. 2023): a Jacobi window and an n-gram pool in one forward.

Each step feeds, in ONE forward of a single model (docs/phrase_drafting.md §1):
  * the uncached committed tokens (the whole prompt first, then usually just the current token c);
  * the lookahead branch: a window of W columns × (N−1) levels. Column j is a chain
    block0[j] → level1[j] → … → level_{N−2}[j] at consecutive positions; block0 = c + level0;
  * the verification branch: up to G pool n-grams keyed by c, merged into a trie hanging off c.
The mask and positions come from parent pointers (``decoding.tree``). The trie is verified with
``verify_point_masses`` (greedy, or EAGLE's point-mass sampling rule at temperature > 0, so sampling
keeps the target's distribution); the KV rows of the accepted path are kept, everything else is
dropped.
The window then advances one Jacobi step (always greedy; it only proposes) and, once full, every
column yields an n-gram for the pool (harvest). Warm-up fills one level per step as in LADE.
Unlike the reference, a full match keeps the bonus token (N tokens per step at most).

Why lookahead keeps its own loop instead of ``decoding.loop``: its draft (the trie of pool n-grams)
is not the only thing in the verification forward. The same forward also carries the Jacobi window,
whose outputs are not verified but feed the next window and the pool, and the window's KV rows
must be dropped while the accepted path's are kept. Expressing that through the Drafter seam would
need the drafter to inject non-draft nodes into the target's forward and read their logits back,
i.e. a second, lookahead-only interface; the engine below does it in ~40 lines instead and yields
the same ``Step``s. Ouroboros, whose draft model runs this engine, does use the shared loop.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from decoding.base import DecodingMethod, Step, Verdict
from decoding.cached_model import CachedModel
from decoding.phrases import PhrasePool
from decoding.reserved_cache import RESERVE_SLACK
from decoding.runtime import (
    check_positive_int,
    check_request,
    make_generator,
    phase,
    truncate_at_eos,
)
from decoding.sampling import SamplingConfig, logits_to_probs
from decoding.tree import Forest
from decoding.verify import greedy_tree, tree_verify

if TYPE_CHECKING:
    from torch import nn

    from decoding.clock import PhaseClock

GREEDY = SamplingConfig()


def verify_point_masses(tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor,
                        sampling: SamplingConfig, generator: torch.Generator | None) -> Verdict:
    """Verify a trie of point-mass candidates (no duplicate siblings): greedy or EAGLE's rule.

    ``logits`` [n+1, V]: row 0 after the root, row i+1 after node i.
    """
    identity = list(range(len(tokens)))
    if sampling.greedy:
        return greedy_tree(tokens, parents, identity, logits)
    return tree_verify(tokens, parents, identity, None, logits_to_probs(logits, sampling), False,
                       generator)


@dataclass(frozen=True)
class Advance:
    """One lookahead step: committed ``tokens`` (accepted path + next token) and counters."""

    tokens: list[int]
    drafted: int       # candidate (trie) tokens verified
    accepted: int      # of them accepted


class LookaheadEngine:
    """Window + pool + KV cache of one model ("model with undo"); greedy or sampled verification.

    Args:
        model: causal LM.
        window: W, columns of the Jacobi window (0 disables the lookahead branch).
        ngram: N, n-gram size; the window has N−1 levels and pool phrases N−1 tokens after the key.
        pool: the n-gram pool (shared with Ouroboros' target-side phrase logic when given).
        guess_set: G, the most pool n-grams verified per step (0 disables the verification branch).
        seed: seeds the private RNG that fills the initial window from prompt tokens.
        capacity: KV-cache rows to reserve (0: grow as needed; ``decoding.reserved_cache``).
    """

    def __init__(self, model: nn.Module, window: int, ngram: int, pool: PhrasePool,
                 guess_set: int, seed: int = 0, capacity: int = 0) -> None:
        self.model, self.window, self.ngram = CachedModel(model, capacity), window, ngram
        self.pool = pool
        self.guess_set, self.seed = guess_set, seed
        self.reset()

    def reset(self) -> None:
        self.model.reset()
        self.level0: list[int] | None = None      # block0 minus c
        self.upper: list[list[int]] = []          # levels 1..f
        self.rng = random.Random(self.seed)

    def rollback(self, num_valid: int) -> None:
        self.model.rollback(num_valid)

    def _window_branch(self, forest: Forest, seq: Sequence[int], c_node: int) -> list[int]:
        """Add block0 + levels to the forest; returns the nodes whose predictions form a new level."""
        if self.level0 is None:
            width = self.window + self.ngram - 3                 # shrinks to W−1 after warm-up
            self.level0 = [self.rng.choice(list(seq)) for _ in range(width)]
        previous = [c_node] + forest.chain(self.level0, c_node)
        for level in self.upper:
            previous = [forest.add(t, previous[j]) for j, t in enumerate(level)]
        return previous

    def _advance_window(self, block0: list[int], new: list[int]) -> None:
        if len(self.upper) < self.ngram - 2:                     # warm-up: grow one level
            self.level0 = self.level0[1:]
            self.upper = [level[1:] for level in self.upper] + [new[1:]]
            return
        for j in range(self.window):                             # harvest every column
            self.pool.insert(block0[j], [level[j] for level in self.upper] + [new[j]])
        if self.upper:
            self.level0, self.upper = self.upper[0][1:], self.upper[1:] + [new]
        else:
            self.level0 = new[1:]

    def advance(self, seq: Sequence[int], max_tokens: int, sampling: SamplingConfig = GREEDY,
                generator: torch.Generator | None = None) -> Advance:
        """One forward after committed ``seq``; commits 1..max_tokens tokens."""
        forest, cached = Forest(), self.model.length
        c_node = forest.chain(seq[cached:], -1)[-1]
        newest = self._window_branch(forest, seq, c_node) if self.window else []
        phrases = []
        if self.guess_set and max_tokens > 1:
            phrases = [p[: max_tokens - 1] for p in self.pool.get(seq[-1], self.guess_set)]
        candidates, _ = forest.trie(phrases, c_node)
        rows = [c_node] + candidates + newest
        logits = self.model.forward_forest(forest.tokens, forest.parents, rows)
        local = {node: i for i, node in enumerate(candidates)}
        verdict = verify_point_masses([forest.tokens[n] for n in candidates],
                                      [local.get(forest.parents[n], -1) for n in candidates],
                                      logits[: 1 + len(candidates)], sampling, generator)
        path = [candidates[i] for i in verdict.nodes]
        self.model.keep(len(seq), [cached + n for n in path])       # node n sits at cached + n
        if self.window:
            new = logits[1 + len(candidates):].argmax(dim=-1).tolist()
            block0 = [seq[-1]] + self.level0
            self._advance_window(block0, new)
        return Advance([forest.tokens[n] for n in path] + [verdict.next_token],
                       drafted=len(candidates), accepted=len(path))


def check_lookahead_params(window: int, ngram: int, guess_set: int) -> None:
    check_positive_int("window", window, "W")
    if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 2:
        raise ValueError(f"ngram (N)={ngram!r} is invalid: allowed is an integer >= 2")
    check_positive_int("guess_set", guess_set, "G")


class LookaheadDecoding(DecodingMethod):
    """Lookahead decoding with the target alone.

    Args:
        target: the causal LM.
        window: W, Jacobi window width.
        ngram: N, n-gram size (window levels N−1; up to N tokens committed per step).
        guess_set: G, pool capacity per key and the most candidates verified per step.
        temperature, top_k, top_p, seed, eos_token_ids: as for every method.
    """

    name = "lookahead"
    replayable = False            # no drafter: its Jacobi window is its own
    traceable = True              # target forwards only
    keeps_history = False
    supports_compiled = False     # its own loop and cache arithmetic
    head_version = None
    draft_size_params = ("window", "ngram")     # W × N orders its window's cost

    def __init__(self, target: nn.Module, *, window: int = 15, ngram: int = 5,
                 guess_set: int = 15, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        check_lookahead_params(window, ngram, guess_set)
        super().__init__(target, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         eos_token_ids=eos_token_ids)
        self.window, self.ngram, self.guess_set = window, ngram, guess_set

    @torch.inference_mode()
    def stream(self, prompt_ids: torch.Tensor, max_new_tokens: int,
               clock: PhaseClock | None = None) -> Iterator[Step]:
        prompt = check_request(self.target, prompt_ids, max_new_tokens)
        generator = make_generator(self.seed, prompt.device)
        pool = PhrasePool(self.guess_set)                      # per generation, as LADE
        engine = LookaheadEngine(self.target, self.window, self.ngram, pool, self.guess_set,
                                 self.seed, len(prompt) + max_new_tokens + RESERVE_SLACK)
        seq, produced = prompt.tolist(), 0
        while produced < max_new_tokens:
            with phase(clock, "verify"):
                step = engine.advance(seq, max_new_tokens - produced, self.sampling, generator)
            tokens, finished = truncate_at_eos(step.tokens, self.eos_ids)
            seq += tokens
            produced += len(tokens)
            yield Step(tokens=tuple(tokens), drafted=step.drafted, accepted=step.accepted,
                       extras={"pool_size_last": float(len(pool)),
                               "pool_lookups": 1.0, "pool_hit": float(step.drafted > 0)})
            if finished:
                return
