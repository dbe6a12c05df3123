"""Acceptance replay (decoding.replay) equals the loop's own per-step acceptance at T = 0: every
replayable method, on tiny fp32 models and on the embedded default (its int8-dynamic self-draft
included) exactly; a trajectory with one wrong token does not; drafters that read the target's
logits or states are refused."""

from __future__ import annotations

import pytest
import torch

from decoding import build_method
from decoding.replay import (
    chain_steps,
    draft_agreement,
    drafter_steps,
    replayable,
    trajectory,
)

PROMPTS = [[5, 9, 17, 5, 9, 23, 41, 5, 9], list(range(3, 40, 3)) + [3, 6, 9]]
MAX_NEW = 40


def loop_steps(method, prompt, max_new=MAX_NEW):
    """(accepted, drafted, committed tokens, level sizes) of every step the loop makes."""
    return [(s.accepted, s.drafted, len(s.tokens), s.level_sizes)
            for s in method.stream(torch.tensor(prompt), max_new)]


def replayed(steps):
    return [(s.accepted, s.drafted, s.committed, s.level_sizes) for s in steps]


@pytest.mark.parametrize("kind", ["related", "unrelated", "same"])
def test_a_draft_model_chain_replays_every_gamma_from_one_teacher_forced_pass(tiny_pairs, kind):
    """One vanilla trajectory and one draft pass give the loop's accepted length at every step
    for γ 1–6, token and block verification alike (at T = 0 both accept the longest match)."""
    pair = tiny_pairs[kind]
    for prompt in PROMPTS:
        tokens = trajectory(pair.target, torch.tensor(prompt), MAX_NEW)
        agreement = draft_agreement(pair.draft, torch.tensor(prompt), tokens)
        for gamma in range(1, 7):
            for name in ("speculative", "block"):
                method = build_method(name, pair, num_draft_tokens=gamma)
                steps = chain_steps(agreement, tokens, len(prompt), gamma, MAX_NEW,
                                    tuple(method.eos_ids))
                assert replayed(steps) == loop_steps(method, prompt), (kind, gamma, name)
        if kind == "same":
            assert all(agreement)


def test_prompt_lookup_replays_exactly_chains_and_tries(tiny_pairs):
    pair = tiny_pairs["same"]
    settings = [dict(min_ngram=1, max_ngram=3, num_draft_tokens=10, num_matches=1),
                dict(min_ngram=2, max_ngram=2, num_draft_tokens=4, num_matches=1),
                dict(min_ngram=1, max_ngram=3, num_draft_tokens=5, num_matches=3)]
    tried_trees = 0
    for prompt in PROMPTS:
        tokens = trajectory(pair.target, torch.tensor(prompt), MAX_NEW)
        for params in settings:
            method = build_method("prompt_lookup", pair, **params)
            steps = drafter_steps(method.drafter, torch.tensor(prompt), tokens, MAX_NEW,
                                  tuple(method.eos_ids))
            assert replayed(steps) == loop_steps(method, prompt), params
            tried_trees += sum(s.level_sizes is not None for s in steps)
    assert tried_trees > 0                      # the trie path was exercised


def test_a_trajectory_with_one_wrong_token_does_not_replay_the_loop(tiny_pairs):
    """The comparison can fail: replaying a trajectory whose 10th token is changed gives other
    steps than the loop (a drafter fed one wrong token)."""
    pair = tiny_pairs["related"]
    prompt = PROMPTS[0]
    tokens = trajectory(pair.target, torch.tensor(prompt), MAX_NEW)
    wrong = list(tokens)
    wrong[9] = (wrong[9] + 1) % 256
    method = build_method("speculative", pair, num_draft_tokens=4)
    agreement = draft_agreement(pair.draft, torch.tensor(prompt), wrong)
    assert replayed(chain_steps(agreement, wrong, len(prompt), 4, MAX_NEW)) != \
        loop_steps(method, prompt)
    lookup = build_method("prompt_lookup", pair)
    assert replayed(drafter_steps(lookup.drafter, torch.tensor(prompt), wrong, MAX_NEW)) != \
        loop_steps(lookup, prompt)


def test_a_short_trajectory_is_refused():
    with pytest.raises(ValueError, match="needs a trajectory that long"):
        chain_steps([True] * 3, [1, 2, 3], 4, 2, 8)


REPLAYABLE = [("speculative", {"num_draft_tokens": 1}), ("speculative", {"num_draft_tokens": 5}),
              ("block", {"num_draft_tokens": 3}), ("tree", {}),
              ("tree", {"shape": "3-2-1"}),
              ("prompt_lookup", {"num_matches": 3, "num_draft_tokens": 4})]


@pytest.mark.parametrize("name,params", REPLAYABLE)
def test_the_real_drafter_replays_the_loop_exactly(tiny_pairs, name, params):
    """drafter_steps: the method's own drafter along the trajectory, no target forward."""
    pair = tiny_pairs["related"]
    for prompt in PROMPTS:
        tokens = trajectory(pair.target, torch.tensor(prompt), MAX_NEW)
        method = build_method(name, pair, **params)
        steps = drafter_steps(method.drafter, torch.tensor(prompt), tokens, MAX_NEW,
                              tuple(method.eos_ids))
        assert replayed(steps) == loop_steps(method, prompt), (name, params)
        if name != "prompt_lookup":
            assert sum(s.draft_forwards for s in steps) > 0


def test_drafters_that_read_the_target_are_not_replayable(tiny_pairs):
    pair = tiny_pairs["related"]
    assert replayable(build_method("speculative", pair).drafter)
    for name in ("ouroboros", "eagle"):
        drafter = build_method(name, pair).drafter
        assert not replayable(drafter)
        with pytest.raises(ValueError, match="not replayable"):
            drafter_steps(drafter, torch.tensor(PROMPTS[0]), [1] * 8, 8)


@pytest.mark.real_model
def test_replay_is_exact_on_the_embedded_default(default_pair, gsm8k_questions):
    """SmolLM2-135M fp32 with its int8-dynamic self-draft (whose numerics depend on each
    forward's rows: a one-pass teacher-forced draft differs from the loop at many steps) and
    prompt lookup: the replayed steps are the loop's, step for step."""
    from decoding.api import encode_prompt
    prompt = torch.tensor(encode_prompt(default_pair.tokenizer, gsm8k_questions[0]))
    tokens = trajectory(default_pair.target, prompt, 48)
    for name, params in (("speculative", {"num_draft_tokens": 3}), ("prompt_lookup", {})):
        method = build_method(name, default_pair, **params)
        steps = drafter_steps(method.drafter, prompt, tokens, 48, tuple(method.eos_ids))
        assert replayed(steps) == loop_steps(method, prompt.tolist(), 48), name


@pytest.mark.parametrize("name,params", [("speculative", {"num_draft_tokens": 4}), ("tree", {}),
                                         ("prompt_lookup", {})])
def test_replay_stops_where_the_loop_stops_at_an_eos(tiny_pairs, name, params):
    """The tiny models declare no EOS: here one is named (the trajectory's 16th token), and both
    the loop and the replay stop at its first committed occurrence, inside a step or not."""
    pair = tiny_pairs["related"]
    prompt = PROMPTS[1]
    tokens = trajectory(pair.target, torch.tensor(prompt), MAX_NEW)
    eos = tokens[15]
    method = build_method(name, pair, eos_token_ids=[eos], **params)
    steps = drafter_steps(method.drafter, torch.tensor(prompt), tokens, MAX_NEW, (eos,))
    loop = loop_steps(method, prompt)
    assert replayed(steps) == loop and sum(s.committed for s in steps) == tokens.index(eos) + 1
