"""Verification rules: exact enumeration of the output law, oracle values, wrong variants, Monte Carlo.

Toy models are context-dependent: the next-token distribution is a Dirichlet row seeded by a hash of
the prefix, some with exact zeros. One verification step is enumerated exactly (every draft with its
probability, every coin replaced by its closed-form probability, every final draw by its full
distribution), completed with target sampling to K = γ+1 tokens, and compared with the target's
K-token joint law. The law is computed with the implementation's own pure functions
(``token_acceptance``, ``normalized_residual``, ``bv_*``); the random wrappers are then checked
against that exact law by a chi-square test.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from decoding.base import Verdict
from tests.helpers.laws import ALPHA, ChiSquare, pooled_chi_square
from tests.helpers.mutations import mutated
from tests.helpers.toy import ToyModel, complete, target_joint
from decoding.verify import (block_verify, bv_log_weights, bv_residuals, bv_thresholds,
                             draft_distribution, greedy_match, token_acceptance, token_residuals,
                             token_verify)

SETTINGS = [(2, 1), (2, 2), (2, 3), (3, 1), (3, 2), (3, 3), (4, 1), (4, 2), (4, 3)]


def rows(model: ToyModel, context: tuple, draft: tuple, n: int) -> torch.Tensor:
    return torch.stack([model(context + draft[:i]) for i in range(n)])


def token_law(x, draft_probs, target_probs, residual=None):
    """Exact law of the emitted block given draft x under token verification: {block: prob}.

    ``residual`` replaces the implementation's residual rows (used for wrong variants only).
    """
    gamma, xt = len(x), torch.tensor(x)
    accept = token_acceptance(xt, draft_probs, target_probs).tolist()
    if residual is None:
        outcome = token_residuals(xt, draft_probs, target_probs)
    else:
        q_rows = draft_distribution(xt, draft_probs, target_probs.shape[-1], target_probs.dtype)
        outcome = torch.cat([residual(target_probs[:gamma], q_rows), target_probs[gamma:]])
    law, reach = {}, 1.0
    for n in range(gamma + 1):
        stop = reach * ((1.0 - accept[n]) if n < gamma else 1.0)
        for y, py in enumerate(outcome[n].tolist()):
            if stop * py > 0:
                law[tuple(x[:n]) + (y,)] = law.get(tuple(x[:n]) + (y,), 0.0) + stop * py
        if n < gamma:
            reach *= accept[n]
    return law


def block_law(x, draft_probs, target_probs, first_failure=False, scale_residual=True):
    """Exact law of the emitted block given draft x under block verification (or a wrong variant)."""
    gamma, xt = len(x), torch.tensor(x)
    weights = torch.exp(bv_log_weights(xt, draft_probs, target_probs))
    h = bv_thresholds(xt, draft_probs, target_probs, weights).tolist()
    residual_weights = weights if scale_residual else torch.ones_like(weights)
    outcome = bv_residuals(xt, draft_probs, target_probs, residual_weights)
    if first_failure:   # wrong: stop at the first failing position
        tau_probs = [np.prod(h[:i]) * ((1 - h[i]) if i < gamma else 1.0) for i in range(gamma + 1)]
    else:               # right: τ = the LAST passing position
        tau_probs = [np.prod([1 - hj for hj in h])] + [
            h[i - 1] * np.prod([1 - hj for hj in h[i:]]) for i in range(1, gamma + 1)]
    law = {}
    for tau, pt in enumerate(tau_probs):
        for y, py in enumerate(outcome[tau].tolist()):
            if pt * py > 0:
                key = tuple(x[:tau]) + (y,)
                law[key] = law.get(key, 0.0) + pt * py
    return law


def step_law(rule, target: ToyModel, draft: ToyModel, context: tuple, gamma: int,
             one_hot_draft: bool = False, **variant) -> dict[tuple, float]:
    """Exact law of one verification step, summed over every draft x ∈ V^γ."""
    total: dict[tuple, float] = {}
    for x in itertools.product(range(target.vocab), repeat=gamma):
        q_rows = rows(draft, context, x, gamma)
        if one_hot_draft:   # deterministic drafter: x is the argmax chain, q = δ_x
            if any(int(q_rows[i].argmax()) != x[i] for i in range(gamma)):
                continue
            prob_x, q_rows = 1.0, None
        else:
            prob_x = float(np.prod([float(q_rows[i, x[i]]) for i in range(gamma)]))
            if prob_x == 0:
                continue
        p_rows = rows(target, context, x, gamma + 1)
        for block, p in rule(x, q_rows, p_rows, **variant).items():
            total[block] = total.get(block, 0.0) + prob_x * p
    return total


def max_error(rule, target, draft, gamma, one_hot_draft=False, **variant) -> float:
    context = (0,)
    law = complete(step_law(rule, target, draft, context, gamma, one_hot_draft, **variant),
                   target, context, gamma + 1)
    joint = target_joint(target, context, gamma + 1)
    return max(abs(law.get(s, 0.0) - p) for s, p in joint.items())


@pytest.mark.parametrize("rule", [token_law, block_law], ids=["token", "block"])
@pytest.mark.parametrize("vocab,gamma", SETTINGS)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_rules_are_lossless_exactly(rule, vocab, gamma, sparse):
    target, draft = ToyModel(vocab, 1, sparse), ToyModel(vocab, 2, sparse)
    assert max_error(rule, target, draft, gamma) < 1e-9


@pytest.mark.parametrize("rule", [token_law, block_law], ids=["token", "block"])
@pytest.mark.parametrize("vocab,gamma", [(3, 2), (4, 3)])
def test_rules_are_lossless_for_point_mass_drafts(rule, vocab, gamma):
    target, draft = ToyModel(vocab, 3), ToyModel(vocab, 4)
    assert max_error(rule, target, draft, gamma, one_hot_draft=True) < 1e-9


def expected_accepted(rule, gamma: int, target, draft) -> float:
    law = step_law(rule, target, draft, (), gamma)
    # accepted = emitted length − 1
    return sum(p * (len(block) - 1) for block, p in law.items())


def test_paper_example_block_beats_token_verification():
    target = ToyModel(2, 0, constant=(1 / 3, 2 / 3))
    draft = ToyModel(2, 0, constant=(2 / 3, 1 / 3))
    assert expected_accepted(token_law, 2, target, draft) == pytest.approx(10 / 9, abs=1e-12)
    assert expected_accepted(block_law, 2, target, draft) == pytest.approx(11 / 9, abs=1e-12)


def test_block_dominates_token_verification_on_random_models():
    for seed in range(5):
        target, draft = ToyModel(3, 10 + seed), ToyModel(3, 20 + seed)
        assert expected_accepted(block_law, 3, target, draft) >= \
            expected_accepted(token_law, 3, target, draft) - 1e-12


def softmax_residual(target_rows, draft_rows):
    return torch.softmax(torch.clamp(target_rows - draft_rows, min=0.0), dim=-1)


@pytest.mark.parametrize("rule,variant", [
    (block_law, {"first_failure": True}),
    (block_law, {"scale_residual": False}),
    (token_law, {"residual": softmax_residual}),
], ids=["block-stop-at-first-failure", "block-residual-without-w", "token-softmax-residual"])
def test_wrong_variants_fail_the_same_check(rule, variant):
    errors = [max_error(rule, ToyModel(v, 1), ToyModel(v, 2), g, **variant)
              for v, g in [(2, 2), (3, 2), (3, 3)]]
    assert max(errors) > 1e-4, errors


def test_block_weights_closed_form_and_sigma_identity():
    target, draft, context = ToyModel(4, 5), ToyModel(4, 6), (1,)
    x = (2, 0, 3)
    q, p = rows(draft, context, x, 3), rows(target, context, x, 4)
    w = torch.exp(bv_log_weights(torch.tensor(x), q, p))
    ratio = [float(p[k, x[k]] / q[k, x[k]]) for k in range(3)]
    for i in range(4):
        suffix_products = [np.prod(ratio[j:i]) for j in range(i + 1)]
        assert float(w[i]) == pytest.approx(min(suffix_products), rel=1e-12)
    for i in range(1, 3):
        scaled = w[i] * p[i]
        rho = torch.clamp(scaled - q[i], min=0).sum()
        sigma = torch.clamp(q[i] - scaled, min=0).sum()
        assert float(sigma) == pytest.approx(float(rho + 1 - w[i]), abs=1e-12)


def test_greedy_match_accepts_prefix_and_emits_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 9.0]])   # argmax 1, 0, 2
    assert greedy_match(torch.tensor([1, 0]), logits) == Verdict(accepted=2, next_token=2)
    assert greedy_match(torch.tensor([1, 2]), logits) == Verdict(accepted=1, next_token=0)
    assert greedy_match(torch.tensor([0, 0]), logits) == Verdict(accepted=0, next_token=1)
    assert greedy_match(torch.tensor([1, 2]), logits).nodes == (0,)
    tie = torch.tensor([[2.0, 2.0, 0.0]])                                          # lowest index
    assert greedy_match(torch.tensor([], dtype=torch.long), tie).next_token == 0


def implementation_chi_square(rule, verify, point_mass: bool, draws: int = 12_000
                              ) -> tuple[ChiSquare, set]:
    """Chi-square of the torch implementation's emitted blocks against the exact law (rare blocks
    pooled), and the blocks it emitted that the law calls impossible."""
    target, draft, context, gamma = ToyModel(3, 7, sparse=True), ToyModel(3, 8), (2,), 2
    law = step_law(rule, target, draft, context, gamma, one_hot_draft=point_mass)
    generator = torch.Generator().manual_seed(1234)
    counts: dict[tuple, int] = {}
    for _ in range(draws):
        x = []
        for i in range(gamma):
            q = draft(context + tuple(x))
            x.append(int(q.argmax()) if point_mass else int(torch.multinomial(q, 1, generator=generator)))
        q_rows = None if point_mass else rows(draft, context, tuple(x), gamma)
        verdict = verify(torch.tensor(x), q_rows, rows(target, context, tuple(x), gamma + 1),
                         generator)
        block = tuple(x[: verdict.accepted]) + (verdict.next_token,)
        counts[block] = counts.get(block, 0) + 1
    return pooled_chi_square(counts, law), set(counts) - {b for b, p in law.items() if p > 0}


# moved from tests/test_study.py (its small correctness fixes)
def test_block_verify_with_a_zero_uniform_never_accepts_a_zero_probability_token(monkeypatch):
    import decoding.verify as verify
    real_rand = torch.rand
    monkeypatch.setattr(verify.torch, "rand", lambda *a, **k: torch.zeros_like(real_rand(*a, **k)))
    target = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [0.3, 0.3, 0.4]], dtype=torch.float64)
    draft = torch.tensor([[1.0, 0.0, 0.0], [0.3, 0.3, 0.4]], dtype=torch.float64)
    tokens = torch.tensor([0, 2])                       # p(token 0) = 0 at position 1
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        verdict = verify.block_verify(tokens, draft, target, gen)
        assert verdict.accepted == 0 and verdict.next_token != 0


@pytest.mark.parametrize("rule,verify", [(token_law, token_verify), (block_law, block_verify)],
                         ids=["token", "block"])
@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled-draft", "point-mass-draft"])
def test_sampling_implementation_matches_exact_law(rule, verify, point_mass):
    """Chi-square of the torch implementation's emitted blocks against the exact law."""
    result, impossible = implementation_chi_square(rule, verify, point_mass)
    assert not impossible, f"emitted impossible blocks {impossible}"
    assert result.pvalue > ALPHA, result


@pytest.mark.parametrize("rule,verify,mutation", [
    (token_law, token_verify, "token-coin-flipped"),
    (block_law, block_verify, "block-coin-flipped")], ids=["token", "block"])
def test_the_implementation_check_rejects_a_flipped_coin(rule, verify, mutation):
    """The random wrapper's coin mutated (a draft token passes with probability 1 − min(1, p/q);
    block verification's position i passes with 1 − h_i) while the exact law keeps the pure
    functions: the same chi-square rejects it at 3,000 draws (a quarter of the check's) with an
    estimated power of at least 0.99."""
    with mutated(mutation):
        result, _ = implementation_chi_square(rule, verify, False, draws=3000)
    assert result.pvalue < ALPHA and result.power() >= 0.99, result
