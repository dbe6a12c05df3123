"""``decoding.acceptance.AcceptanceCounts``: the one definition of what was accepted, and the
places that read it (generation statistics, measurements, levels, engine counters, windows)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from decoding.acceptance import AcceptanceCounts, total, variance_of

ROOT = Path(__file__).resolve().parents[1]


def test_each_length_names_its_step():
    """Two requests of 11 tokens, 3 accepted in the first (the prefill's forward, which verified
    a draft) and 5 later: 8 forwards each side... tokens per forward counts the prefill, tokens
    per decode step leaves the prefill forwards and what they accepted out."""
    c = AcceptanceCounts(steps=14, prefills=2, drafts=10, drafted=30, accepted=8,
                         accepted_per_position=(6, 2), prefill_accepted=3)
    assert c.tokens_per_forward == pytest.approx(1 + 8 / 14)
    assert c.decode_steps == 12
    assert c.tokens_per_decode_step == pytest.approx(1 + 5 / 12)
    assert c.acceptance_rate == pytest.approx(8 / 30)
    assert c.tokens_per_draft == pytest.approx(1 + 8 / 10)
    assert c.drafted_per_decode_step == pytest.approx(30 / 12)
    assert c.position_rates() == pytest.approx((0.6, 0.2))        # of the drafts (D = 10)
    assert c.step_fractions() == pytest.approx((6 / 12, 2 / 12))
    assert c.draft_fractions() == pytest.approx((0.6, 0.2))


def test_no_step_reads_one_token_per_step_and_no_rate():
    """One fallback everywhere: nothing counted accepted nothing."""
    empty = AcceptanceCounts()
    assert empty.tokens_per_forward == empty.tokens_per_decode_step == 1.0
    assert empty.tokens_per_draft == 1.0
    assert empty.acceptance_rate == empty.drafted_per_decode_step == 0.0
    assert empty.step_fractions() == () and empty.step_variance() == 0.0
    assert AcceptanceCounts(steps=1, prefills=1).tokens_per_decode_step == 1.0


def test_the_variance_from_the_positions_equals_the_steps_own():
    """P(X > i) = p_i gives E[X²] = Σ (2i + 1) p_i: the same variance as the steps' counts."""
    rng = np.random.default_rng(0)
    x = np.minimum(5, np.floor(np.log(rng.random(4000)) / np.log(0.6))).astype(int)
    c = AcceptanceCounts(steps=4000, drafts=4000, drafted=4000 * 5, accepted=int(x.sum()),
                         accepted_per_position=tuple(int((x > i).sum()) for i in range(5)))
    assert c.step_variance() == pytest.approx(float(x.var()), rel=1e-9)
    assert c.draft_variance() == pytest.approx(float(x.var()), rel=1e-9)
    assert c.tokens_per_decode_step == pytest.approx(1 + x.mean())
    assert variance_of((1.0, 1.0)) == pytest.approx(0.0)          # always 2 accepted


def test_sums_keep_positions_only_where_they_were_counted():
    """An engine counts positions at concurrency 1 only: a request without them adds its drafts
    to the sum but not to any position's denominator."""
    counted = AcceptanceCounts(steps=5, prefills=1, drafts=4, drafted=12, accepted=6,
                               accepted_per_position=(4, 2))
    uncounted = AcceptanceCounts(steps=5, prefills=1, drafts=4, drafted=12, accepted=2)
    both = total([counted, uncounted])
    assert (both.steps, both.prefills, both.drafts, both.drafted, both.accepted) == \
        (10, 2, 8, 24, 8)
    assert both.position_rates() == pytest.approx((1.0, 0.5))      # 4 and 2 of counted's 4
    assert both.drafted_per_position == (4, 4)
    assert total([]) == AcceptanceCounts()


def test_counters_read_twice_difference_to_the_requests_own():
    later = AcceptanceCounts(steps=50, prefills=3, drafts=20, drafted=80, accepted=30,
                             accepted_per_position=(15, 10, 5))
    earlier = AcceptanceCounts(steps=20, prefills=1, drafts=8, drafted=32, accepted=10,
                               accepted_per_position=(7, 3))
    got = later.minus(earlier)
    assert got == AcceptanceCounts(steps=30, prefills=2, drafts=12, drafted=48, accepted=20,
                                   accepted_per_position=(8, 7, 5))


def names_in(node: ast.AST) -> str:
    return " ".join(n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                    if isinstance(n, (ast.Name, ast.Attribute)))


def by_hand(node: ast.AST) -> bool:
    """``1 + <accepted> / <steps>`` or ``(2 * i + 1) * ...`` written out."""
    if not isinstance(node, ast.BinOp):
        return False
    if isinstance(node.op, ast.Add) and isinstance(node.left, ast.Constant) and \
            node.left.value == 1 and isinstance(node.right, ast.BinOp) and \
            isinstance(node.right.op, ast.Div):
        return "accepted" in names_in(node.right.left) and "steps" in names_in(node.right.right)
    return isinstance(node.op, ast.Mult) and ast.unparse(node.left).replace(" ", "") in (
        "(2*i+1)", "2*i+1")


def test_every_reader_goes_through_the_counts():
    """Decoding statistics, measurements, level summaries, the served prediction, engine counters
    and the watch's windows read their lengths from ``AcceptanceCounts``: no module outside it
    computes ``1 + accepted / steps`` or ``Σ (2i + 1) p_i`` itself."""
    offenders = []
    for folder in ("decoding", "tuner", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "acceptance.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if by_hand(node):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                                     f"{ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


def test_a_generation_measurement_and_window_agree_on_one_run():
    """The same counts read through each holder give the same lengths."""
    from decoding.api import GenerationStats
    from tuner.engines.metrics import Counters
    from tuner.watch.windows import Windower

    stats = GenerationStats(new_tokens=13, steps=5, draft_forwards=8, drafted=16, accepted=8,
                            drafted_per_position=(4, 4, 4, 4),
                            accepted_per_position=(4, 2, 1, 1), accepted_length_hist=(),
                            draft_time_s=0.0, verify_time_s=0.0, first_step_tokens=3,
                            first_step_accepted=2, drafts=4)
    assert stats.mean_accepted_tokens == stats.counts.tokens_per_forward == 1 + 8 / 5
    assert stats.counts.tokens_per_decode_step == 1 + 6 / 4
    before = Counters(drafts=0, draft_tokens=0, accepted=0, accepted_per_pos=(), generated=0,
                      token_seconds=0.0, token_count=0.0, batch=None, requests=0)
    after = Counters(drafts=4, draft_tokens=16, accepted=8, accepted_per_pos=(4, 2, 1, 1),
                     generated=13, token_seconds=1.0, token_count=13.0, batch=1.0, requests=1)
    windower = Windower(min_steps=1)
    window = windower.counts(before, after)
    assert window.decode_steps == 13 - 8 - 1
    assert window.tokens_per_decode_step == pytest.approx(1 + 8 / 4)
