"""What a finished study tells its reader: a recommendation no stronger than its evidence, the
finish step written once, the trials table, the replay's budget line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from tuner.answer.finish import finish_lock
from tuner.answer.verdict import recommendation, relative, self_control
from tuner.tracking.trackers import trials_csv, trials_markdown


def held_out(speed, prompts, low=None, high=None, lcb=None, **extra):
    return {"held_out_speedup": speed, "held_out_prompts": prompts,
            "held_out_speedup_min": speed if low is None else low,
            "held_out_speedup_max": speed if high is None else high,
            "held_out_speedup_lcb": speed if lcb is None else lcb, **extra}


def test_a_win_on_too_few_prompts_is_not_recommended():
    text = recommendation(held_out(1.35, 1), min_held_out=3)
    assert text.startswith("not enough evidence") and "only 1 held-out prompt" in text
    assert "min_held_out_prompts=3" in text and "use the best parameters" not in text


def test_a_win_on_enough_prompts_is_recommended_with_its_spread():
    text = recommendation(held_out(1.25, 3, 1.10, 1.40, lcb=1.05), min_held_out=3)
    assert text.startswith("use the best parameters: 1.25x vanilla (25 % faster than vanilla)")
    assert "on 3 held-out prompts, min 1.10x, max 1.40x, 95 % lower bound 1.05x" in text


def test_a_win_inside_the_noise_is_not_recommended():
    """1.02x on three prompts whose lower bound is below 1 (the A/A finding of vanilla against
    itself: 1.007, 1.077, 0.953): keep vanilla; an A/A control's bias raises the bar."""
    from tuner.measure.intervals import lower_bound
    values = [1.007, 1.077, 0.953]
    lcb = lower_bound(values)
    assert lcb < 1.0
    text = recommendation(held_out(1.015, 3, 0.953, 1.077, lcb=lcb), min_held_out=3)
    assert text.startswith("not beyond the noise") and "keep vanilla decoding" in text
    assert "use the best parameters" not in text
    beyond = recommendation(held_out(1.2, 3, lcb=1.04), min_held_out=3, margin=0.05)
    assert beyond.startswith("not beyond the noise") and "bias 5.0 %" in beyond
    assert recommendation(held_out(1.2, 3, lcb=1.06), 3, margin=0.05).startswith("use the best")


def test_a_setting_that_accepted_nothing_is_never_recommended():
    """The CNN/DM llama.cpp study re-run: ngram-map-k accepted nothing on the held-out prompts
    (1.00 tokens per decode step) and read 1.025x in the decode phase with a lower bound of
    1.002 (its server process ran a little faster than the baseline's): no gain can come from
    speculation, so the level is OFF and the verdict keeps vanilla."""
    from tuner.answer.decide import level_decision
    from tuner.answer.outcome import State
    study = levels_study((SIMPLE, {1: 1.183}))
    nothing = {**held_at(1, 1.025, 1.002), "held_out_decode_tokens_per_step@c1": 1.0}
    decision = level_decision(level_settings((1,)), study, nothing, 1, winner=0)
    assert decision.state is State.OFF and "1.00 tokens per decode step" in decision.reason
    some = {**held_at(1, 1.3, 1.1), "held_out_decode_tokens_per_step@c1": 1.05}
    assert level_decision(level_settings((1,)), study, some, 1, winner=0).state is State.ON
    text = recommendation(held_out(1.025, 3, lcb=1.002, held_out_decode_tokens_per_step=1.0),
                          min_held_out=3)
    assert text.startswith("not beyond the noise") and "accepted 1.00 tokens per decode" in text


def test_vanilla_against_itself_is_never_recommended():
    text = self_control(held_out(1.04, 6, lcb=1.01))
    assert text.startswith("use vanilla decoding: this study measured vanilla against itself")
    assert "1.040x" in text and "never a gain" in text and "use the best" not in text


def test_a_loss_says_how_much_slower():
    text = recommendation(held_out(0.84, 5), min_held_out=3)
    assert "16 % slower than vanilla" in text and "use vanilla decoding" in text
    assert relative(1.0) == "as fast as vanilla"


def test_no_held_out_prompts_means_unconfirmed():
    assert "unconfirmed" in recommendation({}, min_held_out=3)


def test_the_finish_lock_admits_one_holder_at_a_time(tmp_path):
    lock = tmp_path / "s.finish.lock"
    order = []

    def second():
        with finish_lock(lock, poll_s=0.01):
            order.append("second")

    with finish_lock(lock):
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(timeout=0.3)
        assert thread.is_alive() and order == []     # waits while the first holds it
        order.append("first")
    thread.join(timeout=10)
    assert order == ["first", "second"] and not lock.exists()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, monkeypatch):
    """Taken over at once: no poll interval is waited (the sleep is recorded, not timed)."""
    import socket

    import tuner.answer.finish as finish
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / "s.finish.lock"
    lock.write_text(f"{socket.gethostname()} {dead.pid}\n")
    slept: list[float] = []
    monkeypatch.setattr(finish.time, "sleep", slept.append)
    with finish_lock(lock, poll_s=5.0):
        assert lock.read_text().split()[1] == str(os.getpid())
    assert slept == []


def test_the_trials_table_keeps_columns_only_some_trials_have(tmp_path):
    table = [{"trial": 3, "state": "COMPLETE", "shape": "static", "speedup": 1.2},
             {"trial": 1, "state": "COMPLETE", "shape": "dynamic", "depth": 4, "speedup": 1.1}]
    lines = trials_csv(table).splitlines()
    assert lines[0] == "trial,state,shape,speedup,depth"
    assert lines[2] == "1,COMPLETE,dynamic,1.1,4"
    assert "| 3 | COMPLETE | static | 1.2 |  |" in trials_markdown(table)


@pytest.mark.parametrize("recorded, expected", [
    ({"n_prompts": 1, "n_held_out": 1, "max_new_tokens": 8, "concurrency": [1]},
     "replay: the study's own budget: 1 held-out prompts x 8 new tokens"),
    ({"n_prompts": 1, "n_held_out": 2, "max_new_tokens": 8, "concurrency": [1]},
     "replay: budget OVERRIDDEN, so the figures are not the study's: n_held_out 2 -> 1"),
])
def test_the_replay_says_whether_it_measures_with_the_studys_budget(recorded, expected):
    from types import SimpleNamespace

    from tuner.run import replay_budget_line
    settings = SimpleNamespace(budget={"n_prompts": 1, "n_held_out": 1, "max_new_tokens": 8},
                               concurrency=(1,))
    assert replay_budget_line(settings, recorded) == expected


@pytest.mark.parametrize("contended, waited, expected", [
    (True, 20.0, "MACHINE BUSY (other load 0.50) after waiting 20 s for other processes"),
    (False, 7.0, "measured after waiting 7 s for the machine to be quiet"),
    (False, 0.0, "paired speedup 0.800"),
])
def test_a_prompt_line_says_when_it_waited_for_a_quiet_machine(contended, waited, expected):
    from types import SimpleNamespace

    from tuner.tracking.console import ConsoleProgress
    lines = []
    console = ConsoleProgress(lines.append, None, 3)
    got = SimpleNamespace(new_tokens=8, tokens_per_s=10.0, speedup=0.8, other_load=0.5,
                          contended=contended, waited_s=waited)
    console.prompt_measured(SimpleNamespace(number=1), 1, 2, SimpleNamespace(method=got))
    assert expected in lines[-1] and (waited or "waiting" not in lines[-1])


# -- per-level lines and the schedule: one rule, never contradicting the held-out evidence -----

SPACE = {"spec_type": {"type": "categorical", "choices": ["ngram-simple", "ngram-mod"]},
         "size_n": {"type": "int", "low": 1, "high": 12,
                    "active_when": {"spec_type": ["ngram-simple"]}},
         "mod_n_match": {"type": "int", "low": 1, "high": 24,
                         "active_when": {"spec_type": ["ngram-mod"]}}}


def levels_study(*trials, figure="decode_speedup"):
    """A study of engine trials: (params, {level: the tuning ``figure`` there}) each."""
    import optuna
    from optuna.distributions import CategoricalDistribution, IntDistribution
    study = optuna.create_study(direction="maximize")
    dists = {"spec_type": CategoricalDistribution(["ngram-simple", "ngram-mod"]),
             "size_n": IntDistribution(1, 12), "mod_n_match": IntDistribution(1, 24)}
    for params, ratios, *extra in trials:
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions=dists, value=max(ratios.values()),
            user_attrs={**{f"{figure}@c{level}": r for level, r in ratios.items()},
                        **(extra[0] if extra else {})}))
    return study


def level_settings(levels=(1, 4), objective="decode_speedup"):
    from types import SimpleNamespace
    default = {"spec_type": "ngram-simple", "size_n": 12, "mod_n_match": 24}
    return SimpleNamespace(space=SPACE, default=default,
                           params_at=lambda values: {**default, **values},
                           concurrency=tuple(levels), objectives=(objective,),
                           min_held_out_prompts=3, method_choice="prompt_lookup",
                           engine_object=SimpleNamespace(max_concurrency=64,
                                                         default_objective="decode_speedup"))


def held_at(level, ratio, lcb, figure="decode_speedup", prompts=3):
    return {f"held_out_{figure}@c{level}": ratio, f"held_out_{figure}_lcb@c{level}": lcb,
            "held_out_prompts": prompts}


SIMPLE = {"spec_type": "ngram-simple", "size_n": 3, "mod_n_match": 24}


@pytest.mark.parametrize("held,on", [((1.2, 1.1), True), ((0.84, 0.8), False),
                                     ((1.05, 0.97), False), (None, None)])
def test_a_level_is_on_only_where_the_held_out_run_beat_vanilla_beyond_the_noise(held, on):
    """Tuning says faster at concurrency 1; the line and the schedule follow the held-out run
    by the study's objective (the decode phase): ON where its lower bound is above 1, OFF
    otherwise (1.05x with a lower bound of 0.97 is noise: said so), or not confirmed (no
    held-out prompts)."""
    from tuner.answer.decide import level_decision
    from tuner.answer.outcome import State
    study = levels_study((SIMPLE, {1: 1.3, 4: 0.9}))
    confirmed = {} if held is None else {**held_at(1, *held), **held_at(4, 0.8, 0.7)}
    one, four = (level_decision(level_settings(), study, confirmed, level) for level in (1, 4))
    line = one.reason
    assert "decode-phase speedup 1.300x" in line and "throughput" not in line
    if on:
        assert "speculation ON" in line and one.deployed == SIMPLE and one.state is State.ON
        assert "95 % lower bound 1.100x" in line
    elif on is False:
        assert "speculation ON" not in line and "not beyond the noise" in line
        assert one.deployed is None and one.state is State.OFF
    else:
        assert "not confirmed (no held-out prompts" in line and "speculation ON" not in line
        assert one.state is State.NOT_CONFIRMED
    assert "speculation OFF at this level (vanilla is faster)" in four.reason
    assert four.deployed is None and four.state is State.OFF


@pytest.mark.parametrize("held,on", [((1.6, 1.2), True), ((1.2, 1.2), False), (None, None)])
def test_a_rate_is_on_only_where_the_held_out_goodput_was_higher(held, on):
    """By goodput under an SLO at 4 requests/s (the tuning trial: 1.5 vs vanilla 1.0 req/s): ON
    where the held-out goodput beat vanilla's, OFF on a tie (said so), not confirmed without
    held-out figures; a trial that did not beat vanilla at a rate is never ON there."""
    from types import SimpleNamespace

    import optuna

    from tuner.measure.rates import Traffic
    from tuner.answer.decide import rate_decision, rates_of
    study = levels_study((SIMPLE, {1: 1.3}))        # trial 0: no rate measured
    for params, figures in (({"spec_type": "ngram-mod", "size_n": 3, "mod_n_match": 4},
                             {"goodput@r4": 1.0, "vanilla_goodput@r4": 1.1,      # trial 1
                              "goodput@r0.5": 0.4, "vanilla_goodput@r0.5": 0.5}),
                            (SIMPLE, {"goodput@r4": 1.5, "vanilla_goodput@r4": 1.0,  # trial 2
                                      "goodput@r0.5": 0.5, "vanilla_goodput@r0.5": 0.5})):
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions=study.trials[0].distributions, value=1.0,
            user_attrs=figures))
    settings = SimpleNamespace(**vars(level_settings()),
                               traffic=Traffic((0.5, 4.0), 8, {"tpot_ms": 50}))
    assert rates_of(settings) == ["0.5", "4"]
    confirmed = {} if held is None else {"held_out_goodput@r4": held[0],
                                         "held_out_vanilla_goodput@r4": held[1],
                                         "held_out_prompts": 3}
    decision = rate_decision(settings, study, confirmed, "4")
    params, line = decision.deployed, decision.reason
    assert "goodput (SLO tpot_ms <= 50) 1.50 vs vanilla 1.00 req/s" in line
    if on:
        assert line.endswith("speculation ON: trial #2 {'spec_type': 'ngram-simple', "
                             "'size_n': 3}") and params == SIMPLE
    elif on is False:
        assert "speculation OFF at this rate (faster on the tuning prompts only" in line
        assert params is None
    else:
        assert "not confirmed (no held-out prompts at this rate)" in line and params == SIMPLE
    decision = rate_decision(settings, study, confirmed, "0.5")          # a tie when tuning
    params, line = decision.deployed, decision.reason
    assert params is None and "OFF at this rate (vanilla met the SLO as often)" in line


def test_a_level_is_decided_by_the_objective_and_names_the_studys_winner():
    """The objective's figure at the level decides (never throughput beside it); where the
    study measured one level, its winner is the level's one winner."""
    from tuner.answer.decide import level_decision
    mod = {"spec_type": "ngram-mod", "size_n": 12, "mod_n_match": 4}
    study = levels_study((SIMPLE, {1: 1.10}, {"throughput_ratio@c1": 1.9}),   # throughput
                         (mod, {1: 1.12}, {"throughput_ratio@c1": 1.0}))     # favours #0
    confirmed = held_at(1, 1.1, 1.05)
    several = level_decision(level_settings(), study, confirmed, 1)
    assert several.trial == 1 and "decode-phase speedup 1.120x" in several.reason
    alone = level_decision(level_settings((1,)), study, confirmed, 1, winner=0)
    assert alone.trial == 0 and "(trial #0)" in alone.reason
    by_throughput = level_decision(level_settings(objective="throughput_ratio"),
                                   levels_study((SIMPLE, {1: 1.9}), (mod, {1: 1.0}),
                                                figure="throughput_ratio"),
                                   held_at(1, 1.5, 1.2, "throughput_ratio"), 1)
    assert by_throughput.trial == 0 and "throughput 1.900x" in by_throughput.reason


def test_a_level_line_shows_only_the_parameters_that_act():
    """ngram-simple's size_n is shown, ngram-mod's mod_n_match (not acting there) is not."""
    from tuner.search.space import active_params
    from tuner.answer.decide import level_decision
    study = levels_study((SIMPLE, {1: 1.3, 4: 1.2}))
    line = level_decision(level_settings(), study, {**held_at(1, 1.1, 1.05),
                                                    **held_at(4, 1.05, 1.01)}, 1).reason
    assert "'size_n': 3" in line and "mod_n_match" not in line
    assert active_params({"spec_type": "ngram-mod", "size_n": 12, "mod_n_match": 4, "x": 1},
                         SPACE) == {"spec_type": "ngram-mod", "mod_n_match": 4, "x": 1}
