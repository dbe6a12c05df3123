"""Token trees: exact sampling laws, greedy losslessness, KV-cache rows, drafters and spaces.

The law of one tree step is enumerated exactly (every sibling draw with its probability, every
verifier coin replaced by its closed-form probability through the implementation's own
``sibling_round``, every final draw by its full distribution), completed with target sampling to
K = depth + 1 tokens and compared with the target's K-token joint law, for each sibling scheme.
Two wrong rules must fail the same check. The random implementation (``tree_verify`` with
``merge_duplicates``) is then checked end to end by a chi-square on ≥ 3 emitted tokens, with the
power check that a wrong rule is rejected at the same number of draws.
"""

from __future__ import annotations

import itertools
from functools import lru_cache

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from decoding import build_method, generate
from decoding.base import Drafter
from decoding.models import load_pair
from decoding.reserved_cache import ReservedLayer
from decoding.runtime import cache_argument, new_cache
from decoding.token_tree import SHAPES, shape_paths
from decoding.tree import merge_duplicates
from decoding.verify import sibling_round, tree_verify
from tests.conftest import tiny_pair
from tests.conftest import vanilla as vanilla_tokens
from tests.helpers.laws import ALPHA, ChiSquare, chi_square
from tests.helpers.mutations import mutated
from tests.helpers.toy import ToyModel, complete, target_joint

# ----------------------------------------------------------------------------------------------
# Exact law of one tree step


def sibling_draws(q: torch.Tensor, k: int, scheme: str):
    """Every sibling tuple of a node with its probability: [(tokens, prob)]."""
    vocab = q.shape[0]
    if scheme == "topk":
        return [(tuple(torch.argsort(q, descending=True)[:k].tolist()), 1.0)]
    if scheme == "iid":
        return [(xs, float(np.prod([float(q[x]) for x in xs])))
                for xs in itertools.product(range(vocab), repeat=k)]
    support = [v for v in range(vocab) if q[v] > 0]
    out = []
    for xs in itertools.permutations(support, min(k, len(support))):
        prob, left = 1.0, 1.0
        for x in xs:
            prob *= float(q[x]) / left
            left -= float(q[x])
        out.append((xs, prob))
    return out


def tree_step_law(target: ToyModel, draft: ToyModel, context: tuple, shape: tuple, scheme: str,
                  rule: str = "right") -> dict[tuple, float]:
    """Law of (accepted path + final token) for a static tree of branching factors ``shape``.

    ``rule``: "right" (the matching residual update), "fixed_q" (without-replacement siblings
    verified with the i.i.d. rule) or "no_residual" (p unchanged after a rejection).
    i.i.d. duplicates are pooled as the implementation does: the accepted token's children are
    the children of every draw of it (multiplicity m → m·b draws at the next level).
    """
    @lru_cache(maxsize=None)
    def walk(prefix: tuple, k: int, rest: tuple) -> tuple:
        law: dict[tuple, float] = {}
        p0, q = target(context + prefix), draft(context + prefix)
        for xs, prob in (sibling_draws(q, k, scheme) if k else [((), 1.0)]):
            p, running_q, reach = p0, q, prob
            for x in xs:
                row = None if scheme == "topk" else running_q
                without = scheme == "without" and rule != "fixed_q"
                accept, residual, running_q = sibling_round(p, x, row, without)
                if scheme == "without" and rule == "fixed_q":
                    running_q = q
                if reach * accept > 0:
                    next_k = (xs.count(x) if scheme == "iid" else 1) * rest[0] if rest else 0
                    for tail, pt in walk(prefix + (x,), next_k, rest[1:]):
                        law[(x,) + tail] = law.get((x,) + tail, 0.0) + reach * accept * pt
                reach *= 1.0 - accept
                if rule != "no_residual":
                    p = residual
            for y, py in enumerate(p.tolist()):
                if reach * py > 0:
                    law[(y,)] = law.get((y,), 0.0) + reach * py
        return tuple(law.items())

    return dict(walk((), shape[0], tuple(shape[1:])))


def tree_error(vocab: int, shape: tuple, scheme: str, rule: str = "right", seed: int = 0,
               sparse: bool = False) -> float:
    target, draft = ToyModel(vocab, seed, sparse), ToyModel(vocab, seed + 100)
    context, length = (0,), len(shape) + 1
    law = complete(tree_step_law(target, draft, context, shape, scheme, rule), target, context,
                   length)
    joint = target_joint(target, context, length)
    assert abs(sum(law.values()) - 1.0) < 1e-9
    return max(abs(law.get(s, 0.0) - p) for s, p in joint.items())


TREES = {   # (vocab, branching factors per depth): depth ≤ 3, branching ≤ 3
    "iid": [(2, (2, 2, 2)), (3, (3, 2)), (4, (2, 2)), (3, (2, 1, 1)), (4, (3, 1))],
    "without": [(2, (2, 1, 1)), (3, (3, 2, 1)), (4, (3, 2)), (4, (2, 2, 2))],
    "topk": [(2, (2, 1, 1)), (3, (3, 2, 2)), (4, (3, 2, 1)), (4, (2, 2, 2))],
}


@pytest.mark.parametrize("scheme,vocab,shape",
                         [(s, v, sh) for s, cases in TREES.items() for v, sh in cases])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_tree_step_is_lossless_exactly(scheme, vocab, shape, sparse):
    assert tree_error(vocab, shape, scheme, sparse=sparse) < 1e-9


@pytest.mark.parametrize("scheme,rule,vocab,shape", [
    ("without", "fixed_q", 4, (2, 2)), ("without", "fixed_q", 4, (3, 2)),
    ("iid", "no_residual", 3, (3, 2)), ("topk", "no_residual", 4, (3, 2, 1)),
    ("without", "no_residual", 4, (2, 2, 2))])
def test_wrong_sibling_rules_fail_the_same_check(scheme, rule, vocab, shape):
    assert tree_error(vocab, shape, scheme, rule) > 1e-2


def test_fixed_q_counterexample_from_the_notes():
    """docs/verification.md §3.1: p = (.6, .35, .05), q = (.05, .1, .85), two siblings drawn
    without replacement; the fixed-q rule emits (0.3167, 0.6333, 0.05), the right rule p."""
    target = ToyModel(3, 0, constant=(0.6, 0.35, 0.05))
    draft = ToyModel(3, 0, constant=(0.05, 0.1, 0.85))
    for rule, expected in (("right", (0.6, 0.35, 0.05)), ("fixed_q", (19 / 60, 38 / 60, 0.05))):
        law = tree_step_law(target, draft, (0,), (2,), "without", rule)
        first = [sum(v for k, v in law.items() if k[0] == a) for a in range(3)]
        assert np.allclose(first, expected, atol=1e-12)


def multi_draft_law(target: ToyModel, drafts: list[ToyModel], context: tuple, gamma: int
                    ) -> dict[tuple, float]:
    """SpecInfer with one sampled chain per draft model, pooled at equal prefixes."""
    @lru_cache(maxsize=None)
    def walk(prefix: tuple, models: tuple, left: int) -> tuple:
        law: dict[tuple, float] = {}
        rows = [drafts[m](context + prefix) for m in models]
        draws = itertools.product(range(target.vocab), repeat=len(models)) if left else [()]
        for xs in draws:
            prob = float(np.prod([float(r[x]) for r, x in zip(rows, xs)]))
            if prob == 0:
                continue
            p, reach = target(context + prefix), prob
            for x, row in zip(xs, rows):
                accept, residual, _ = sibling_round(p, x, row, False)
                if reach * accept > 0:
                    pool = tuple(m for m, y in zip(models, xs) if y == x)
                    for tail, pt in walk(prefix + (x,), pool, left - 1):
                        law[(x,) + tail] = law.get((x,) + tail, 0.0) + reach * accept * pt
                reach *= 1.0 - accept
                p = residual
            for y, py in enumerate(p.tolist()):
                if reach * py > 0:
                    law[(y,)] = law.get((y,), 0.0) + reach * py
        return tuple(law.items())

    return dict(walk((), tuple(range(len(drafts))), gamma))


@pytest.mark.parametrize("vocab,num_models,gamma", [(2, 3, 3), (3, 2, 2), (4, 2, 2)])
def test_multi_draft_tree_is_lossless_exactly(vocab, num_models, gamma):
    target = ToyModel(vocab, 1, sparse=True)
    drafts = [ToyModel(vocab, 10 + j) for j in range(num_models)]
    law = complete(multi_draft_law(target, drafts, (0,), gamma), target, (0,), gamma + 1)
    joint = target_joint(target, (0,), gamma + 1)
    assert max(abs(law.get(s, 0.0) - p) for s, p in joint.items()) < 1e-9


# ----------------------------------------------------------------------------------------------
# End to end: the torch implementation, iterated to 3 tokens, chi-square


def draw_tree(target, draft, context, shape, scheme, generator):
    """A static tree drawn as ``TreeDrafter`` does; returns tokens, parents, probs, target rows."""
    tokens, parents, probs = [], [], []
    level = [-1]
    for branching in shape:
        nxt = []
        for parent in level:
            path = () if parent < 0 else path_of(tokens, parents, parent)
            q = draft(context + path).float()
            if scheme == "topk":
                picked = torch.argsort(q, descending=True)[:branching].tolist()
            else:
                count = branching if scheme == "iid" else min(branching, int((q > 0).sum()))
                picked = torch.multinomial(q, count, replacement=scheme == "iid",
                                           generator=generator).tolist()
            for token in picked:
                nxt.append(len(tokens))
                tokens.append(token), parents.append(parent), probs.append(q)
        level = nxt
    return tokens, parents, (None if scheme == "topk" else torch.stack(probs).double())


def path_of(tokens, parents, node):
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return tuple(reversed(path))


def sample_tokens(target, draft, shape, scheme, without_flag, generator, length=3):
    emitted: tuple = ()
    while len(emitted) < length:
        context = (0,) + emitted
        tokens, parents, probs = draw_tree(target, draft, context, shape, scheme, generator)
        slot_of, slot_tokens, slot_parents = merge_duplicates(tokens, parents)
        slot_paths = [path_of(slot_tokens, slot_parents, s) for s in range(len(slot_tokens))]
        rows = torch.stack([target(context)] + [target(context + p) for p in slot_paths])
        verdict = tree_verify(tokens, parents, slot_of, probs, rows, without_flag, generator)
        emitted += tuple(tokens[n] for n in verdict.nodes) + (verdict.next_token,)
    return emitted[:length]


def chi_square_of(scheme, shape, without_flag, draws) -> ChiSquare:
    target, draft = ToyModel(3, 1), ToyModel(3, 101)   # fixed-q TV 0.31 here (exact, 1 step)
    generator = torch.Generator().manual_seed(11)
    counts: dict[tuple, int] = {}
    for _ in range(draws):
        key = sample_tokens(target, draft, shape, scheme, without_flag, generator)
        counts[key] = counts.get(key, 0) + 1
    joint = target_joint(target, (0,), 3)
    keys = sorted(joint)
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    expected = np.array([joint[k] for k in keys]) * draws
    return chi_square(observed, expected)


DRAWS = 2000


@pytest.mark.parametrize("scheme,shape", [("iid", (2, 2)), ("without", (2, 2)),
                                          ("topk", (2, 1))])
def test_tree_verify_matches_the_target_law_end_to_end(scheme, shape):
    assert chi_square_of(scheme, shape, scheme == "without", DRAWS).pvalue > ALPHA


def test_chi_square_rejects_the_wrong_rule_at_the_same_draws():
    """Power: without-replacement siblings verified with the fixed-q rule (the real
    ``tree_verify`` told the wrong scheme) are caught, with an estimated power of at least 0.99
    at these draws."""
    result = chi_square_of("without", (2, 2), False, DRAWS)
    assert result.pvalue < ALPHA and result.power() >= 0.99, result


# ----------------------------------------------------------------------------------------------
# Greedy losslessness, EOS and budget inside a branch

PROMPTS = [[3], [3, 4, 5, 6, 7], [200, 13, 99]]
CONFIGS = [("tree", dict(shape="3-2-1")), ("tree", dict(shape=[[0], [1], [0, 0], [1, 0], [1, 1]])),
           ("tree", dict(width=3, depth=5, total_tokens=12, confidence_threshold=0.05)),
           ("specinfer", dict(num_drafts=2, num_draft_tokens=3))]   # + YAML defaults: test_methods


REFERENCE: dict[tuple, tuple] = {}


def vanilla(pair, prompt, n):
    key = (id(pair.target), tuple(prompt), n)
    if key not in REFERENCE:
        REFERENCE[key] = vanilla_tokens(pair, prompt, n)
    return REFERENCE[key]


@pytest.mark.parametrize("kind", ["same", "related", "unrelated"])
@pytest.mark.parametrize("name,kw", CONFIGS)
def test_greedy_trees_equal_vanilla(tiny_pairs, kind, name, kw):
    pair = tiny_pairs[kind]
    m = build_method(name, pair, **kw)
    for prompt in PROMPTS[1:]:
        assert generate(m, prompt, 20).tokens == vanilla(pair, prompt, 20)


@pytest.mark.parametrize("name,kw", [("tree", {}), CONFIGS[0], CONFIGS[3]])
def test_eos_and_budget_inside_a_branch(tiny_pairs, name, kw):
    pair = tiny_pairs["same"]                     # everything accepted: deep paths are committed
    free = vanilla(pair, PROMPTS[1], 30)
    for n in (1, 2, 3, 5):
        assert generate(build_method(name, pair, **kw), PROMPTS[1], n).tokens == free[:n]
    eos = free[4]
    stopped = generate(build_method(name, pair, eos_token_ids=[eos], **kw), PROMPTS[1], 30)
    assert stopped.tokens == free[: free.index(eos) + 1]


def test_several_draft_models(tmp_path):
    pair = load_pair({"kind": "tiny", "seed": 0}, [{"kind": "same"}, {"kind": "tiny", "seed": 1}])
    assert len(pair.drafts) == 2 and pair.draft is pair.drafts[0] is pair.target
    m = build_method("specinfer", pair, num_drafts=1, num_draft_tokens=3)
    out = generate(m, PROMPTS[1], 20)
    assert out.tokens == vanilla(pair, PROMPTS[1], 20)
    assert out.stats.draft_forwards > 0 and out.stats.draft_forwards % 2 == 0   # both drafts
    with pytest.raises(ValueError, match="takes one draft model, got 2"):
        build_method("speculative", pair)


# ----------------------------------------------------------------------------------------------
# KV cache: the accepted path's rows are kept, the rest dropped


@pytest.mark.parametrize("name,kw", [("tree", dict(shape="3-2-1")), ("tree", {}),
                                     ("specinfer", dict(num_drafts=3, num_draft_tokens=3))])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_target_cache_equals_a_reencoded_prefix(monkeypatch, name, kw, temperature):
    import decoding.target_cache as loop   # where the eager target cache is made
    pair = tiny_pair("related")
    caches = []
    monkeypatch.setattr(loop, "new_cache", lambda model, *a: caches.append(new_cache(model, *a))
                        or caches[-1])
    m = build_method(name, pair, temperature=temperature, eos_token_ids=[], **kw)
    committed = list(PROMPTS[1])
    accepted = 0
    for step in m.stream(torch.tensor(committed), 20):
        committed += step.tokens
        accepted += step.accepted
        cache = caches[0]
        length = cache.get_seq_length()
        assert length == len(committed) - 1
        fresh = DynamicCache(config=pair.target.config)      # transformers' own cache
        with torch.no_grad():
            pair.target(torch.tensor([committed[:-1]]), **cache_argument(pair.target, fresh), use_cache=True)
        for mine, ref in zip(cache.layers, fresh.layers):
            assert isinstance(mine, ReservedLayer)      # rows kept in place in reserved storage
            assert torch.allclose(mine.keys, ref.keys, atol=1e-5)
            assert torch.allclose(mine.values, ref.values, atol=1e-5)
    assert accepted > 0


# ----------------------------------------------------------------------------------------------
# Drafters, statistics, shapes and search spaces


def test_dynamic_tree_structure_and_statistics(tiny_pairs):
    m = build_method("tree", tiny_pairs["related"], width=3, depth=4, total_tokens=7)
    steps = list(m.stream(torch.tensor(PROMPTS[1]), 30))
    for s in steps[:-1]:
        assert s.drafted <= 7 and len(s.level_sizes) <= 4 and sum(s.level_sizes) == s.drafted
        assert s.draft_forwards <= 4 and s.accepted <= len(s.level_sizes)
    stats = generate(m, PROMPTS[1], 30).stats
    assert stats.extras["tree_size"] == stats.drafted
    assert sum(stats.drafted_per_position) == stats.drafted
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1]


def eagle2_tree_node_by_node(source, context, width: int, depth: int, total_tokens: int):
    """EAGLE-2's dynamic tree computed one node at a time: every level expands the ``width``
    frontier nodes of best joint log-probability (ties: older node first) into their ``width``
    most likely children each, and the tree keeps the ``total_tokens`` best nodes."""
    def children(logits):
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1), width)
        return top.indices.tolist(), top.values.tolist()

    tokens, score = children(source.root(context))
    parents, depths, frontier = [-1] * width, [1] * width, list(range(width))
    for level in range(2, depth + 1):
        logits = source.extend(frontier, tokens, parents, depths)
        created = []
        for i, node in enumerate(frontier):
            for token, logq in zip(*children(logits[i])):
                created.append(len(tokens))
                tokens.append(token), parents.append(node), depths.append(level)
                score.append(score[node] + logq)
        frontier = sorted(created, key=lambda n: (-score[n], n))[:width]
    source.finish()
    keep = sorted(sorted(range(len(tokens)), key=lambda n: (-score[n], n))[:total_tokens])
    index = {node: i for i, node in enumerate(keep)}
    return [tokens[n] for n in keep], [index.get(parents[n], -1) for n in keep]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_dynamic_tree_expands_every_frontier_node_by_its_own_logits(tiny_pairs, prompt):
    """The drafter scores a whole frontier in one batched topk: the tree must be the one built
    node by node (a wrong row per node would still verify losslessly, so only this catches it)."""
    from decoding.base import DraftContext
    m = build_method("tree", tiny_pairs["unrelated"], width=3, depth=4, total_tokens=9)
    context = DraftContext(torch.tensor(prompt), budget=8, generator=None)
    m.drafter.reset()
    draft = m.drafter.propose(context)
    m.drafter.reset()
    tokens, parents = eagle2_tree_node_by_node(m.drafter.source, context, 3, 4, 9)
    assert len(set(zip(tokens, parents))) == 9                          # a real tree, no repeats
    assert (draft.tokens.tolist(), draft.parents.tolist()) == (tokens, parents)


def test_confidence_threshold_stops_growing(tiny_pairs):
    pair = tiny_pairs["related"]
    free = generate(build_method("tree", pair, shape="2-2-1-1"), PROMPTS[1], 20).stats
    stopped = generate(build_method("tree", pair, shape="2-2-1-1", confidence_threshold=0.5),
                       PROMPTS[1], 20).stats
    assert stopped.draft_forwards < free.draft_forwards
    assert stopped.drafted < free.drafted


def test_static_shapes_expand_as_declared():
    assert shape_paths((2, 1)) == [(0,), (1,), (0, 0), (1, 0)]
    assert len(shape_paths("3-2-1")) == 3 + 6 + 6
    assert all(shape_paths(name) for name in SHAPES)
    with pytest.raises(ValueError, match="needs its parent"):
        shape_paths([[0], [0, 1]])
    with pytest.raises(ValueError, match="shape='bush' is unknown"):
        shape_paths("bush")


def test_merge_duplicates_keeps_parents_first():
    slot_of, tokens, parents = merge_duplicates([5, 5, 7, 8, 8], [-1, -1, 0, 1, 0])
    assert slot_of == [0, 0, 1, 2, 2] and tokens == [5, 7, 8] and parents == [-1, 0, 0]


def test_categorical_and_float_heuristics_are_value_lists():
    from tuner.search.space import search_values
    space = {"shape": {"type": "categorical", "choices": ["a", "b", "c"],
                       "heuristic": {"HH": ["a", "c"]}},
             "threshold": {"type": "float", "low": 0.0, "high": 0.5, "step": 0.1,
                           "heuristic": {"HH": [0.0, 0.2]}},
             "depth": {"type": "int", "low": 1, "high": 8, "heuristic": {"HH": [2, 4]}}}
    assert search_values(space, "heuristic", "HH") == {"shape": ["a", "c"],
                                                       "threshold": [0.0, 0.2], "depth": [2, 3, 4]}


def test_bad_tree_settings_are_rejected(tiny_pairs):
    pair = tiny_pairs["same"]
    with pytest.raises(ValueError, match="siblings='random' is unknown"):
        build_method("tree", pair, siblings="random")
    with pytest.raises(ValueError, match="width=0 is invalid"):
        build_method("tree", pair, width=0)
    with pytest.raises(ValueError, match="confidence_threshold=1.5 is invalid"):
        build_method("tree", pair, confidence_threshold=1.5)
    with pytest.raises(ValueError, match="num_drafts=0 is invalid"):
        build_method("specinfer", pair, num_drafts=0)


@pytest.mark.parametrize("name,kw", [("speculative", {}), ("tree", dict(shape="3-2-1"))])
def test_feature_drafters_receive_the_targets_hidden_states(tiny_pairs, name, kw):
    """A drafter that sets ``needs_hidden`` is first asked after the prefill and gets the target's
    last-layer states of every row the target fed and kept since (the whole prompt first, then
    the token before the step and the accepted path), aligned with committed positions."""
    pair = tiny_pairs["related"]
    m = build_method(name, pair, **kw)
    seen = []

    class Recording(Drafter):
        needs_hidden = True

        def __init__(self, inner):
            self.inner = inner

        def reset(self):
            self.inner.reset()

        def commit(self, num_valid):
            self.inner.commit(num_valid)

        def observe(self, draft, verdict, logits):
            return self.inner.observe(draft, verdict, logits)

        def propose(self, context):
            seen.append((context.ids.tolist(), context.hidden))
            return self.inner.propose(context)

    m.drafter = Recording(m.drafter)
    generate(m, PROMPTS[1], 16)
    assert len(seen) > 2 and all(hidden is not None for _, hidden in seen)
    assert seen[0][1].shape[0] == len(PROMPTS[1]) and len(seen[0][0]) == len(PROMPTS[1]) + 1
    fed = 0
    for ids, hidden in seen:
        fed += hidden.shape[0]
        assert fed == len(ids) - 1                     # no committed position missed or repeated
        with torch.no_grad():
            states = pair.target(torch.tensor([ids]), output_hidden_states=True).hidden_states
        rows = hidden.shape[0]
        assert torch.allclose(hidden, states[-1][0, -(rows + 1):-1], atol=1e-5)


@pytest.mark.real_model
def test_trees_equal_vanilla_on_the_default_model(default_pair, gsm8k_questions):
    from decoding import encode_prompt
    prompts = [encode_prompt(default_pair.tokenizer, q) for q in gsm8k_questions[:2]]
    reference = [generate(build_method("vanilla", default_pair), p, 48).tokens for p in prompts]
    for name, kw in (("tree", {}), ("tree", dict(shape="2-2")), ("specinfer", {})):
        outs = [generate(build_method(name, default_pair, **kw), p, 48) for p in prompts]
        assert [o.tokens for o in outs] == reference, (name, kw)
        assert 0 < sum(o.stats.accepted for o in outs) < sum(o.stats.drafted for o in outs)


# ----------------------------------------------------------------------------------------------
# SpecInfer's draft sampler: one uniform per row instead of one exponential per vocabulary entry


def test_inverse_cdf_never_picks_a_token_without_probability():
    from decoding.sampling import invert_cdf
    probs = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.5, 0.0]])
    picks = [int(invert_cdf(probs, torch.tensor([[u]]))[0]) for u in (0.0, 0.25, 0.4999, 0.5,
                                                                       0.9999999, 1.0)]
    assert picks == [2, 2, 2, 4, 4, 4]      # u = 1.0: a product rounded up to the total


def sample_rows_chi_squares(n: int = 20000) -> tuple[list[ChiSquare], int]:
    """``sample_rows`` on three rows of 12 tokens with two exact zeros: each row's chi-square on
    its tokens of positive probability, and how many draws hit a zero-probability token."""
    from decoding.sampling import sample_rows
    generator = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(3, 12, generator=generator) * 2, -1)
    probs[:, [0, 7]] = 0.0
    probs /= probs.sum(-1, keepdim=True)                                   # [3, 12]
    draws = torch.stack([sample_rows(probs, generator) for _ in range(n)])  # [n, 3]
    results, impossible = [], 0
    for row in range(3):
        counts = torch.bincount(draws[:, row], minlength=12)
        keep = probs[row] > 0
        impossible += int(counts[~keep].sum())
        results.append(chi_square(counts[keep].numpy(), probs[row][keep].double().numpy()))
    return results, impossible


def test_sample_rows_follows_each_row_law():
    results, impossible = sample_rows_chi_squares()
    assert impossible == 0
    assert all(r.pvalue > ALPHA for r in results), results


def test_the_row_law_check_rejects_an_off_by_one_cdf_inversion():
    """The real ``invert_cdf`` mutated to return the next token: every row's chi-square (on the
    tokens of positive probability alone) rejects it with an estimated power of at least 0.99."""
    with mutated("cdf-off-by-one"):
        results, _ = sample_rows_chi_squares()
    assert all(r.pvalue < ALPHA and r.power() >= 0.99 for r in results), results
