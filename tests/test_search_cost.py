"""A search's cost is said before it starts, refined as it runs and capped (tuner.search.cost);
search=predict's ranking is stored in the study, so a resumed study does not rank again."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ENV, SIDE_BY_SIDE
from tests.helpers.services import sigint_default
from tuner.config.errors import ConfigError
from tuner.search.cost import Estimate, duration


def test_an_estimate_by_hand():
    """3 trials of 40 s, a 2-minute ranking and a 20 s confirmation; a timeout of 50 s left
    bounds the trials' part to the timeout plus the trial running when it passes."""
    e = Estimate(3, 40.0, "test", ranking_s=120.0, finish_s=20.0)
    assert e.trials_s == 120.0 and e.total_s == 260.0
    assert e.describe() == ("~4.3 min (ranking ~2.0 min, 3 trial(s) at ~40 s, held-out "
                            "confirmation ~20 s; from test)")
    bounded = Estimate(3, 40.0, "test", finish_s=20.0, timeout_s=50.0)
    assert bounded.trials_s == 90.0 and "(bounded by search.timeout)" in bounded.describe()
    assert [duration(s) for s in (59, 600, 36_000)] == ["59 s", "10.0 min", "10.0 h"]


def test_the_ranking_estimate_counts_what_the_sweep_runs(tmp_path, tiny_profile):
    """Ouroboros's 30-point grid (γ 2-6 x W 15-20) ranked by untimed runs: halving is priced at
    every point, Algorithm 1 on the predictions (search.untimed=sweep) at one point per value
    swept (5 + 6 = 11), for one method as for a union's member (the bench's single-method sweep
    was estimated at 30 points: +118 %)."""
    import optuna

    from tests.conftest import compose_cfg
    from tuner.search.cost import SearchCost
    from tuner.search.points import Points, make_plan
    from tuner.study.settings import StudySettings
    seconds = {}
    for untimed in ("halving", "sweep"):
        settings = StudySettings.from_config(compose_cfg(
            tmp_path, "method=ouroboros", "search=predict", f"search.profile={tiny_profile}",
            f"search.untimed={untimed}", "method.params.phrase_length=5",
            *[f"method.space.{name}.heuristic.{cls}=[{low},{high}]"
              for name, low, high in (("num_draft_tokens", 2, 6), ("window", 15, 20),
                                      ("phrase_length", 5, 5), ("num_phrases", 3, 3))
              for cls in ("LH", "HH")]))
        study = optuna.create_study(directions=list(settings.directions))
        points = Points(settings, study, make_plan(settings, say=lambda line: None))
        assert len(points.plan.points) == 30
        seconds[untimed] = SearchCost(settings, study, points, lambda line: None).ranking_s(
            [1.0, 2.0], method_s=3.0)
    assert seconds == {"halving": 30 * 3.0, "sweep": 11 * 3.0}


@pytest.mark.parametrize("value", ["0", "-1", "true", "'two'"])
def test_a_bad_cap_is_refused_in_one_line(tmp_path, value):
    from tests.conftest import compose_cfg
    from tuner.study.settings import StudySettings
    with pytest.raises(ConfigError) as err:
        StudySettings.from_config(compose_cfg(tmp_path, f"search.max_hours={value}"))
    assert str(err.value).startswith("search.max_hours=") and "auto (2 without a GPU" in \
        str(err.value) and "\n" not in str(err.value)


def test_the_full_default_ranking_is_refused_before_any_untimed_run(tmp_path, tiny_profile):
    """search=predict over Ouroboros's whole space (search.ranges=full: 16 x 17 x 7 x 5
    = 9,520 points): its estimate (an untimed run per point, priced by the profile) is over the
    cap, so the study is refused in one line naming the estimate and the override, within 60 s
    and before trial 0. With the cap raised the same command starts ranking after trial 0;
    Ctrl-C there keeps trial 0 (and what was predicted) and ends with exit status 130."""
    command = [sys.executable, "-m", "tuner", "+task=gsm8k", "models=tiny", "task.n_prompts=2",
               "task.n_held_out=1", "task.max_new_tokens=6", "warmup_prompts=1", *SIDE_BY_SIDE,
               "tracking=none", "study_name=full", "method=ouroboros", "search=predict",
               "search.ranges=full",
               f"search.profile={tiny_profile}", "search.max_hours=0.002"]
    began = time.monotonic()
    done = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=120)
    took = time.monotonic() - began
    assert done.returncode == 2 and took < 60, (took, done.stdout[-2000:], done.stderr[-2000:])
    errors = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and re.match(
        r"error: search=predict is estimated at ~[0-9.]+ (s|min|h) \(ranking ~[0-9.]+ (s|min|h), "
        r".*\), over search\.max_hours=0\.002: .*raise the cap \(search\.max_hours=[0-9.]+ or "
        r"more, or null for none\)", errors[0]), errors
    assert "search=predict ranks 9520 points by prediction" in done.stdout
    assert "trial 0" not in done.stdout and "predicting" not in done.stdout
    # the override: the cap raised, the study runs trial 0 and starts ranking 9,520 points
    raised = [*command[:-1], "search.max_hours=100"]
    process = subprocess.Popen(raised, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, preexec_fn=sigint_default)
    seen = []
    try:
        for line in process.stdout:
            seen.append(line)
            if line.startswith("search=predict: predicting 9520 points"):
                process.send_signal(signal.SIGINT)
                break
        rest, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    out = "".join(seen) + rest
    assert "search=predict: predicting 9520 points" in out, out[-3000:]
    assert "ranking interrupted: trial 0 and the predictions so far are kept" in out
    assert process.returncode == 130
    from tests.conftest import load_study
    trials = load_study(tmp_path, "full").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"]


@pytest.mark.alone     # times a search: the whole machine, in the serial pass
def test_the_estimate_after_the_first_trial_is_within_30_percent(tmp_path, monkeypatch, capsys):
    """A grid of 5 points on the tiny pair: before the first trial the time is not known (no
    profile); the estimate made after it (elapsed + trials left + the confirmation), kept in the
    study, is within ±30 % of the time the search took; the progress line shows the time left."""
    from tests.conftest import load_study, run_study
    monkeypatch.chdir(tmp_path)
    run_study(tmp_path, "search=grid", "search.ranges=full",
              "method.space.num_draft_tokens.high=5",
              "task.max_new_tokens=24", "tracking=none")
    out = capsys.readouterr().out
    assert "the time is estimated after the first trial" in out
    assert re.search(r"search estimate now: ~[0-9.]+ s \(4 trial\(s\) at ~[0-9.]+ s, held-out "
                     r"confirmation ~[0-9.]+ s; from 1 finished trial\(s\)\)", out), out[-3000:]
    assert re.search(r"\(3 of at most 5 trials, ~[0-9.]+ s left of ~[0-9.]+ s", out)
    study = load_study(tmp_path)
    estimate = study.user_attrs["estimates"]["after_first_trial"]
    actual = study.user_attrs["phase_seconds"]["search_s"][0]
    predicted = estimate["elapsed_s"] + estimate["left_s"]
    assert abs(predicted / actual - 1) <= 0.30, (predicted, actual, estimate)


def test_a_resumed_predict_study_does_not_rank_again(tmp_path, monkeypatch, capsys):
    """Ouroboros does not replay: its ranking makes one untimed run per point and prompt. A first
    run stops after 2 trials (search.n_trials), a second run of the same study with room for
    more restores the stored ranking and ranks nothing: its untimed runs are only the measured
    trials' own predictions (one per prompt each), never the grid's."""
    from tests.conftest import load_study, run_study
    from tests.helpers.counting import count_untimed_runs
    monkeypatch.chdir(tmp_path)
    counted = count_untimed_runs(monkeypatch)
    from tuner import profile as cli
    profile = tmp_path / "tiny.json"
    assert cli.main(["--models", "tiny", "--repeats", "1", "--contexts", "8", "128", "--rows",
                     "1", "4", "8", "16", "32", "--draft-rows", "1", "2", "8", "--out",
                     str(profile)]) == 0
    small = ["method=ouroboros", "method.params.num_draft_tokens=2", "method.params.window=4",
             "method.params.phrase_length=3", "method.params.num_phrases=2",
             "method.space.num_draft_tokens.low=2", "method.space.num_draft_tokens.high=3",
             "method.space.window.low=4", "method.space.window.high=5",
             "method.space.phrase_length.low=3", "method.space.phrase_length.high=3",
             "method.space.num_phrases.low=2", "method.space.num_phrases.high=2",
             "method.params.reuse_history=false", "search=predict", "search.ranges=full",
             "search.top=2", "search.spread=1", "search.race=null", f"search.profile={profile}",
             "tracking=none"]
    run_study(tmp_path, *small, "search.n_trials=2")
    first = capsys.readouterr().out
    assert "search=predict: predicting 4 points" in first
    ranked = sum(counted)
    # successive halving: 4 points on the first prompt, 3 kept (at least 3) for the second
    assert ranked >= 4 + 3, counted
    assert "successive halving: 4 on prompt 1 kept 3, 3 on prompt 2 kept 3" in first
    counted.clear()
    run_study(tmp_path, *small, "search.n_trials=10")
    second = capsys.readouterr().out
    assert "predicting" not in second, second[-2000:]
    trials = load_study(tmp_path).get_trials()
    assert len(trials) == 4 and sorted(t.user_attrs["stage"] for t in trials) == \
        ["default", "spread", "top", "top"]
    assert sum(counted) == 2 * 2, counted       # trials 2 and 3: their own 2 prompts each
    stored = load_study(tmp_path).user_attrs["predict_ranking"]
    assert len(stored["predicted"]) == 4 and json.dumps(stored)
