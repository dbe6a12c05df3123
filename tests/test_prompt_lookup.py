"""Prompt lookup decoding: the n-gram search, greedy equality with drafts accepted, EOS and budget
inside a draft, the sampling law with drafts from the first step, and the embedded default.

Generic conformance (greedy = vanilla, exact max_new_tokens, EOS, seeds) comes from
``tests/test_methods.py`` through ``conf/method/prompt_lookup.yaml``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding import build_method, generate
from decoding.prompt_lookup import find_continuations
from tests.conftest import tiny_pair, vanilla
from tests.helpers import law_cases
from tests.helpers.laws import ALPHA

SETTINGS = [{}, {"num_matches": 3}, {"max_ngram": 1, "num_draft_tokens": 3},
            {"max_ngram": 4, "min_ngram": 2, "num_draft_tokens": 16}]


@pytest.fixture(scope="module")
def looping():
    """Tiny targets whose greedy output repeats itself: lookups hit, partly (12) or fully (32)."""
    return {12: tiny_pair("related", vocab_size=12), 32: tiny_pair("related", vocab_size=32)}


def test_the_latest_match_of_the_longest_ngram_comes_first():
    ids = torch.tensor([1, 2, 3, 4, 1, 2, 5, 6, 1, 2])
    assert find_continuations(ids, 1, 3, 3, 1) == [[5, 6, 1]]        # [1, 2] matched last at 4
    assert find_continuations(ids, 1, 3, 3, 3) == [[5, 6, 1], [3, 4, 1]]
    assert find_continuations(ids, 3, 3, 3, 3) == []                 # [6, 1, 2] never seen
    assert find_continuations(torch.tensor([7, 7, 7]), 1, 2, 5, 1) == [[7]]   # overlap allowed
    assert find_continuations(torch.tensor([5]), 1, 3, 4, 2) == []
    assert find_continuations(torch.tensor([9, 8, 9]), 1, 1, 4, 1) == [[8, 9]]
    # [2, 1] (after the latest 1, cut by the end) is a prefix of [2, 1, 2] (after the first 1):
    # one trie path, so it does not take a slot of num_matches
    assert find_continuations(torch.tensor([1, 2, 1, 2, 1]), 1, 1, 3, 2) == [[2, 1, 2]]
    assert find_continuations(torch.tensor([1, 2, 1, 2, 1, 3, 1]), 1, 1, 3, 3) == \
        [[3, 1], [2, 1, 3], [2, 1, 2]]


@pytest.mark.parametrize("vocab", [12, 32])
def test_greedy_equals_vanilla_and_drafts_are_accepted(looping, vocab):
    pair = looping[vocab]
    accepted = 0
    for kw in SETTINGS:
        m = build_method("prompt_lookup", pair, **kw)
        for prompt in ([3, 4, 5], [1, 2, 3, 4, 5, 6, 7]):
            out = generate(m, prompt, 40)
            assert out.tokens == vanilla(pair, prompt, 40), kw
            assert out.stats.draft_forwards == 0
            accepted += out.stats.accepted
    assert accepted > 20


def test_a_trie_of_several_matches_accepts_at_least_as_much(looping):
    pair = looping[12]
    chain = generate(build_method("prompt_lookup", pair), [1, 2, 3, 4, 5, 6, 7], 40).stats
    trie = generate(build_method("prompt_lookup", pair, num_matches=3), [1, 2, 3, 4, 5, 6, 7],
                    40).stats
    assert trie.steps <= chain.steps and trie.extras["tree_size"] > 0


def test_eos_and_budget_inside_a_draft(looping):
    pair = looping[12]
    prompt = [1, 2, 3, 4, 5, 6, 7]
    free = vanilla(pair, prompt, 40, eos_token_ids=[])
    steps = list(build_method("prompt_lookup", pair, eos_token_ids=[])
                 .stream(torch.tensor(prompt), 40))
    starts = np.cumsum([0] + [len(s.tokens) for s in steps])
    long = [(int(starts[i]), s) for i, s in enumerate(steps) if s.accepted >= 3]
    assert long, "no step committed 3 draft tokens"
    start = long[0][0]
    for n in (start + 1, start + 2, start + 3):          # the budget ends inside that draft
        m = build_method("prompt_lookup", pair, eos_token_ids=[])
        assert generate(m, prompt, n).tokens == free[:n]
    inside = 0
    for prompt in ([3, 4, 5], [1, 1, 2, 2, 3, 3]):      # every token as EOS, in turn
        free = vanilla(pair, prompt, 40, eos_token_ids=[])
        for eos in sorted(set(free)):
            stopped = list(build_method("prompt_lookup", pair, eos_token_ids=[eos])
                           .stream(torch.tensor(prompt), 40))
            tokens = tuple(t for step in stopped for t in step.tokens)
            assert tokens == free[: free.index(eos) + 1]
            inside += len(stopped[-1].tokens) <= stopped[-1].accepted   # cut in accepted drafts
    assert inside >= 2


CASES = law_cases.prompt_lookup_cases()


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_sampled_tokens_follow_the_target_law(case):
    """The prompt ends in a repeated n-gram ([4, 0] -> drafts [3, 4] and [5, 4], whose first
    tokens the target gives 0.40 and 0.47 at T = 0.9, top-k 4), so the first step of every draw
    verifies a draft (a chain or a trie of point masses) that is accepted and rejected often."""
    assert law_cases.run(case).pvalue > ALPHA


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_law_check_rejects_the_mutated_rule_at_the_same_draws(case):
    """A rejected point mass resampled from p instead of the residual (the token just rejected
    can come back) must fail at the same 800 draws, with an estimated power of at least 0.99."""
    result = law_cases.run(case, case.mutation)
    assert result.pvalue < ALPHA and result.power() >= 0.99, result


def test_bad_settings_are_named(looping):
    pair = looping[12]
    with pytest.raises(ValueError, match=r"min_ngram=3 > max_ngram=2 is invalid"):
        build_method("prompt_lookup", pair, min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match=r"num_matches=0 is invalid"):
        build_method("prompt_lookup", pair, num_matches=0)


@pytest.mark.real_model
def test_extractive_prompt_on_the_default_model(default_pair):
    """A summary of a short passage copies from it: drafts are accepted, tokens equal vanilla."""
    from decoding import encode_prompt
    text = ("Repeat the following sentence exactly: The quick brown fox jumps over the lazy dog "
            "near the river bank on a sunny afternoon in early spring.")
    prompt = encode_prompt(default_pair.tokenizer, text)
    out = generate(build_method("prompt_lookup", default_pair, num_matches=2), prompt, 24)
    assert out.tokens == vanilla(default_pair, prompt, 24) and out.stats.accepted >= 8
