"""The compiled static-shape target (``decoding.compiled.CompiledTarget``).

Every method that runs the shared loop must emit exactly its eager tokens at temperature 0 when its
target runs compiled (tiny llama and qwen2 models; on the embedded default, every lossless method
emits eager vanilla's 64 tokens); after ``warm`` nothing compiles again, whatever the prompt's
length or the method; bad settings are refused with one line.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from decoding import build_method, encode_prompt, generate
from decoding.compiled import CompiledTarget
from tests.conftest import tiny_pair
from tests.helpers.methods import ALL, CONFIGS, PROMPTS, method

# lookahead keeps its own loop; EAGLE-3 heads read middle layers (refused: tests/test_eagle3.py)
COMPILABLE = [name for name in ALL if name not in ("lookahead", "eagle3")]
# 1 (plain decoding), 4 (forwards of 2-4 padded), 16 (5-16 padded); longer ones run eager. Each
# bucket is one compile per model family (the fixture's cost), so three cover every path.
BUCKETS = (1, 4, 16)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def compiled_pair(request):
    pair = tiny_pair("related", family=request.param)
    compiled = CompiledTarget(pair.target, capacity=192, buckets=BUCKETS)
    compiled.warm()
    return pair, compiled


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", COMPILABLE)
def test_compiled_tokens_equal_eager_tokens(compiled_pair, name):
    pair, compiled = compiled_pair
    spec = method(name, pair)
    eager = [generate(spec, prompt, 40).tokens for prompt in PROMPTS]
    spec.use_compiled(compiled)
    assert [generate(spec, prompt, 40).tokens for prompt in PROMPTS] == eager


def test_sampled_tokens_follow_the_same_generator(compiled_pair):
    """At temperature > 0 the verify functions and the generator are the eager path's: the same
    seed gives the same tokens (the rows differ by rounding at most)."""
    pair, compiled = compiled_pair
    for name in ("vanilla", "speculative", "tree"):
        spec = method(name, pair, temperature=1.0, seed=3)
        eager = [generate(spec, prompt, 24).tokens for prompt in PROMPTS[:3]]
        spec.use_compiled(compiled)
        assert [generate(spec, prompt, 24).tokens for prompt in PROMPTS[:3]] == eager, name


def test_nothing_compiles_again_after_warm_up(compiled_pair):
    """Prompts of 1..40 tokens (prefills eager past the largest bucket), chains and trees of
    every size: the graphs compiled by ``warm`` serve them all."""
    pair, compiled = compiled_pair
    assert set(compiled.compile_s) == set(BUCKETS)
    before, eager_before = graphs(), compiled.eager_forwards
    prompts = PROMPTS + [list(range(5, 45)), list(range(9, 26))]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for name in ("vanilla", "speculative", "tree", "specinfer", "eagle"):
            spec = method(name, pair)
            spec.use_compiled(compiled)
            for prompt in prompts:
                generate(spec, prompt, 20)
    assert graphs() == before
    assert compiled.eager_forwards > eager_before          # the 40- and 17-token prefills


def test_stale_rows_of_a_longer_generation_are_never_seen(compiled_pair):
    """A long generation leaves rows far past a short prompt; the next short one must not see
    them (the cache is never cleared)."""
    pair, compiled = compiled_pair
    spec = method("speculative", pair)
    short, long = PROMPTS[1], list(range(3, 60))
    eager_short = generate(spec, short, 30).tokens
    spec.use_compiled(compiled)
    generate(spec, long, 60)
    assert generate(spec, short, 30).tokens == eager_short


@pytest.mark.real_model
def test_every_lossless_method_compiled_on_the_default_model(default_pair, gsm8k_questions):
    compiled = CompiledTarget(default_pair.target, capacity=384, buckets=(1, 8))
    compiled.warm()
    prompts = [encode_prompt(default_pair.tokenizer, q) for q in gsm8k_questions[2:3]]
    lossless = [n for n in COMPILABLE if CONFIGS[n].get("lossless", True)]
    params = {"speculative": {"num_draft_tokens": 4}, "block": {"num_draft_tokens": 7},
              "eagle": {"head": "auto"}}
    # the reference is eager vanilla's tokens, generated once: a lossless method run compiled must
    # equal them (its own eager tokens equal them too: tests/test_real_model.py and the methods'
    # own default-model tests), so nothing is generated twice
    reference = [generate(build_method("vanilla", default_pair), p, 64).tokens for p in prompts]
    for name in lossless:
        spec = build_method(name, default_pair, **params.get(name, {}))
        spec.use_compiled(compiled)
        assert [generate(spec, p, 64).tokens for p in prompts] == reference, name


def test_bad_settings_are_refused_with_one_line():
    pair = tiny_pair("related")
    with pytest.raises(ValueError, match=r"buckets=\[4, 2\] is invalid: allowed is"):
        CompiledTarget(pair.target, capacity=64, buckets=[4, 2])
    with pytest.raises(ValueError, match=r"capacity=8 is invalid: allowed is an integer > the "
                                         r"largest bucket \(16\)"):
        CompiledTarget(pair.target, capacity=8, buckets=BUCKETS)
    compiled = CompiledTarget(pair.target, capacity=40, buckets=(1, 4))
    spec = method("speculative", pair)
    spec.use_compiled(compiled)
    with pytest.raises(ValueError, match="a generation of 50 positions does not fit the "
                                         r"compiled target's cache: capacity=40"):
        generate(spec, PROMPTS[0][:1] * 10, 40)
    with pytest.raises(ValueError, match="method lookahead keeps its own decoding loop"):
        method("lookahead", pair).use_compiled(compiled)
    other = tiny_pair("unrelated")
    with pytest.raises(ValueError, match="wraps another model"):
        method("vanilla", other).use_compiled(compiled)


def test_a_study_with_engine_compile_records_it_and_stays_lossless(tmp_path, capsys, in_tmp):
    """engine.compile=true end to end (tiny models, method=tree: chains and trees): every trial
    completes (each one's tokens checked against the compiled vanilla), the study's identity
    names the compile settings, and every trial records what was compiled."""
    import json

    from optuna.trial import TrialState

    from tests.conftest import load_study, run_study
    run_study(tmp_path, "method=tree", "search=grid", "search.n_trials=2", "tracking=none",
              "engine.compile=true", "engine.compile_buckets=[1,4,16]")
    out = capsys.readouterr().out
    assert "compiling the target for forward lengths [1, 4, 16]" in out
    study = load_study(tmp_path)
    done = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(done) == 2
    compiled = [t.user_attrs["compiled"] for t in done]
    assert all(c.startswith("buckets [1, 4, 16], capacity ") for c in compiled)
    assert compiled[0] == compiled[1]        # the same graphs: nothing compiled after warm-up
    engine = json.loads(study.user_attrs["fingerprint"]["engine"])
    assert engine["compile"] is True and engine["compile_buckets"] == [1, 4, 16]
