"""EAGLE heads: alignment with the target (an oracle head is always accepted), greedy equality,
EOS and budget inside a draft, the sampled trees' laws, the published layout round trip, mismatched
heads, and the shipped head on the embedded default.

Generic conformance (greedy = vanilla, exact max_new_tokens, EOS, seeds) comes from
``tests/test_methods.py`` through ``conf/method/eagle.yaml``; the sampling laws are checked here,
on the tree step that follows the prefill (the conformance chi-square's first token would not
involve the head).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from decoding import build_method, generate
from decoding.base import DraftContext
from decoding.eagle import EagleSource, additive_mask
from decoding.eagle_head import HeadConfig
from decoding.eagle_weights import (SHIPPED, head_identity, load_head, random_head, random_seed,
                                    save_head)
from decoding.sampling import SamplingConfig, logits_to_probs
from tests.conftest import tiny_pair, vanilla
from tests.helpers.eagle import PROMPT, OracleHead
from tests.helpers import law_cases
from tests.helpers.laws import ALPHA, ChiSquare, chi_square
from tests.helpers.mutations import mutated

SHAPES = [{}, {"shape": "3-2-1"}, {"shape": (1, 1, 1, 1)},
          {"width": 3, "depth": 5, "total_tokens": 12, "confidence_threshold": 0.05}]


# ----------------------------------------------------------------------------------------------
# Alignment, greedy equality, EOS and budget


@pytest.mark.parametrize("kw", SHAPES[:3], ids=["dynamic", "3-2-1", "chain"])
def test_an_oracle_head_is_always_right(tiny_pairs, kw):
    pair = tiny_pairs["related"]
    m = build_method("eagle", pair, head=OracleHead(pair.target, PROMPT[0]), eos_token_ids=[],
                     **kw)
    out = generate(m, PROMPT, 30)
    assert out.tokens == vanilla(pair, PROMPT, 30, eos_token_ids=[])
    if kw.get("shape") == (1, 1, 1, 1):       # prefill, then every chain fully accepted
        assert out.stats.accepted_length_hist[-1] >= out.stats.steps - 3
        assert out.stats.accepted == out.stats.drafted


@pytest.mark.parametrize("kind", ["related", "unrelated"])
def test_greedy_equals_vanilla_with_random_heads(tiny_pairs, kind):
    pair = tiny_pairs[kind]
    for kw in SHAPES:
        m = build_method("eagle", pair, head="random:1", **kw)
        for prompt in ([3], PROMPT, [200, 13, 99]):
            assert generate(m, prompt, 20).tokens == vanilla(pair, prompt, 20), kw


def test_eos_and_budget_inside_a_draft(tiny_pairs):
    pair = tiny_pairs["related"]
    head = OracleHead(pair.target, PROMPT[0])
    free = vanilla(pair, PROMPT, 30, eos_token_ids=[])
    for n in (1, 2, 3, 5, 6):
        m = build_method("eagle", pair, head=head, shape=(1, 1, 1, 1), eos_token_ids=[])
        assert generate(m, PROMPT, n).tokens == free[:n]
    eos = free[3]                   # the 2nd token of the first (fully accepted) chain
    m = build_method("eagle", pair, head=head, shape=(1, 1, 1, 1), eos_token_ids=[eos])
    assert generate(m, PROMPT, 30).tokens == free[: free.index(eos) + 1]


def test_tree_rows_equal_the_head_run_along_each_path(tiny_pairs):
    """``EagleSource.extend`` (tree mask over the head's cache) = the head fed path by path."""
    pair = tiny_pairs["related"]
    head = random_head(pair.target, seed=2)
    ids = torch.tensor(PROMPT + [9])
    with torch.no_grad():
        hidden = pair.target(ids[None], output_hidden_states=True).hidden_states[-1][0, :-1]
        source = EagleSource(head)
        source.root(DraftContext(ids, 8, None, None, hidden))
        tokens, parents, depths = [11, 12, 13, 14], [-1, -1, 0, 1], [1, 1, 2, 2]
        first = source.extend([0, 1], tokens, parents, depths)
        second = source.extend([2, 3], tokens, parents, depths)
        for node, logits in ((2, second[0]), (3, second[1]), (1, first[1])):
            path = [node] if parents[node] < 0 else [parents[node], node]
            cache = head.new_cache()
            rows = len(PROMPT)
            out = head(hidden[None], ids[1:][None], torch.arange(rows),
                       additive_mask(torch.ones(rows, rows, dtype=torch.bool).tril(), head.fc
                                     .weight.dtype), cache)[0]
            feature = out[-1]
            for depth, n in enumerate(path, 1):
                feature = head(feature[None, None], torch.tensor([[tokens[n]]]),
                               torch.tensor([rows - 1 + depth]), None, cache)[0, 0]
            assert torch.allclose(head.logits(feature), logits, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Sampled trees: the declared q is the head's warped distribution, and the law end to end


def sibling_draws() -> tuple[torch.Tensor, torch.Tensor, ChiSquare]:
    """400 drafts of three i.i.d. siblings after one prompt: the q every draft declares, the
    head's own warped distribution, and the chi-square of the 1,200 sibling tokens against q
    (tokens expecting < 5 pooled)."""
    pair = tiny_pair("related", vocab_size=12, initializer_range=0.3)
    sampling = SamplingConfig(temperature=0.8)
    m = build_method("eagle", pair, head="random:3", shape=(3,), siblings="iid",
                     temperature=0.8)
    ids = torch.tensor([3, 1, 4, 1])
    with torch.no_grad():
        hidden = pair.target(ids[None], output_hidden_states=True).hidden_states[-1][0, :-1]
        q = None
        counts = np.zeros(12)
        generator = torch.Generator().manual_seed(0)
        for _ in range(400):
            m.drafter.reset()
            draft = m.drafter.propose(DraftContext(ids, 4, generator, None, hidden))
            q = draft.probs[0] if q is None else q
            assert torch.allclose(draft.probs, q.expand(3, -1))     # one q for the 3 siblings
            for token in draft.tokens.tolist():
                counts[token] += 1
        head = m.head
        rows = ids.shape[0] - 1
        out = head(hidden[None], ids[1:][None], torch.arange(rows))[0, -1]
        expected = logits_to_probs(head.logits(out), sampling)
    wanted = expected.double().numpy() * counts.sum()
    keep = wanted >= 5
    observed, wanted = counts[keep], wanted[keep]
    if (~keep).any():                                   # pool the rare tokens into one bin
        observed = np.append(observed, counts[~keep].sum())
        wanted = np.append(wanted, expected.double().numpy()[~keep].sum() * counts.sum())
    return q, expected, chi_square(observed, wanted)


def test_sampled_siblings_declare_the_heads_distribution():
    q, expected, result = sibling_draws()
    assert torch.allclose(q, expected, atol=1e-5)
    assert result.pvalue > ALPHA, result


def test_the_sibling_check_rejects_siblings_drawn_without_replacement():
    """The real drafter mutated to draw its i.i.d. siblings without replacement (three distinct
    tokens per draft: a flatter marginal than q) fails the same chi-square, with an estimated
    power of at least 0.99 at these 1,200 tokens."""
    with mutated("siblings-replacement-flipped"):
        _, _, result = sibling_draws()
    assert result.pvalue < ALPHA and result.power() >= 0.99, result


CASES = law_cases.eagle_cases()


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_sampled_trees_follow_the_target_law(case):
    """Token 2 comes from the first tree step (token 1 from the prefill; a budget of 3 leaves a
    depth-1 tree: two siblings drawn without replacement, or EAGLE-2's top-3 point masses):
    chi-square on the pair against the target's exact law."""
    assert law_cases.run(case).pvalue > ALPHA


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_law_check_rejects_the_mutated_rule_at_the_same_draws(case):
    """Each sibling round resampling from p instead of the residual must fail at the same 700
    draws, with an estimated power of at least 0.99."""
    result = law_cases.run(case, case.mutation)
    assert result.pvalue < ALPHA and result.power() >= 0.99, result


# ----------------------------------------------------------------------------------------------
# Loading: the published layout, mismatches, identities (EAGLE-3 heads: tests/test_eagle3.py)


def published_checkpoint(head, folder, fmt):
    """A head written as the EAGLE authors publish it: config.json + pytorch_model.bin (with
    embed_tokens.weight) or model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        return save_head(head, folder)
    raw = {**head.config.to_json(), "torch_dtype": "float16", "transformers_version": "4.28.1"}
    raw.pop("head_dim")
    (folder / "config.json").write_text(json.dumps(raw))
    state = {k: v.half() for k, v in head.state_dict().items()}
    state["embed_tokens.weight"] = head.shared[0].weight.detach().half().clone()
    torch.save(state, folder / "pytorch_model.bin")
    return folder


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_head_round_trips_through_the_published_layout(tiny_pairs, tmp_path, fmt):
    pair = tiny_pairs["related"]
    head = random_head(pair.target, seed=5)
    folder = published_checkpoint(head, tmp_path / "head", fmt)
    keys = set(head.state_dict())
    assert keys == {"fc.weight", "fc.bias", *(f"layers.0.{k}.weight" for k in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"))}
    loaded = load_head(str(folder), pair.target)
    for name, value in head.state_dict().items():
        assert torch.allclose(loaded.state_dict()[name], value.half().float())
    prompt_ids = torch.tensor(PROMPT)
    out = generate(build_method("eagle", pair, head=str(folder)), PROMPT, 12)
    assert out.tokens == vanilla(pair, prompt_ids, 12)


def test_a_dataparallel_checkpoint_with_rope_buffers_loads_and_strays_do_not(tiny_pairs,
                                                                              tmp_path):
    """As the authors' non-strict load: a ``module.`` prefix and ``rotary_emb.inv_freq`` buffers
    are harmless; any other unknown key is a different layout and fails."""
    pair = tiny_pairs["related"]
    head = random_head(pair.target, seed=6)
    folder = published_checkpoint(head, tmp_path / "dp", "bin")
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    state = {f"module.{k}": v for k, v in state.items()}
    state["module.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    torch.save(state, folder / "pytorch_model.bin")
    loaded = load_head(str(folder), pair.target)
    for name, value in head.state_dict().items():
        assert torch.allclose(loaded.state_dict()[name], value.half().float())
    state["module.layers.0.extra_norm.weight"] = torch.ones(64)
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"unexpected layout: .*extra_norm"):
        load_head(str(folder), pair.target)


def test_only_exact_random_references_are_random_heads(tiny_pairs, tmp_path, monkeypatch):
    assert [random_seed(r) for r in ("random", "random:7", "randomorg/eagle", "random_heads/h",
                                     "random:x", "auto")] == [0, 7, None, None, None, None]
    pair = tiny_pairs["related"]
    folder = save_head(random_head(pair.target, seed=3), tmp_path / "random_heads" / "h")
    monkeypatch.chdir(tmp_path)                     # "random_heads/h" is a local directory
    loaded = load_head("random_heads/h", pair.target)
    assert torch.equal(loaded.fc.weight, load_head(str(folder), pair.target).fc.weight)
    assert not torch.equal(loaded.fc.weight, random_head(pair.target, 0).fc.weight)
    assert "sha256" in head_identity("random_heads/h")


def test_a_mismatched_head_names_both_models(tmp_path):
    small = tiny_pair("related", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    other_vocab = tiny_pair("related", vocab_size=128)
    target = tiny_pair("related")
    folder = save_head(random_head(small.target), tmp_path / "h32")
    with pytest.raises(ValueError, match=r"EAGLE head '.*h32' does not fit target '.*': hidden "
                                         r"size 32 \(head\) vs 64 \(target\)"):
        build_method("eagle", target, head=str(folder))
    folder = save_head(random_head(other_vocab.target), tmp_path / "v128")
    with pytest.raises(ValueError, match=r"vocabulary 128 \(head\) vs 256 \(target\)"):
        load_head(str(folder), target.target)


def test_bad_references_are_refused(tiny_pairs, tmp_path):
    pair = tiny_pairs["related"]
    with pytest.raises(ValueError, match=r"head='/nonexistent/head': no such local directory"):
        build_method("eagle", pair, head="/nonexistent/head")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not an EAGLE head directory"):
        build_method("eagle", pair, head=str(tmp_path / "empty"))
    folder = save_head(random_head(pair.target), tmp_path / "e3")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "draft_vocab_size": 32}))
    with pytest.raises(ValueError, match=r"EAGLE-3 head .* has draft_vocab_size=32 < vocab_size="
                                         r"256 but no d2t/t2d mapping"):
        load_head(str(folder), pair.target)        # a draft vocabulary makes it EAGLE-3
    with pytest.raises(ValueError, match="RoPE scaling 'yarn' is not supported"):
        HeadConfig.from_json({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match=r"width=0 is invalid"):
        build_method("eagle", pair, width=0)
    with pytest.raises(OSError, match=r"could not load EAGLE head 'nobody/no-such-eagle-head'"):
        build_method("eagle", pair, head="nobody/no-such-eagle-head")     # no hub here, or 404


def test_head_identity_follows_the_weights(tiny_pairs, tmp_path):
    pair = tiny_pairs["related"]
    first = head_identity(str(save_head(random_head(pair.target, 0), tmp_path / "a")))
    second = head_identity(str(save_head(random_head(pair.target, 1), tmp_path / "a")))
    assert first["sha256"] != second["sha256"] and first["head"] == second["head"]
    assert head_identity("random") == {"head": "random"}
    assert head_identity("yuhuili/EAGLE-Vicuna-7B-v1.3") == {"head": "yuhuili/EAGLE-Vicuna-7B-v1.3"}


# ----------------------------------------------------------------------------------------------
# The embedded default with its shipped head


@pytest.mark.real_model
def test_shipped_head_on_the_default_model(default_pair, gsm8k_questions):
    from decoding import encode_prompt
    assert SHIPPED["smollm2-135m-instruct"].is_dir(), "the trained head ships with the repo"
    prompt = encode_prompt(default_pair.tokenizer, gsm8k_questions[1])
    out = generate(build_method("eagle", default_pair, head="auto"), prompt, 32)
    assert out.tokens == vanilla(default_pair, prompt, 32)
    assert out.stats.mean_accepted_tokens > 1.25           # a trained head (random: ~1.0)


def test_a_study_fingerprints_the_heads_weights(tmp_path, monkeypatch):
    """The tuner records the head; other weights under the same path never resume the study."""
    from tests.conftest import run_study as run
    from tuner.config.errors import StudyMismatch
    TINY = ["task.n_held_out=1"]          # the tiny models and budget come with run_study
    monkeypatch.chdir(tmp_path)
    target = tiny_pair("related").target
    folder = save_head(random_head(target, 0), tmp_path / "head")
    args = ["method=eagle", *TINY, f"method.params.head={folder}", "search=tpe",
            "search.n_trials=1", "tracking=none"]
    result = run(tmp_path, *args)
    assert result["params"]["head"] == str(folder)
    save_head(random_head(target, 1), folder)
    with pytest.raises(StudyMismatch, match=r"other settings \(method.head: "):
        run(tmp_path, *args)
