"""MJSD (method=mjsd): the joint acceptance rule exactly, the draft's beam search against two
references, joint probabilities against independent full forwards, and the degenerate cases.

MJSD is lossy by design (docs/verification.md §4.4), so nothing here compares its law with the
target's; each check is exact instead: recompute the rule from (p̃, q̃, beams, τ) independently and
compare, on enumerable toy models and end to end on tiny random models.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from transformers import DynamicCache

from decoding import build_method, generate
from decoding.base import Drafter
from decoding.mjsd import BeamDrafter
from decoding.sampling import SamplingConfig, logits_to_probs
from decoding.verify import joint_log_ratios, joint_verify, longest_joint_prefix
from tests.conftest import tiny_pair
from tests.helpers.toy import ToyModel

PAPER = dict(temperature=1.0, top_k=20, top_p=0.9)       # App. D warping
PROMPT = [3, 4, 5, 6, 7]


# ----------------------------------------------------------------------------------------------
# The rule on enumerable toy models


def prefix_ratios(sequence, target, draft, context):
    """P(x_{1:i}) / Q(x_{1:i}) for i = 1..γ from plain products of the toy conditionals."""
    p = q = 1.0
    out = []
    for i, token in enumerate(sequence):
        prefix = context + tuple(sequence[:i])
        p *= float(target(prefix)[token])
        q *= float(draft(prefix)[token])
        out.append(p / q)
    return out


def brute_force(ratios, tau, stop_at_first_failure=False):
    """(beam, n) of the rule from per-beam prefix ratios: longest over beams, first on ties."""
    best = (0, 0)
    for w, beam in enumerate(ratios):
        longest = 0
        for i, ratio in enumerate(beam, 1):
            if tau == 0 or min(1.0, ratio) >= tau:
                longest = i
            elif stop_at_first_failure:
                break
        if longest > best[1]:
            best = (w, longest)
    return best


def rows_of(sequences, model, context):
    """[N, γ+1, V] rows: row d of sequence w is model(· | context, x_{w,<d})."""
    return torch.stack([torch.stack([model(context + tuple(seq[:d]))
                                     for d in range(len(seq) + 1)]) for seq in sequences])


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse target"])
def test_the_accepted_prefix_is_the_longest_with_p_over_q_at_least_tau(sparse):
    """Every ordered pair of distinct beams of γ = 3 over V = 3 and four thresholds: the
    implementation equals a brute force of the rule; the first-failure variant differs."""
    target, draft = ToyModel(3, 7, sparse), ToyModel(3, 107)
    context = (0,)
    sequences = list(itertools.product(range(3), repeat=3))
    log_ratios = joint_log_ratios(torch.tensor(sequences),
                                  rows_of(sequences, draft, context)[:, :3],
                                  rows_of(sequences, target, context))              # [27, 3]
    exact = [prefix_ratios(seq, target, draft, context) for seq in sequences]
    assert torch.allclose(log_ratios.exp(), torch.tensor(exact, dtype=torch.float64))
    differs_from_first_failure = 0
    for a, b in itertools.permutations(range(len(sequences)), 2):
        for tau in (0.0, 0.3, 0.9, 1.0):
            expected = brute_force([exact[a], exact[b]], tau)
            assert longest_joint_prefix(log_ratios[[a, b]], tau) == expected, (a, b, tau)
            differs_from_first_failure += expected != brute_force([exact[a], exact[b]], tau,
                                                                   True)
    assert differs_from_first_failure > 0


@pytest.mark.parametrize("greedy", [False, True])      # True: the argmax of the one-hot row
def test_the_next_token_is_drawn_from_the_target_row_after_the_accepted_prefix(greedy):
    vocab, gamma = 12, 3
    target = torch.zeros(2, gamma + 1, vocab)
    for w, d in itertools.product(range(2), range(gamma + 1)):
        target[w, d, 4 * w + d] = 1.0                  # one-hot: row (w, d) names itself
    generator = torch.Generator().manual_seed(0)
    # beam 0 matches for 2 tokens, beam 1 for all 3: beam 1 wins, bonus row (1, 3)
    beam, verdict = joint_verify(torch.tensor([[0, 1, 9], [4, 5, 6]]), None, target, 0.5,
                                 generator, greedy)
    assert (beam, verdict.accepted, verdict.next_token) == (1, 3, 7)
    # beam 1 now fails at its second token (P = 0) but beam 0 still passes 2: row (0, 2)
    beam, verdict = joint_verify(torch.tensor([[0, 1, 9], [4, 9, 6]]), None, target, 0.5,
                                 generator, greedy)
    assert (beam, verdict.accepted, verdict.next_token) == (0, 2, 2)
    # nothing passes: the plain target row after the committed prefix (beam 0, row 0)
    beam, verdict = joint_verify(torch.tensor([[9, 1, 2], [9, 5, 6]]), None, target, 0.5,
                                 generator, greedy)
    assert (beam, verdict.accepted, verdict.next_token) == (0, 0, 0)


# ----------------------------------------------------------------------------------------------
# The draft's beams


def reference_beam_search(model, context, num_beams, width, gamma):
    """Plain beam search: full forwards, no cache; ties by (beam, token)."""
    beams = [((), 0.0)]
    for _ in range(gamma):
        candidates = []
        for b, (seq, score) in enumerate(beams):
            with torch.no_grad():
                logits = model(torch.tensor([context + list(seq)])).logits[0, -1]
            for v, lp in enumerate(torch.log_softmax(logits.float(), -1).tolist()):
                candidates.append((score + lp, b, v, seq + (v,)))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        beams = [(c[3], c[0]) for c in candidates[:num_beams]]
    return beams[:width]


@pytest.mark.parametrize("num_beams,width,gamma", [(4, 3, 3), (6, 6, 4), (1, 1, 5)])
def test_greedy_beam_search_equals_reference_and_transformers(num_beams, width, gamma):
    model = tiny_pair("unrelated").draft
    beams = BeamDrafter(model, SamplingConfig(), num_beams, width, gamma).search(
        torch.tensor(PROMPT), gamma, None)
    joint = beams.log_q.sum(dim=1)
    reference = reference_beam_search(model, PROMPT, num_beams, width, gamma)
    assert beams.tokens.tolist() == [list(seq) for seq, _ in reference]
    assert torch.allclose(joint, torch.tensor([s for _, s in reference]), atol=1e-4)
    beam_kw = dict(length_penalty=0.0, early_stopping=True) if num_beams > 1 else {}
    hf = model.generate(torch.tensor([PROMPT]), num_beams=num_beams, num_return_sequences=width,
                        do_sample=False, max_new_tokens=gamma, min_new_tokens=gamma,
                        eos_token_id=None, pad_token_id=0, output_scores=True,
                        return_dict_in_generate=True, **beam_kw)
    assert torch.equal(hf.sequences[:, len(PROMPT):], beams.tokens)
    if num_beams > 1:                 # (one beam: transformers runs greedy search, no scores)
        assert torch.allclose(hf.sequences_scores, joint, atol=1e-4)


def test_sampled_beams_keep_every_candidate_when_there_are_enough_beams():
    """top-k 2, γ = 3, M = 8: every step keeps all of the 2, 4, 8 candidates, whatever the draws,
    so the beams are the whole warped support, ordered by joint draft probability."""
    model = tiny_pair("unrelated").draft
    sampling = SamplingConfig(temperature=1.0, top_k=2)
    beams = BeamDrafter(model, sampling, 8, 8, 3).search(
        torch.tensor(PROMPT), 3, torch.Generator().manual_seed(3))
    frontier = [((), 0.0)]
    for _ in range(3):
        grown = []
        for seq, score in frontier:
            with torch.no_grad():
                q = logits_to_probs(model(torch.tensor([PROMPT + list(seq)])).logits[0, -1],
                                    sampling)
            grown += [(seq + (v,), score + float(torch.log(q[v]))) for v in
                      torch.nonzero(q).flatten().tolist()]
        frontier = grown
    support = sorted(frontier, key=lambda c: -c[1])
    assert beams.tokens.tolist() == [list(seq) for seq, _ in support]
    assert torch.allclose(beams.log_q.sum(1), torch.tensor([s for _, s in support]), atol=1e-4)


def independent_rows(model, context, beam, sampling):
    """[γ, V] warped rows q̃(· | context, x_<d) from full forwards without a cache."""
    with torch.no_grad():
        logits = torch.stack([model(torch.tensor([context + beam[:d]])).logits[0, -1]
                              for d in range(len(beam))])
    return logits_to_probs(logits, sampling)


def test_joint_draft_probabilities_are_products_of_the_warped_steps():
    model = tiny_pair("related").draft
    sampling = SamplingConfig(**PAPER)
    drafter = BeamDrafter(model, sampling, 6, 4, 4)
    beams = drafter.search(torch.tensor(PROMPT), 4, torch.Generator().manual_seed(1))
    assert beams.tokens.shape[0] >= 2 and beams.forwards == 4
    assert len({tuple(b) for b in beams.tokens.tolist()}) == beams.tokens.shape[0]
    joint = beams.log_q.sum(1)
    assert torch.equal(joint, joint.sort(descending=True).values)          # best first
    for w, beam in enumerate(beams.tokens.tolist()):
        rows = independent_rows(model, PROMPT, beam, sampling)             # [γ, V]
        assert torch.allclose(beams.rows[w], rows, atol=1e-5)
        steps = rows[torch.arange(4), torch.tensor(beam)]
        assert bool((steps > 0).all())                                     # inside the support
        assert torch.allclose(beams.log_q[w].cumsum(0).exp(), steps.cumprod(0), rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# End to end


class Recording(Drafter):
    """Wraps a drafter and keeps every draft with the context it was proposed for."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def reset(self):
        self.inner.reset()

    def commit(self, num_valid):
        self.inner.commit(num_valid)

    def observe(self, draft, verdict, logits):
        return self.inner.observe(draft, verdict, logits)

    def propose(self, context):
        draft = self.inner.propose(context)
        self.seen.append((context.ids.tolist(), draft))
        return draft


def recorded_steps(pair, max_new_tokens=24, **kw):
    m = build_method("mjsd", pair, eos_token_ids=[], **kw)
    m.drafter = Recording(m.drafter)
    steps = list(m.stream(torch.tensor(PROMPT), max_new_tokens))
    return steps, m.drafter.seen


def beams_of(draft):
    count = 1 if draft.parents is None else int((draft.parents < 0).sum())
    return draft.tokens.view(count, -1).tolist()


def test_end_to_end_the_longest_passing_prefix_over_beams_is_committed():
    """Each step's committed prefix equals the rule recomputed from full target and draft
    forwards (no cache, no tree): P and Q are products of warped conditionals."""
    pair, tau = tiny_pair("related"), 0.5
    sampling = SamplingConfig(**PAPER)
    steps, seen = recorded_steps(pair, num_beams=4, width=3, num_draft_tokens=3, tau=tau,
                                 **PAPER)
    accepted_somewhere = rejected_somewhere = 0
    for step, (context, draft) in zip(steps, seen):
        best = (0, 0)
        for w, beam in enumerate(beams_of(draft)):
            p_rows = independent_rows(pair.target, context, beam, sampling)
            q_rows = independent_rows(pair.draft, context, beam, sampling)
            index = torch.arange(len(beam)), torch.tensor(beam)
            ratio = (p_rows[index].cumprod(0) / q_rows[index].cumprod(0)).tolist()
            longest = max([i for i, r in enumerate(ratio, 1) if min(1.0, r) >= tau], default=0)
            best = max(best, (longest, -w))
        n, beam = best[0], beams_of(draft)[-best[1]]
        assert step.accepted == n and list(step.tokens[:n]) == beam[:n]
        with torch.no_grad():
            row = logits_to_probs(pair.target(torch.tensor([context + beam[:n]])).logits[0, -1],
                                  sampling)
        assert row[step.tokens[n]] > 0                     # y ~ p̃(· | accepted prefix)
        accepted_somewhere += n > 0
        rejected_somewhere += n < len(beam)
    assert accepted_somewhere and rejected_somewhere


def test_tau_zero_accepts_every_drafted_prefix_of_the_best_beam():
    steps, seen = recorded_steps(tiny_pair("unrelated"), num_beams=4, width=3,
                                 num_draft_tokens=3, tau=0.0, **PAPER)
    for step, (_, draft) in zip(steps, seen):
        best = beams_of(draft)[0]
        assert step.accepted == len(best) and list(step.tokens[:-1]) == best


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, top_k=1)],
                         ids=["T=0", "top-k 1"])
def test_one_beam_one_width_greedy_warping_is_greedy_speculative_decoding(tiny_pairs, sampling):
    """M = W = 1 under greedy warping: the draft's greedy chain, the longest prefix matching the
    target's argmax, then the argmax; i.e. `speculative` at temperature 0, step for step."""
    for kind in ("related", "unrelated"):
        pair = tiny_pairs[kind]
        mjsd = build_method("mjsd", pair, num_beams=1, width=1, num_draft_tokens=3, tau=0.5,
                            **sampling)
        spec = build_method("speculative", pair, num_draft_tokens=3)
        got = list(mjsd.stream(torch.tensor(PROMPT), 30))
        want = list(spec.stream(torch.tensor(PROMPT), 30))
        assert [(s.tokens, s.accepted, s.drafted) for s in got] == \
            [(s.tokens, s.accepted, s.drafted) for s in want]


def test_beams_sharing_a_prefix_are_one_tree_and_the_cache_keeps_the_accepted_path(monkeypatch):
    import decoding.target_cache as loop   # where the eager target cache is made
    from decoding.runtime import cache_argument, new_cache
    pair = tiny_pair("related")
    caches = []
    monkeypatch.setattr(loop, "new_cache", lambda model, *a: caches.append(new_cache(model, *a))
                        or caches[-1])
    m = build_method("mjsd", pair, num_beams=6, width=4, num_draft_tokens=3, tau=0.3,
                     eos_token_ids=[], **PAPER)
    committed, shared = list(PROMPT), 0
    for step in m.stream(torch.tensor(PROMPT), 20):
        committed += step.tokens
        if step.level_sizes is not None:               # W beams as a tree: shared prefixes merged
            shared += sum(step.level_sizes) < step.extras["tree_draws"]
        fresh = DynamicCache(config=pair.target.config)      # transformers' own cache
        with torch.no_grad():
            pair.target(torch.tensor([committed[:-1]]), **cache_argument(pair.target, fresh), use_cache=True)
        assert caches[0].get_seq_length() == len(committed) - 1
        for mine, ref in zip(caches[0].layers, fresh.layers):
            assert torch.allclose(mine.keys, ref.keys, atol=1e-5)
    assert shared > 0


def test_bad_mjsd_settings_are_rejected(tiny_pairs):
    pair = tiny_pairs["same"]
    with pytest.raises(ValueError, match=r"width \(W\)=5 is invalid: allowed is an integer "
                                         r"between 1 and num_beams=4"):
        build_method("mjsd", pair, num_beams=4, width=5)
    for tau in (1.5, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match=r"tau \(τ\)=.* is invalid: allowed is a number in "
                                             r"\[0, 1\]"):
            build_method("mjsd", pair, tau=tau)
    with pytest.raises(ValueError, match=r"num_beams \(M\)=0 is invalid"):
        build_method("mjsd", pair, num_beams=0)
    with pytest.raises(ValueError, match="method 'mjsd' needs a draft model"):
        build_method("mjsd", dataclasses.replace(pair, draft=None))


@pytest.mark.real_model
def test_mjsd_on_the_default_model_is_greedy_at_temperature_zero(default_pair, gsm8k_questions):
    from decoding import encode_prompt
    prompt = encode_prompt(default_pair.tokenizer, gsm8k_questions[0])
    reference = generate(build_method("vanilla", default_pair), prompt, 16).tokens
    out = generate(build_method("mjsd", default_pair, num_beams=3, width=2), prompt, 16)
    assert out.tokens == reference and out.stats.accepted > 0


@pytest.mark.parametrize("seed", range(20))
def test_best_first_equals_the_first_entries_of_a_stable_sort(seed):
    """The greedy beam pick without a full sort: same indices, same order, ties included, read
    flat or as [B, V] joint scores (rows shorter than ``count`` included)."""
    from decoding.mjsd import best_first
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-4, 4, (300,), generator=g).float()        # many ties at every level
    values[torch.randperm(300, generator=g)[:40]] = float("-inf")
    finite = int(torch.isfinite(values).sum())
    for count in (1, 2, 7, 8, 50, finite):
        expected = torch.sort(values, descending=True, stable=True).indices[:count]
        for shape in ((300,), (3, 100), (12, 25), (300, 1)):
            assert best_first(values.view(shape), count).tolist() == expected.tolist()
