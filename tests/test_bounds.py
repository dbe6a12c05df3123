"""Physical bounds (tuner.measure.bounds): a paired figure beyond the method's tokens per decode
step is measured again, then fails its trial; it never ranks, wins or reaches a summary line."""

from __future__ import annotations

from dataclasses import replace

import pytest
from optuna.trial import TrialState

from decoding import generate
from decoding.acceptance import AcceptanceCounts
from tests.conftest import FAST, load_study, run_study
from tuner.measure.bounds import Beyond, batch_length, beyond, rate_beyond, slack_for
from tuner.measure.measurement import Measurement

pytestmark = pytest.mark.usefixtures("in_tmp")


def request(tokens: int, accepted: int, speedup: float, decode: float | None = None,
            waited: float = 0.0) -> Measurement:
    return Measurement("p", "", tuple(range(tokens)), "", 1.0,
                       AcceptanceCounts(steps=tokens - accepted, prefills=1, accepted=accepted),
                       0.0, 0.0, speedup=speedup, decode_speedup=decode, waited_s=waited)


def test_a_speedup_beyond_the_tokens_per_decode_step_is_impossible():
    """33 tokens, 8 accepted: 32 tokens after the first in 24 decode steps, L = 4/3; the decode
    phase may read up to L x 1.25 = 1.667x, not 18.6x (the disturbed trial of the issue)."""
    fine = request(33, 8, speedup=1.3, decode=1.6)
    assert batch_length([fine]) == pytest.approx(1 + 8 / 24)
    assert beyond([fine], 0.25) == []
    disturbed = request(33, 8, speedup=1.3, decode=18.614, waited=21.0)
    found, = beyond([disturbed], 0.25)
    assert found.figure == "decode-phase speedup" and found.bound == pytest.approx(5 / 3)
    assert "after waiting 21 s for a quiet machine" in found.line()   # a wait is checked too
    # nothing accepted: an end-to-end 1.32x is impossible however the prefill was timed
    nothing, = beyond([request(33, 0, speedup=1.319, decode=0.877)], 0.25)
    assert nothing.figure == "end-to-end speedup" and nothing.length == 1.0


def test_in_a_batch_every_request_is_bound_by_the_fastest_one():
    """At several requests in flight a request's last steps may run in a smaller batch once its
    neighbours finished: the batch's largest L bounds all of them."""
    slow = request(33, 0, speedup=1.5, decode=1.5)
    fast = request(33, 16, speedup=2.0, decode=2.0)          # L = 1 + 16 / 16 = 2
    assert beyond([slow], 0.25) and not beyond([slow, fast], 0.25)


def test_rates_and_the_slack():
    assert rate_beyond({"tpot_ratio@r2": 1.2, "throughput_ratio@r2": 1.0, "goodput@r2": 9.0},
                       1.0, 0.25) == []
    assert len(rate_beyond({"tpot_ratio@r2": 1.4}, 1.0, 0.25)) == 1
    assert slack_for(None) == 0.25 and slack_for(0.01) == 0.25
    assert slack_for(0.1) == pytest.approx(0.4918, abs=1e-4)     # e^(4 x 0.1) - 1


class DisturbedClock:
    """1 ms per target forward (0.4 ms per draft forward), the first step (the prefill) 1 ms;
    vanilla's runs beside the method of γ = ``gamma`` (after it ran) took ``factor`` times
    longer: a sibling process disturbed that trial's baseline side.

    Every time is planted, the first step's too: the decode phase is the planted total less
    the generation's real first step otherwise, which a loaded machine can make a few planted
    milliseconds or less (an undisturbed trial then read 6.9x in its decode phase)."""

    def __init__(self, gamma: int, factor: float) -> None:
        self.gamma, self.factor, self.last = gamma, factor, None

    def __call__(self, method, ids, max_new_tokens, device):
        out = generate(method, ids, max_new_tokens)
        scale = 1.0
        if type(method).__name__ != "Vanilla":
            self.last = method.num_draft_tokens
        elif self.last == self.gamma:
            scale = self.factor
        seconds = scale * (out.stats.steps + 0.4 * out.stats.draft_forwards) * 1e-3
        planted = replace(out, stats=replace(out.stats, first_step_s=scale * 1e-3))
        return planted, seconds


def test_a_disturbed_trial_fails_and_cannot_win(tmp_path, capsys):
    """Trial 1's vanilla side is planted 20x slower (on its first measurement and on the second
    one the bound asks for): its speedups read ~20x at ~1 token per decode step. It fails with
    the reason, is not the winner, and its figure appears in no summary line."""
    result = run_study(tmp_path, *FAST, "search=grid", "search.ranges=full",
                       "method.space.num_draft_tokens.high=3",
                       "method.params.num_draft_tokens=2", "tracking=none", "task.n_held_out=2",
                       timer=DisturbedClock(3, 20.0))
    study = load_study(tmp_path)
    failed = study.get_trials(states=(TrialState.FAIL,))
    assert [t.user_attrs.get("error_kind") for t in failed] == ["impossible"]
    assert failed[0].params["num_draft_tokens"] == 3
    assert "impossible measurement, twice" in failed[0].user_attrs["error"]
    assert result["trial"] != failed[0].number
    out = capsys.readouterr().out
    summary = out[out.index("=" * 78):]
    assert "impossible:" in out and "measuring this batch again" in out
    best = [line for line in summary.splitlines() if line.startswith("best trial")]
    assert best and f"#{failed[0].number}," not in best[0]
    assert all(v < 5 for t in study.get_trials(states=(TrialState.COMPLETE,))
               for v in t.values)
