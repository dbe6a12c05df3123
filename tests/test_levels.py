"""Per-level numbers of an engine trial (tuner/measure/levels.py) on hand-computed examples:
throughput over the distinct batches' wall time, the per-request speedup (end to end and of the
decode phase), TPOT from the server's decode time, acceptance, and the geometric mean over
levels."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tuner.measure.evaluator import Paired
from tuner.measure.levels import level_summary, throughput, tpot_ms
from tuner.measure.measurement import Measurement, paired_decode_speedup
from decoding.acceptance import AcceptanceCounts
from tuner.measure.intervals import lower_bound


def run(tokens, wall_s, level=1, batch_wall_s=None, speedup=None, decode_s=None, steps=1,
        drafted=0, accepted=0):
    return Measurement(prompt_id="p", category="", tokens=tuple(range(tokens)), text="",
                       wall_s=wall_s, counts=AcceptanceCounts(steps=steps, prefills=1,
                                                              drafted=drafted, accepted=accepted),
                       draft_time_s=0.0, verify_time_s=0.0, speedup=speedup, concurrency=level,
                       batch_wall_s=batch_wall_s, decode_s=decode_s,
                       decode_tokens=tokens - 1 if decode_s is not None else None)


def paired(index, method, baseline):
    """As the paired protocol records it: the method's decode-phase speedup over its baseline."""
    return Paired(index, replace(method, decode_speedup=paired_decode_speedup(baseline, method)),
                  baseline, True)


def pairs():
    level_1 = [   # two requests one after another: each its own batch
        paired(0, run(10, 1.0, 1, 1.0, speedup=2.0, decode_s=0.5, steps=5, drafted=10,
                      accepted=5),
               run(10, 2.0, 1, 2.0, decode_s=1.8, steps=10)),
        paired(1, run(20, 2.0, 1, 2.0, speedup=1.5, decode_s=1.0, steps=8, drafted=10,
                      accepted=10),
               run(20, 3.0, 1, 3.0, decode_s=2.7, steps=20))]
    level_4 = [   # four requests in flight together: one batch of 4.0 s (method), 8.0 s (vanilla)
        paired(i, run(10, 3.5 + i * 0.1, 4, 4.0, speedup=2.0, decode_s=1.0, steps=4,
                      drafted=8, accepted=6),
               run(10, 7.0 + i * 0.1, 4, 8.0, decode_s=2.0, steps=10)) for i in range(4)]
    return level_1 + level_4


def test_the_level_summary_equals_the_hand_computed_numbers():
    out = level_summary(pairs())
    expected = {
        "tokens_per_s@c1": 30 / 3.0, "vanilla_tokens_per_s@c1": 30 / 5.0,
        "throughput_ratio@c1": 10.0 / 6.0, "speedup@c1": math.sqrt(2.0 * 1.5),
        "tpot_ms@c1": 1e3 * 1.5 / 30, "vanilla_tpot_ms@c1": 1e3 * 4.5 / 30,
        "decode_speedup@c1": math.sqrt((1.8 / 0.5) * (2.7 / 1.0)),   # same tokens after the first
        "acceptance_rate@c1": 15 / 20, "mean_accepted_tokens@c1": 1 + 15 / 13,
        "decode_tokens_per_step@c1": 1 + 15 / 11,     # each request's prefill forward left out
        "tokens_per_s@c4": 40 / 4.0, "vanilla_tokens_per_s@c4": 40 / 8.0,
        "throughput_ratio@c4": 2.0, "speedup@c4": 2.0,
        "tpot_ms@c4": 1e3 * 4.0 / 40, "vanilla_tpot_ms@c4": 1e3 * 8.0 / 40,
        "decode_speedup@c4": 2.0 / 1.0,
        "acceptance_rate@c4": 24 / 32, "mean_accepted_tokens@c4": 1 + 24 / 16,
        "decode_tokens_per_step@c4": 1 + 24 / 12,
        "throughput_ratio": math.sqrt(10.0 / 6.0 * 2.0),
        # one-sided 95 % lower bounds over the independent units: the requests at c1, the
        # batches at c4 (one batch: no bound)
        "speedup_lcb@c1": lower_bound([2.0, 1.5]),
        "decode_speedup_lcb@c1": lower_bound([1.8 / 0.5, 2.7 / 1.0]),
        "throughput_ratio_lcb@c1": lower_bound([(10 / 1.0) / (10 / 2.0), (20 / 2.0) / (20 / 3.0)]),
        "speedup_lcb@c4": 0.0, "decode_speedup_lcb@c4": 0.0,
        "throughput_ratio_lcb@c4": 0.0,
    }
    assert out.keys() == expected.keys()
    for key, value in expected.items():
        assert out[key] == pytest.approx(value, rel=1e-12), key


def test_a_levels_bounds_are_over_its_batches_not_its_requests():
    """At concurrency 2 the two requests of a batch share its schedule: four requests in two
    batches whose ratios move together are two observations. The bounds (the study's and the
    A/A control's) are those of the batches' geometric means, not of four requests (whose
    interval would be as narrow as if four independent pairs agreed)."""
    from tuner.measure.control import level_rows
    from tuner.measure.intervals import log_interval
    from tuner.measure.measurement import summarize
    ratios = [(1.30, 1.32), (0.90, 0.91), (1.10, 1.12)]     # per batch, both requests alike
    group = [paired(2 * b + j, run(10, 1.0, 2, 1.0, speedup=r, decode_s=0.5),
                    run(10, r, 2, r, decode_s=0.5 * r))
             for b, batch in enumerate(ratios) for j, r in enumerate(batch)]
    means = [math.sqrt(a * b) for a, b in ratios]
    out = level_summary(group)
    assert out["speedup_lcb@c2"] == pytest.approx(lower_bound(means), rel=1e-12)
    assert out["decode_speedup_lcb@c2"] == pytest.approx(lower_bound(means), rel=1e-12)
    assert out["speedup_lcb@c2"] < lower_bound([r for batch in ratios for r in batch])
    import torch
    overall = summarize([p.method for p in group], None, torch.device("cpu"))
    assert overall["speedup_lcb"] == pytest.approx(lower_bound(means), rel=1e-12)
    row = next(r for r in level_rows(group) if r.figure == "end to end")
    assert row.interval.n == 3
    assert row.interval.low == pytest.approx(log_interval(means).low, rel=1e-12)


def test_a_batch_counts_its_wall_time_once_and_runs_without_one_count_their_own():
    four = [run(10, 3.0, 4, 4.0) for _ in range(4)]
    assert throughput(four) == pytest.approx(40 / 4.0)            # not 40 / 16
    alone = [run(10, 2.0), run(30, 3.0)]                          # no batch: own wall time
    assert throughput(alone) == pytest.approx(40 / 5.0)
    twice = [run(10, 3.0, 2, 4.0) for _ in range(4)]              # two batches of 2, 4.0 s each
    assert throughput(twice) == pytest.approx(40 / 8.0)


def test_tpot_without_the_servers_decode_time_is_not_a_number():
    assert math.isnan(tpot_ms([run(10, 1.0)]))
    assert tpot_ms([run(10, 1.0, decode_s=0.25), run(10, 1.0)]) == pytest.approx(25.0)
