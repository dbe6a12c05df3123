"""Conformance of every decoding method on tiny random fp32 models.

Methods and their default hyperparameters come from ``conf/method/*.yaml``, so a new method is put
under every check here automatically: greedy losslessness (tokens identical to vanilla), exact
``max_new_tokens``, EOS, seeded reproducibility, statistics that add up, bad input, and an
end-to-end chi-square of sampled tokens against the target's exact law, which must also reject a
mutant of the method's real rule at the same draws (tests/helpers/law_cases.py). Chain-draft methods
(subclasses of ``SpeculativeDecoding``) are also checked at γ ∈ {1, 2, 4, 8, 16} and at the
acceptance extremes. Each YAML's ``test_params`` is its small CPU setting for the sampling test.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from decoding import METHODS, build_method, generate
from decoding.speculative import SpeculativeDecoding
from tests.conftest import tiny_pair
from tests.conftest import vanilla as vanilla_tokens
from tests.helpers import law_cases
from tests.helpers.laws import ALPHA
from tests.helpers.methods import ALL, CONFIGS, DEFAULTS, PROMPTS, method

# chain drafts from a draft model, γ tokens
DRAFT_METHODS = [n for n in ALL if n in METHODS and issubclass(METHODS[n], SpeculativeDecoding)]
# methods that take γ (eagle3's num_draft_tokens is SGLang's verify budget: tests/test_eagle3.py)
GAMMA_METHODS = [n for n in ALL if "num_draft_tokens" in DEFAULTS[n] and n != "eagle3"]
# The chi-square cases (tests/helpers/law_cases.py): every lossless method at each sampling its YAML
# lists in ``test_samplings`` (default: t1, topk, topp; tree methods narrow it, their rules being
# checked exactly in tests/test_trees.py). Lossy methods (``lossless: false``, MJSD) change the law
# by design: tests/test_mjsd.py checks their rule exactly instead, and the tuner scores their quality.
LAW_CASES = law_cases.method_cases()
MUTANT_CASES = [case for case in LAW_CASES if case.mutation]
GAMMAS = [1, 2, 4, 8, 16]


def test_every_registered_method_has_a_config():
    assert sorted(METHODS) == ALL
    assert all(isinstance(cfg.get("lossless"), bool) for cfg in CONFIGS.values())


@pytest.mark.parametrize("method", DRAFT_METHODS)
@pytest.mark.parametrize("kind", ["same", "unrelated", "related"])
@pytest.mark.parametrize("gamma", GAMMAS)
def test_greedy_tokens_equal_vanilla(tiny_pairs, method, kind, gamma):
    pair = tiny_pairs[kind]
    spec = build_method(method, pair, num_draft_tokens=gamma)
    for prompt in PROMPTS:
        assert generate(spec, prompt, 40).tokens == vanilla_tokens(pair, prompt, 40)


@pytest.mark.parametrize("method", DRAFT_METHODS)
def test_identical_draft_accepts_everything(tiny_pairs, method):
    out = generate(build_method(method, tiny_pairs["same"], num_draft_tokens=4), PROMPTS[2], 41)
    assert out.stats.accepted == out.stats.drafted == 32          # 8 full steps of γ = 4
    assert out.stats.steps == 9 and out.stats.mean_accepted_tokens == pytest.approx(1 + 32 / 9)
    assert out.stats.accepted_length_hist == (1, 0, 0, 0, 8)   # last step: budget leaves γ_eff=0


@pytest.mark.parametrize("method", DRAFT_METHODS)
def test_unrelated_draft_is_mostly_rejected(tiny_pairs, method):
    out = generate(build_method(method, tiny_pairs["unrelated"], num_draft_tokens=4), PROMPTS[3],
                   40)
    assert out.stats.drafted > 0 and out.stats.acceptance_rate < 0.2


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("kind", ["same", "related"])
def test_greedy_default_config_equals_vanilla(tiny_pairs, name, kind):
    pair = tiny_pairs[kind]
    for prompt in PROMPTS:
        assert generate(method(name, pair), prompt, 40).tokens == vanilla_tokens(pair, prompt, 40)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_no_method_uses_a_deprecated_transformers_argument(family):
    """Each forward hands the KV cache under the keyword the installed transformers names (5.24
    renamed ``past_key_values`` to ``cache`` and warns on every run: the CLI printed it)."""
    pair = tiny_pair("related", family=family)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ALL:
            generate(method(name, pair, temperature=1.0), PROMPTS[0], 9)
    deprecated = [str(w.message) for w in caught
                  if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert not deprecated, deprecated


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 33])
def test_max_new_tokens_is_exact_and_stats_add_up(tiny_pairs, name, temperature,
                                                  max_new_tokens):
    m = method(name, tiny_pairs["same"], temperature=temperature)
    steps = list(m.stream(torch.tensor(PROMPTS[3]), max_new_tokens))
    if hasattr(m, "reset"):
        m.reset()
    out = generate(m, PROMPTS[3], max_new_tokens)
    assert len(out.tokens) == max_new_tokens == sum(len(s.tokens) for s in steps)
    stats = out.stats
    assert stats.steps == len(steps) and stats.new_tokens == max_new_tokens
    for s in steps:
        assert 0 <= s.accepted <= s.drafted and 1 <= len(s.tokens) <= s.accepted + 1
        if name in DRAFT_METHODS:
            assert s.draft_forwards == s.drafted <= DEFAULTS[name]["num_draft_tokens"]
    assert sum(stats.accepted_length_hist) == stats.steps
    assert sum(stats.accepted_per_position) == stats.accepted
    assert sum(stats.drafted_per_position) == stats.drafted
    assert list(stats.accepted_per_position) == sorted(stats.accepted_per_position, reverse=True)
    assert stats.verify_time_s > 0
    if CONFIGS[name].get("model_free"):      # lookup drafters: time spent drafting, no forwards
        assert stats.draft_forwards == 0
    else:
        assert (stats.draft_time_s > 0) == (stats.draft_forwards > 0)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_eos_stops_generation(tiny_pairs, name, temperature):
    pair = tiny_pairs["related"]
    free = generate(method(name, pair, temperature=temperature), PROMPTS[1], 30)
    eos = free.tokens[6]
    first = free.tokens.index(eos)
    stopped = generate(method(name, pair, temperature=temperature, eos_token_ids=[eos]),
                       PROMPTS[1], 30)
    assert stopped.tokens == free.tokens[: first + 1]


@pytest.mark.parametrize("name", ALL)
def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_pairs, name):
    def run(seed):
        m = method(name, tiny_pairs["related"], temperature=1.0, seed=seed)
        return generate(m, PROMPTS[2], 25).tokens

    assert run(5) == run(5)
    assert len({run(seed) for seed in range(4)}) > 1


@pytest.mark.parametrize("name", ALL)
def test_temperature_zero_ignores_the_seed(tiny_pairs, name):
    outs = {generate(method(name, tiny_pairs["related"], seed=s), PROMPTS[2], 20).tokens
            for s in range(3)}
    assert len(outs) == 1


@pytest.mark.parametrize("case", LAW_CASES, ids=[case.id for case in LAW_CASES])
def test_sampled_tokens_follow_the_target_law(case):
    """End to end at T > 0: the first two generated tokens are distributed as the target says
    (800 draws; lookahead starts with a filled pool, so its trie is verified from the first
    step)."""
    assert law_cases.run(case).pvalue > ALPHA


@pytest.mark.parametrize("case", MUTANT_CASES, ids=[case.id for case in MUTANT_CASES])
def test_the_law_check_rejects_the_mutated_rule_at_the_same_draws(case):
    """The same check with the method's rule mutated (a rejected position resampled from p
    instead of the residual; block verification's residual likewise) must fail, with an estimated
    power of at least 0.99 at these draws (docs/verification.md §0.4, ``python -m
    tests.helpers.law_power methods``)."""
    result = law_cases.run(case, case.mutation)
    assert result.pvalue < ALPHA and result.power() >= 0.99, result


# ----------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("method", GAMMA_METHODS)
@pytest.mark.parametrize("gamma", [0, -1, 2.5, True, "4"])
def test_bad_gamma_is_rejected(tiny_pairs, method, gamma):
    with pytest.raises(ValueError, match=r"num_draft_tokens \(γ\)=.*allowed is an integer >= 1"):
        build_method(method, tiny_pairs["same"], num_draft_tokens=gamma)


@pytest.mark.parametrize("bad,match", [
    (dict(temperature=-0.1), "temperature=-0.1 is invalid"),
    (dict(temperature=float("nan")), "temperature=nan is invalid"),
    (dict(top_p=0.0), r"top_p=0.0 is invalid: allowed is a number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 is invalid"),
    (dict(top_k=-2), "top_k=-2 is invalid"),
])
@pytest.mark.parametrize("method", ALL)
def test_bad_sampling_settings_are_rejected(tiny_pairs, method, bad, match):
    with pytest.raises(ValueError, match=match):
        build_method(method, tiny_pairs["same"], **bad)


def test_unknown_method_and_hyperparameter_are_named(tiny_pairs):
    with pytest.raises(ValueError, match="method 'medusa' is unknown: allowed are"):
        build_method("medusa", tiny_pairs["same"])
    with pytest.raises(ValueError, match=r"no hyperparameter\(s\) \['window'\]: allowed are"):
        build_method("speculative", tiny_pairs["same"], window=3)


@pytest.mark.parametrize("method", ALL)
def test_prompt_longer_than_context_is_rejected(tiny_pairs, method):
    m = build_method(method, tiny_pairs["same"])
    with pytest.raises(ValueError, match=r"prompt of 600 tokens \+ max_new_tokens=4 exceeds the "
                                         r"model's context of 512 tokens"):
        generate(m, [1] * 600, 4)
    with pytest.raises(ValueError, match=r"prompt of 510 tokens \+ max_new_tokens=3 exceeds"):
        generate(m, [1] * 510, 3)
    assert len(generate(m, [1] * 510, 2).tokens) == 2
    with pytest.raises(ValueError, match="max_new_tokens=0 is invalid"):
        generate(m, [1, 2], 0)
    with pytest.raises(ValueError, match=r"prompt token id 999 is outside the model's vocabulary"):
        generate(m, [1, 999], 2)
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer"):
        generate(m, "hello", 2)

