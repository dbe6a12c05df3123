"""Lookahead decoding (Fu et al. 2023): a Jacobi window and an n-gram pool in one forward.

Each step feeds, in ONE forward of a single model (notes/phrase_drafting.md §1):
  * the uncached committed tokens (the whole prompt first, then usually just the current token c);
  * the lookahead branch: a window of W columns × (N−1) levels. Column j is a chain
    block0[j] → level1[j] → … → level_{N−2}[j] at consecutive positions; block0 = c + level0;
  * the verification branch: up to G pool n-grams keyed by c, merged into a trie hanging off c.
The mask and positions come from parent pointers (``decoding.tree``). The trie is verified with
``verify_tree`` (greedy, or EAGLE's point-mass sampling rule at temperature > 0, so sampling keeps the
target's distribution); the KV rows of the accepted path are kept, everything else is dropped.
The window then advances one Jacobi step (always greedy; it only proposes) and, once full, every
column yields an n-gram for the pool (harvest). Warm-up fills one level per step as in LADE.
Unlike the reference, a full match keeps the bonus token (N tokens per step at most).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from decoding.base import Step
from decoding.phrases import PhrasePool
from decoding.runtime import (check_positive_int, check_request, make_generator, new_cache, phase,
                              truncate_at_eos, stop_ids)
from decoding.sampling import SamplingConfig
from decoding.tree import keep_cache_rows, tree_forward, verify_tree

if TYPE_CHECKING:
    from torch import nn

    from decoding.clock import PhaseClock

GREEDY = SamplingConfig()


@dataclass
class Forest:
    """New tokens of one forward, as a forest over the cached prefix."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        return len(self.tokens) - 1

    def chain(self, tokens: Sequence[int], parent: int) -> list[int]:
        nodes = []
        for token in tokens:
            parent = self.add(token, parent)
            nodes.append(parent)
        return nodes

    def trie(self, phrases: Sequence[Sequence[int]], parent: int) -> tuple[list[int], list[list[int]]]:
        """Merge phrases sharing prefixes under ``parent``; returns (new nodes, nodes per phrase)."""
        index: dict[tuple[int, int], int] = {}
        created, paths = [], []
        for phrase in phrases:
            node, path = parent, []
            for token in phrase:
                if (node, token) not in index:
                    index[(node, token)] = self.add(token, node)
                    created.append(index[(node, token)])
                node = index[(node, token)]
                path.append(node)
            paths.append(path)
        return created, paths


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
    """

    def __init__(self, model: nn.Module, window: int, ngram: int, pool: PhrasePool,
                 guess_set: int, seed: int = 0) -> None:
        self.model, self.window, self.ngram, self.pool = model, window, ngram, pool
        self.guess_set, self.seed = guess_set, seed
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.cached = 0
        self.level0: list[int] | None = None      # block0 minus c
        self.upper: list[list[int]] = []          # levels 1..f
        self.rng = random.Random(self.seed)

    def rollback(self, num_valid: int) -> None:
        if self.cached > num_valid:
            keep_cache_rows(self.cache, num_valid, [])
            self.cached = num_valid

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
        forest = Forest()
        c_node = forest.chain(seq[self.cached:], -1)[-1]
        newest = self._window_branch(forest, seq, c_node) if self.window else []
        phrases = []
        if self.guess_set and max_tokens > 1:
            phrases = [p[: max_tokens - 1] for p in self.pool.get(seq[-1], self.guess_set)]
        candidates, _ = forest.trie(phrases, c_node)
        rows = [c_node] + candidates + newest
        logits = tree_forward(self.model, forest.tokens, forest.parents, self.cache, rows)
        local = {node: i for i, node in enumerate(candidates)}
        verdict = verify_tree([forest.tokens[n] for n in candidates],
                              [local.get(forest.parents[n], -1) for n in candidates],
                              logits[: 1 + len(candidates)], sampling, generator)
        path = [candidates[i] for i in verdict.path]
        keep_cache_rows(self.cache, len(seq), [self.cached + n for n in path])   # node n: slot cached+n
        self.cached = len(seq) + len(path)
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


class LookaheadDecoding:
    """Lookahead decoding with the target alone.

    Args:
        target: the causal LM.
        window: W, Jacobi window width.
        ngram: N, n-gram size (window levels N−1; up to N tokens committed per step).
        guess_set: G, pool capacity per key and the most candidates verified per step.
        temperature, top_k, top_p, seed, eos_token_ids: as for every method.
    """

    name = "lookahead"

    def __init__(self, target: nn.Module, *, window: int = 15, ngram: int = 5,
                 guess_set: int = 15, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        check_lookahead_params(window, ngram, guess_set)
        self.target, self.window, self.ngram, self.guess_set = target, window, ngram, guess_set
        self.sampling = SamplingConfig(temperature, top_k, top_p)
        self.seed = seed
        self.eos_ids = stop_ids(target, eos_token_ids)

    @torch.inference_mode()
    def stream(self, prompt_ids: torch.Tensor, max_new_tokens: int,
               clock: PhaseClock | None = None) -> Iterator[Step]:
        prompt = check_request(self.target, prompt_ids, max_new_tokens)
        generator = make_generator(self.seed, prompt.device)
        pool = PhrasePool(self.guess_set)                      # per generation, as LADE
        engine = LookaheadEngine(self.target, self.window, self.ngram, pool, self.guess_set,
                                 self.seed)
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
