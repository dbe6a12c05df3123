"""Phrase drafting: tree masks, tree verification, the phrase pool, lookahead and Ouroboros."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from decoding import build_method, generate
from decoding.models import load_model
from decoding.ouroboros import mine_misplaced_phrases
from decoding.phrases import PhrasePool
from decoding.runtime import cache_argument, new_cache
from decoding.sampling import SamplingConfig
from decoding.lookahead import verify_point_masses as verify_tree
from decoding.tree import tree_forward, tree_inputs
from tests.conftest import tiny_pair, vanilla
from tests.helpers.laws import ALPHA, chi_square
from tests.helpers.mutations import mutated

REPEATS = [[7, 8, 9] * 6, [1, 2, 3, 4] * 5, [50, 60, 50, 60, 50, 61, 50, 60]]
PROMPTS = [list(range(3, 12)), [200, 13, 99]] + REPEATS
OURO = [dict(num_draft_tokens=4, window=4, phrase_length=3, num_phrases=3),
        dict(num_draft_tokens=7, window=6, phrase_length=5, num_phrases=2),
        dict(num_draft_tokens=3, window=5, phrase_length=2, num_phrases=1, guess_set=2),
        dict(num_draft_tokens=12, window=15, phrase_length=7, num_phrases=3)]
LOOK = [dict(window=4, ngram=3, guess_set=4), dict(window=5, ngram=2, guess_set=5),
        dict(window=7, ngram=5, guess_set=3), dict(window=15, ngram=5, guess_set=15)]


# ----------------------------------------------------------------------------------------------
# Tree forward and verification


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_tree_forward_matches_sequential_runs(family, attention):
    model = load_model({"kind": "tiny", "seed": 0, "family": family}).model
    model.config._attn_implementation = attention
    prefix, tokens, parents = [5, 6, 7, 8], [10, 11, 20, 21, 30, 31], [-1, 0, -1, 2, 0, 4]
    with torch.no_grad():
        cache = new_cache(model)
        model(torch.tensor([prefix]), **cache_argument(model, cache))
        logits = tree_forward(model, tokens, parents, cache, list(range(6)))
        paths = [[10], [10, 11], [20], [20, 21], [10, 30], [10, 30, 31]]
        for i, path in enumerate(paths):
            expected = model(torch.tensor([prefix + path])).logits[0, -1]
            assert torch.allclose(logits[i], expected, atol=1e-4), (family, attention, i)


def test_tree_mask_rows_see_prefix_and_ancestors_only():
    mask, positions = tree_inputs([-1, 0, -1, 2, 1], prefix_len=3, dtype=torch.float32,
                                  device=torch.device("cpu"))
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 1, 0, 0],
                       [1, 1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0, 1]]
    assert positions.tolist() == [3, 4, 3, 4, 5]


def test_greedy_tree_walk():
    logits = torch.full((5, 6), -5.0)
    for row, best in enumerate([1, 2, 4, 0, 3]):   # after root, node 0..3
        logits[row, best] = 5.0
    # root -> {0: token 1, 2: token 3}; node 0 -> {1: token 2}; node 1 -> {3: token 9}
    verdict = verify_tree([1, 2, 3, 9], [-1, 0, -1, 1], logits, SamplingConfig(), None)
    assert verdict.path == (0, 1) and verdict.next_token == 4


@pytest.mark.parametrize("mutation", [None, "residual-is-p"],
                         ids=["eagle-rule", "residual-is-p (must fail)"])
def test_tree_sampling_keeps_the_target_law_at_a_node(mutation):
    """Point-mass siblings verified with EAGLE's rule: the first emitted token follows p. The
    real rule mutated (a rejected sibling's round resamples from p, not from the residual) fails
    the same chi-square with an estimated power of at least 0.99 at these 2,000 draws (0.99 from
    ~290: docs/verification.md §0.4)."""
    logits = torch.log(torch.tensor([[0.35, 0.25, 0.2, 0.12, 0.08], [0.2] * 5, [0.2] * 5,
                                     [0.2] * 5]))
    tokens, parents = [1, 0, 3], [-1, -1, -1]
    generator = torch.Generator().manual_seed(7)
    counts = np.zeros(5)
    with mutated(mutation) if mutation else contextlib.nullcontext():
        for _ in range(2_000):
            verdict = verify_tree(tokens, parents, logits, SamplingConfig(temperature=1.0),
                                  generator)
            counts[tokens[verdict.path[0]] if verdict.path else verdict.next_token] += 1
    result = chi_square(counts, np.array([0.35, 0.25, 0.2, 0.12, 0.08]))
    if mutation:
        assert result.pvalue < ALPHA and result.power() >= 0.99, result
    else:
        assert result.pvalue > ALPHA, result


# ----------------------------------------------------------------------------------------------
# The pool


def test_pool_capacity_refresh_and_eviction():
    pool = PhrasePool(capacity=2)
    pool.insert(5, (1, 2))
    pool.insert(5, (3, 4))
    pool.insert(5, (1, 2))                      # refresh: (1, 2) becomes the newest
    pool.insert(5, (7, 8))                      # evicts the oldest, (3, 4)
    assert pool.get(5) == [(1, 2), (7, 8)] and pool.get(5, 1, newest=True) == [(7, 8)]
    pool.replace(5, (1, 2), (1, 9))
    assert pool.get(5) == [(7, 8), (1, 9)] and len(pool) == 2 and pool.get(6) == []
    assert pool.hit_rate == pytest.approx(3 / 4)
    pool.reset()
    assert len(pool) == 0
    with pytest.raises(ValueError, match=r"pool capacity \(G\)=0 is invalid"):
        PhrasePool(0)


def test_mining_misplaced_phrases_follows_figure_4():
    # the draft shifted by one: the target keeps predicting what the draft wrote one step later
    tail = [4, 5, 6, 8, 9, 10]
    after = [6, 6, 8, 9, 10, 11]                # target's next token after each tail token
    # key 4: 5 != 6 stops after one token; key 5: 6, then 8, then 9 agree -> (6, 8, 9); ...
    assert mine_misplaced_phrases(tail, after, 3) == [(5, (6, 8, 9)), (6, (8, 9, 10)),
                                                      (8, (9, 10, 11))]
    assert mine_misplaced_phrases(tail, after, 5) == [(5, (6, 8, 9, 10, 11))]
    assert mine_misplaced_phrases(tail, after, 6) == []       # never reaches full length


# ----------------------------------------------------------------------------------------------
# Greedy losslessness (fp32) with EOS and budget inside phrases


@pytest.mark.parametrize("kind", ["same", "related", "unrelated"])
@pytest.mark.parametrize("config", range(len(OURO)))
def test_ouroboros_greedy_equals_vanilla(kind, config):
    pair = tiny_pair(kind)
    method = build_method("ouroboros", pair, **OURO[config])
    for prompt in PROMPTS:                      # the pool carries history across these prompts
        assert generate(method, prompt, 48).tokens == vanilla(pair, prompt, 48)


@pytest.mark.parametrize("kind", ["same", "related"])
@pytest.mark.parametrize("config", range(len(LOOK)))
def test_lookahead_greedy_equals_vanilla(kind, config):
    pair = tiny_pair(kind)
    method = build_method("lookahead", pair, **LOOK[config])
    for prompt in PROMPTS:
        assert generate(method, prompt, 48).tokens == vanilla(pair, prompt, 48)


@pytest.mark.parametrize("name,kw", [("ouroboros", OURO[0]), ("lookahead", LOOK[0])])
def test_eos_and_budget_inside_a_phrase(name, kw):
    """With draft == target whole phrases are accepted, so EOS and the budget fall inside them."""
    pair = tiny_pair("same")
    prompt = REPEATS[0]
    reference = vanilla(pair, prompt, 40)
    steps = list(build_method(name, pair, **kw).stream(torch.tensor(prompt), 40))
    assert max(len(s.tokens) for s in steps) > 2, "phrases must be accepted for this test"
    for budget in range(1, 41):
        assert generate(build_method(name, pair, **kw), prompt, budget).tokens == \
            reference[:budget]
    for position in (3, 10, 17, 25):
        eos = reference[position]
        first = reference.index(eos)
        stopped = generate(build_method(name, pair, eos_token_ids=[eos], **kw), prompt, 40)
        assert stopped.tokens == reference[: first + 1]


# ----------------------------------------------------------------------------------------------
# Statistics and ablation switches


def ouroboros_stats(pair, prompts, **kw):
    method = build_method("ouroboros", pair, **{**OURO[0], **kw})
    return method, [generate(method, p, 40).stats for p in prompts]


def test_phrase_statistics_are_consistent():
    _, stats = ouroboros_stats(tiny_pair("related"), PROMPTS)
    for s in stats:
        assert s.accepted <= s.drafted and s.new_tokens >= s.steps
        assert s.extras["suffix_accepted"] <= s.extras["suffix_drafted"]
        assert 0 <= s.extras["pool_hit"] <= s.extras["pool_lookups"] == s.steps
        assert s.extras["match"] <= s.drafted


def test_phrase_drafting_saves_draft_forwards():
    pair = tiny_pair("same")
    _, on = ouroboros_stats(pair, REPEATS)
    _, off = ouroboros_stats(pair, REPEATS, draft_lookahead=False)
    drafted_on = sum(s.drafted - s.extras["suffix_drafted"] for s in on)
    assert sum(s.draft_forwards for s in on) < drafted_on
    assert sum(s.draft_forwards for s in off) == sum(s.drafted - s.extras["suffix_drafted"]
                                                     for s in off)


def test_lengthening_switch_changes_what_is_verified():
    pair = tiny_pair("same")
    _, on = ouroboros_stats(pair, REPEATS)
    _, off = ouroboros_stats(pair, REPEATS, lengthen_drafts=False)
    assert sum(s.extras["suffix_drafted"] for s in on) > 0
    assert sum(s.extras["suffix_accepted"] for s in on) > 0
    assert sum(s.extras["suffix_drafted"] for s in off) == 0
    assert sum(s.steps for s in on) < sum(s.steps for s in off)


def test_verification_phrases_switch_feeds_the_pool():
    pair = tiny_pair("related")                  # rejections happen
    kw = dict(draft_lookahead=False, reuse_history=True)     # no window harvest: mining only
    mined, _ = ouroboros_stats(pair, PROMPTS, **kw)
    silent, _ = ouroboros_stats(pair, PROMPTS, verification_phrases=False, **kw)
    assert len(mined.pool) > 0 and len(silent.pool) == 0


def test_history_switch_keeps_or_clears_the_pool_across_prompts():
    pair = tiny_pair("same")
    keep, keep_stats = ouroboros_stats(pair, [REPEATS[0], REPEATS[0]])
    fresh, fresh_stats = ouroboros_stats(pair, [REPEATS[0], REPEATS[0]], reuse_history=False)
    single, _ = ouroboros_stats(pair, [REPEATS[0]], reuse_history=False)
    assert len(fresh.pool) == len(single.pool) < len(keep.pool)
    assert keep_stats[1].extras["pool_hit"] > fresh_stats[1].extras["pool_hit"]
    keep.reset()
    assert len(keep.pool) == 0


@pytest.mark.parametrize("bad,match", [
    (dict(window=0), r"window \(W\)=0 is invalid"),
    (dict(phrase_length=1), r"ngram \(N\)=1 is invalid: allowed is an integer >= 2"),
    (dict(num_phrases=-1), r"num_phrases \(K\)=-1 is invalid"),
    (dict(guess_set=0), r"guess_set \(G\)=0 is invalid"),
])
def test_bad_ouroboros_settings_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        build_method("ouroboros", tiny_pair("same"), **bad)


def test_bad_lookahead_settings_are_rejected():
    with pytest.raises(ValueError, match=r"ngram \(N\)=1 is invalid"):
        build_method("lookahead", tiny_pair("same"), ngram=1)
