"""EAGLE-3 heads: the loop hands the head exactly the target's states of its layers, an oracle head
is always accepted, random heads equal vanilla at T=0, the draft vocabulary (a token outside it is
never drafted and the target still emits it), the sampled trees' law (with a power check), the
published layout round trip and what is refused, and the SGLang-named knobs.

Generic conformance (greedy = vanilla on the YAML's defaults, exact max_new_tokens, EOS, seeds)
comes from ``tests/test_methods.py`` through ``conf/method/eagle3.yaml``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from decoding import build_method, generate
from decoding.eagle import EagleDrafter
from decoding.eagle3_head import Eagle3Config, Eagle3Head, default_layer_ids
from decoding.eagle_weights import load_head, random_head, save_head
from decoding.sampling import SamplingConfig
from tests.conftest import tiny_pair, vanilla
from tests.helpers.eagle import PROMPT, OracleHead
from tests.helpers.laws import ALPHA, ChiSquare, pair_chi_square, two_token_law

SMALL_VOCAB = dict(vocab_size=6, initializer_range=0.3)


def eagle3_head(target: torch.nn.Module, seed: int, draft_ids=None) -> Eagle3Head:
    """A random EAGLE-3 head; ``draft_ids``: its draft vocabulary (default: the target's)."""
    vocab = target.config.vocab_size
    cfg = Eagle3Config.for_target(target.config, len(draft_ids) if draft_ids else vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = Eagle3Head(cfg, target.get_input_embeddings())
    if draft_ids:
        head.set_vocabulary(draft_ids)
    return head.to(target.dtype).eval()


def drafted_tokens(method) -> list[int]:
    """Record every token the method's drafter proposes (a wrapper on this instance only)."""
    seen: list[int] = []
    propose = method.drafter.propose

    def recording(context):
        draft = propose(context)
        seen.extend(draft.tokens.tolist())
        return draft

    method.drafter.propose = recording
    return seen


# ----------------------------------------------------------------------------------------------
# The features the loop hands the head


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kw", [{}, {"shape": (1, 1, 1)}], ids=["dynamic", "chain"])
def test_the_head_reads_the_targets_states_of_its_layers_row_by_row(family, kw):
    """Every target row reaches the head once, in order, as the concatenation of the states
    entering the head's layers: equal to one full forward over the final sequence."""
    pair = tiny_pair("related", family=family, num_hidden_layers=4)
    head = eagle3_head(pair.target, 1)
    assert head.layer_ids == default_layer_ids(4) == (0, 2, 4)
    m = build_method("eagle3", pair, head=head, **kw)
    rows: list[torch.Tensor] = []
    fuse = m.head.features
    m.head.features = lambda hidden: (rows.append(hidden.clone()), fuse(hidden))[1]
    out = generate(m, PROMPT, 24)
    fed = torch.cat(rows)                                                     # [n, 3H]
    sequence = torch.tensor([PROMPT + list(out.tokens)])
    with torch.no_grad():
        states = pair.target(sequence, output_hidden_states=True).hidden_states
    expected = torch.cat([states[j][0] for j in head.layer_ids], dim=-1)      # [T, 3H]
    assert fed.shape[1] == 3 * pair.target.config.hidden_size
    assert len(PROMPT) <= fed.shape[0] < sequence.shape[1]
    # fp32: the cached rows and the full forward sum in other orders (measured up to 1.7e-5 on
    # values up to 20, at the edge of atol=1e-5 on some thread counts); a wrong layer or a
    # shifted row differs by O(1)
    assert torch.allclose(fed, expected[: fed.shape[0]], atol=1e-4)
    assert out.tokens == vanilla(pair, PROMPT, 24)


# ----------------------------------------------------------------------------------------------
# Oracle, greedy equality, the draft vocabulary


class Oracle3Head(OracleHead):
    """``tests.helpers.eagle.OracleHead`` as an EAGLE-3 head: it declares layer ids (so the loop
    hands it fused states) and drafts over a draft vocabulary (−inf elsewhere)."""

    def __init__(self, target, first, draft_ids) -> None:
        super().__init__(target, first)
        self.layer_ids = (0, 1, 2)
        self.allowed = torch.zeros(target.config.vocab_size, dtype=torch.bool)
        self.allowed[list(draft_ids)] = True

    def features(self, hidden):
        assert hidden.shape[-1] == 3 * self.target.config.hidden_size
        return hidden[..., : self.target.config.hidden_size]

    def logits(self, features):
        return super().logits(features).masked_fill(~self.allowed, float("-inf"))


@pytest.mark.parametrize("kw", [{}, {"shape": (1, 1, 1, 1)}], ids=["dynamic", "chain"])
def test_an_oracle_head_is_always_accepted(tiny_pairs, kw):
    pair = tiny_pairs["related"]
    free = vanilla(pair, PROMPT, 30, eos_token_ids=[])
    head = Oracle3Head(pair.target, PROMPT[0], set(free) | {0, 1})
    out = generate(build_method("eagle3", pair, head=head, eos_token_ids=[], **kw), PROMPT, 30)
    assert out.tokens == free
    if kw:                                   # prefill, then every chain fully accepted
        assert out.stats.accepted == out.stats.drafted
        assert out.stats.accepted_length_hist[-1] >= out.stats.steps - 3


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["related", "unrelated"])
def test_greedy_equals_vanilla_with_random_heads(family, kind):
    pair = tiny_pair(kind, family=family)
    for kw in ({}, {"shape": "3-2-1"}, {"steps": 5, "topk": 3, "num_draft_tokens": 13}):
        m = build_method("eagle3", pair, head="random:1", **kw)
        for prompt in ([3], PROMPT, [200, 13, 99]):
            assert generate(m, prompt, 20).tokens == vanilla(pair, prompt, 20), kw


def test_a_token_outside_the_draft_vocabulary_is_never_drafted_yet_emitted(tiny_pairs):
    pair = tiny_pairs["related"]
    free = vanilla(pair, PROMPT, 30)
    outside = set(free[: len(free) // 2])                 # tokens the target emits early on
    draft_ids = [t for t in range(pair.target.config.vocab_size) if t not in outside]
    for kw in ({}, {"shape": (1, 1, 1)}):
        head = eagle3_head(pair.target, 2, draft_ids)
        m = build_method("eagle3", pair, head=head, **kw)
        drafted = drafted_tokens(m)
        assert generate(m, PROMPT, 30).tokens == free
        assert drafted and not outside & set(drafted)
    # the head's distributions over the target vocabulary: zero outside the draft vocabulary
    with torch.no_grad():
        probs = torch.softmax(head.logits(torch.randn(5, pair.target.config.hidden_size)), -1)
    assert float(probs[:, sorted(outside)].sum()) == 0.0
    assert torch.allclose(probs.sum(-1), torch.ones(5))


@pytest.mark.real_model
def test_random_eagle3_head_equals_vanilla_on_the_default_model(default_pair, gsm8k_questions):
    from decoding import encode_prompt
    prompt = encode_prompt(default_pair.tokenizer, gsm8k_questions[2])
    m = build_method("eagle3", default_pair, head="random:0")
    assert m.head.layer_ids == (2, 15, 27)                   # 30 layers: 2, L//2, L-3
    assert generate(m, prompt, 64).tokens == vanilla(default_pair, prompt, 64)


@pytest.mark.real_model
def test_shipped_eagle3_head_on_the_default_model(default_pair, gsm8k_questions):
    from decoding import encode_prompt
    from decoding.eagle_weights import SHIPPED
    assert SHIPPED["smollm2-135m-instruct-eagle3"].is_dir(), "the trained head ships with the repo"
    prompt = encode_prompt(default_pair.tokenizer, gsm8k_questions[1])
    m = build_method("eagle3", default_pair, head="auto")       # auto: the shipped EAGLE-3 head
    assert isinstance(m.head, Eagle3Head) and m.head.config.draft_vocab_size == 8192
    out = generate(m, prompt, 64)
    assert out.tokens == vanilla(default_pair, prompt, 64)
    assert out.stats.mean_accepted_tokens > 1.25           # a trained head (random: ~1.0)


# ----------------------------------------------------------------------------------------------
# Sampled trees: the target's exact two-token law, and the power to see a wrong rule


def law_chi_square(tree: dict, draws: int, wrong: bool = False) -> ChiSquare:
    """Chi-square of the first two tokens (token 2 from the first tree step) against the
    target's exact law, with a head whose draft vocabulary holds 3 of the 6 tokens. ``wrong``:
    siblings drawn without replacement but verified with the fixed-q rule."""
    pair = tiny_pair("related", **SMALL_VOCAB)
    sampling = dict(temperature=1.0)
    law = two_token_law(pair.target, [3, 1, 4], SamplingConfig(**sampling))
    head = eagle3_head(pair.target, 4, [0, 2, 5])
    with torch.no_grad():
        head.lm_head.weight.mul_(8.0)                   # a peaked q: a wrong rule shows
    m = build_method("eagle3", pair, head=head, **tree, **sampling)
    if wrong:
        propose = m.drafter.propose
        m.drafter.propose = lambda context: dataclasses.replace(propose(context),
                                                                without_replacement=False)
    counts: dict[tuple, int] = {}
    for seed in range(draws):
        m.seed = seed
        key = generate(m, [3, 1, 4], 3).tokens[:2]
        counts[key] = counts.get(key, 0) + 1
    return pair_chi_square(counts, law)


DRAWS = 600     # the wrong rule's power reaches 0.99 from ~130 draws (docs/verification.md §0.4)


@pytest.mark.parametrize("tree", [dict(shape=(2, 1), siblings="without"),
                                  dict(shape=(3,), siblings="iid"),
                                  dict(topk=3, steps=1, num_draft_tokens=4)],
                         ids=["without", "iid", "dynamic"])
def test_sampled_trees_follow_the_target_law(tree):
    assert law_chi_square(tree, DRAWS).pvalue > ALPHA


def test_the_law_check_rejects_a_wrong_sibling_rule_at_the_same_draws():
    """The real drafter's siblings, drawn without replacement, declared as i.i.d. (verified with
    the fixed-q rule): rejected with an estimated power of at least 0.99 at the same draws."""
    result = law_chi_square(dict(shape=(2, 1), siblings="without"), DRAWS, wrong=True)
    assert result.pvalue < ALPHA and result.power() >= 0.99, result


# ----------------------------------------------------------------------------------------------
# The published layout, and what is refused


def test_a_head_round_trips_through_the_published_layout(tiny_pairs, tmp_path):
    pair = tiny_pairs["related"]
    vocab = pair.target.config.vocab_size
    head = eagle3_head(pair.target, 5, list(range(0, vocab, 2)))
    folder = save_head(head, tmp_path / "head")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["draft_vocab_size"] == vocab // 2 and raw["target_hidden_size"] == 64
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert set(head.state_dict()) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                                      *(f"midlayer.{k}.weight" for k in (
                                          "hidden_norm", "input_layernorm",
                                          "post_attention_layernorm", "self_attn.q_proj",
                                          "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                          "mlp.down_proj"))}
    loaded = load_head(str(folder), pair.target)
    assert isinstance(loaded, Eagle3Head)
    for name, value in head.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == value.dtype
        assert torch.allclose(got, value.half().float()) if value.is_floating_point() else \
            torch.equal(got, value)
    x = torch.randn(3, 64)
    assert torch.equal(loaded.logits(x).isinf(), head.logits(x).isinf())
    fp16 = eagle3_head(pair.target, 5, list(range(0, vocab, 2)))
    fp16.load_state_dict({k: v.half().float() if v.is_floating_point() else v
                          for k, v in head.state_dict().items()})
    a = generate(build_method("eagle3", pair, head=str(folder)), PROMPT, 16)
    b = generate(build_method("eagle3", pair, head=fp16), PROMPT, 16)
    assert a.tokens == b.tokens == vanilla(pair, PROMPT, 16)
    assert a.stats.accepted_length_hist == b.stats.accepted_length_hist
    # method=eagle loads the same files (the format is detected)
    assert generate(build_method("eagle", pair, head=str(folder)), PROMPT, 16).tokens == a.tokens


def test_the_authors_layout_loads_with_default_layers(tmp_path):
    """As the authors publish it: pytorch_model.bin with embed_tokens, no layer ids in the config
    (the default: inputs of layers 2, L//2, L−3), equal vocabularies without d2t/t2d."""
    pair = tiny_pair("related", num_hidden_layers=8)
    head = eagle3_head(pair.target, 6)
    assert head.layer_ids == (2, 4, 5)
    raw = {k: v for k, v in head.config.to_json().items() if k != "eagle_config"}
    folder = tmp_path / "authors"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**raw, "architectures": ["LlamaForCausalLM"]}))
    state = {k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    state["embed_tokens.weight"] = pair.target.get_input_embeddings().weight.detach().clone()
    torch.save(state, folder / "pytorch_model.bin")
    loaded = load_head(str(folder), pair.target)
    assert loaded.layer_ids == (2, 4, 5) and bool(loaded.t2d.all())
    x = torch.randn(2, 64)
    assert torch.allclose(loaded.logits(x), head.logits(x), atol=1e-5)


def test_bad_heads_are_refused_with_one_line(tiny_pairs, tmp_path):
    pair = tiny_pairs["related"]
    vocab = pair.target.config.vocab_size
    folder = save_head(eagle3_head(pair.target, 7, list(range(100))), tmp_path / "h")
    state_path = folder / "model.safetensors"
    from safetensors.torch import load_file, save_file
    state = load_file(str(state_path))
    bad = dict(state, d2t=state["d2t"] + 200)                       # ids beyond the vocabulary
    save_file(bad, str(state_path))
    with pytest.raises(ValueError, match=r"d2t maps draft ids outside the target vocabulary of "
                                         f"{vocab}"):
        load_head(str(folder), pair.target)
    save_file(dict(state, d2t=state["d2t"][:50]), str(state_path))
    with pytest.raises(ValueError, match=r"d2t \(50,\) / t2d \(256,\) do not fit "
                                         r"draft_vocab_size=100"):
        load_head(str(folder), pair.target)
    save_file(state, str(state_path))
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(
        {**raw, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}))
    with pytest.raises(ValueError, match=r"layer ids \[0, 1, 9\] \(head\) vs 2 layers"):
        load_head(str(folder), pair.target)
    small = tiny_pair("related", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    other = save_head(eagle3_head(small.target, 0), tmp_path / "h32")
    with pytest.raises(ValueError, match=r"EAGLE head '.*h32' does not fit target '.*': hidden "
                                         r"size 32 \(head\) vs 64 \(target\)"):
        build_method("eagle3", pair, head=str(other))
    eagle2 = save_head(random_head(pair.target, 0), tmp_path / "e2")
    with pytest.raises(ValueError, match="is an EAGLE-1/2 head, not EAGLE-3: run it with "
                                         "method=eagle"):
        build_method("eagle3", pair, head=str(eagle2))


def test_knobs_are_sglangs_and_bad_values_are_refused(tiny_pairs):
    pair = tiny_pairs["related"]
    m = build_method("eagle3", pair, head="random", steps=5, topk=3, num_draft_tokens=9)
    drafter = m.drafter
    assert isinstance(drafter, EagleDrafter)
    assert (drafter.depth, drafter.width, drafter.total_tokens) == (5, 3, 8)
    for bad, match in ((dict(num_draft_tokens=1), r"num_draft_tokens=1 is invalid: allowed is an "
                                                  r"integer ≥ 2"),
                       (dict(steps=0), r"steps=0 is invalid"),
                       (dict(topk=2.5), r"topk=2.5 is invalid")):
        with pytest.raises(ValueError, match=match):
            build_method("eagle3", pair, head="random", **bad)


def test_the_compiled_target_is_refused_for_eagle3(tiny_pairs):
    from decoding.compiled import CompiledTarget
    pair = tiny_pairs["related"]
    m = build_method("eagle3", pair, head="random")
    compiled = CompiledTarget(pair.target, capacity=128, buckets=(1, 8))
    with pytest.raises(ValueError, match=r"the compiled target returns only the last layer's "
                                         r"states, not layers \[0, 1, 2\] \(an EAGLE-3 head's\)"):
        m.use_compiled(compiled)
    assert m.compiled is None
    with pytest.raises(ValueError, match=r"not layers \[0, 1, 2\]"):       # the cache's contract
        compiled.start(16).chain(torch.tensor([1, 2]), 0, 1, (0, 1, 2))


# ----------------------------------------------------------------------------------------------
# Training: training-time test is inference unrolled, a smoke run, the held-out split


def test_training_time_test_equals_the_head_drafting_a_chain(tiny_pairs):
    """Step k of the unrolled training forward at row j = the head at inference: rows 0..j fed
    from the target's states, then a chain of k draft steps on its own outputs."""
    from decoding.tree import additive_mask
    from eagle_training.eagle3 import unrolled
    from eagle_training.features import Example
    pair = tiny_pairs["related"]
    head = eagle3_head(pair.target, 8)
    tokens = torch.tensor([3, 17, 9, 40, 41, 5, 77, 12, 8, 30])
    with torch.no_grad():
        hidden = pair.target(tokens[None], output_hidden_states=True).hidden_states
        states = torch.cat([hidden[j][0] for j in head.layer_ids], dim=-1)
        example = Example(tokens, states, torch.zeros(10, 1, dtype=torch.long),
                          torch.ones(10, 1))
        steps = unrolled(head, example, 4)                                  # 4 × [T, H]
        for row in (0, 3, 5):
            cache = head.new_cache()
            causal = torch.ones(row + 1, row + 1, dtype=torch.bool).tril()
            out = head(head.features(states[: row + 1])[None], tokens[1: row + 2][None],
                       torch.arange(row + 1), additive_mask(causal, torch.float32), cache)[0]
            x = out[-1]
            assert torch.allclose(x, steps[0][row], atol=1e-5)
            for k in range(1, 4):
                x = head(x[None, None], tokens[row + k + 1][None, None],
                         torch.tensor([row + k]), None, cache)[0, 0]
                assert torch.allclose(x, steps[k][row], atol=1e-5), (row, k)


def test_a_few_eagle3_steps_lower_the_loss_and_write_a_loadable_head(tmp_path):
    from eagle_training.train import main
    out = tmp_path / "head3"
    record = main(["--models", "tiny", "--version", "3", "--steps", "30", "--max-len", "48",
                   "--max-sequences", "24", "--held-out", "1", "--lr", "3e-3",
                   "--draft-vocab", "200", "--out", str(out)])
    history = json.loads((out / "history.json").read_text())
    first = sum(h["loss"] for h in history[:5]) / 5
    last = sum(h["loss"] for h in history[-5:]) / 5
    assert record["steps"] == 30 and last < 0.9 * first, (first, last)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == record["draft_vocab_size"] == 200
    assert config["spectune"]["settings"]["ttt_steps"] == 4
    assert "EAGLE-3 head" in (out / "README.md").read_text()
    pair = tiny_pair("related")                  # the same seeded tiny target as --models tiny
    head = load_head(str(out), pair.target)
    assert isinstance(head, Eagle3Head) and int(head.t2d.sum()) == 200
    expected = vanilla(pair, [3, 4, 5, 6], 16)
    assert generate(build_method("eagle3", pair, head=str(out)), [3, 4, 5, 6], 16).tokens == \
        expected
