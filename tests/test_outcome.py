"""One typed outcome per study (tuner.answer.outcome): every decision made once, every renderer
given the outcome alone, the best YAML holding YAML structures (no JSON text), ``outcome.json``
versioned beside it, and nothing unconfirmed written as a recommendation.

The engine study that exercises per-level and per-rate decisions end to end is
tests/test_engines.py::test_a_prompt_lookup_study_finishes_with_the_servers_counts (the same
spies); here, a tiny in-process study and a levels study made of recorded trials."""

from __future__ import annotations

import json

import optuna
import pytest
import yaml
from optuna.distributions import IntDistribution

from tests.conftest import run_study
from tests.helpers.outcome import json_texts
from tuner.answer import decide
from tuner.answer.outcome import OUTCOME_VERSION, State, StudyOutcome, read_outcome
from tuner.tracking import render

pytestmark = pytest.mark.usefixtures("in_tmp")
GRID = ["search=grid", "search.ranges=full", "method.space.num_draft_tokens.high=2",
        "method.params.num_draft_tokens=2", "tracking=none"]


def spy_renderers(monkeypatch) -> list[tuple[str, tuple]]:
    """Wrap every renderer; record the positional arguments each one received."""
    calls: list[tuple[str, tuple]] = []
    for name in ("write_best_yaml", "write_outcome_json", "study_result", "print_summary"):
        real = getattr(render, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            assert not kwargs, f"{_name} got keywords {sorted(kwargs)}"
            calls.append((_name, args))
            return _real(*args)
        monkeypatch.setattr(render, name, spy)
    return calls


def test_a_study_renders_one_outcome_and_writes_yaml_structures(tmp_path, monkeypatch):
    calls = spy_renderers(monkeypatch)
    decided = []
    real = decide.decisions
    monkeypatch.setattr(decide, "decisions",
                        lambda *a: decided.append(1) or real(*a))
    result = run_study(tmp_path, *GRID)
    assert len(decided) == 1                                   # decided once per finish
    assert sorted(name for name, _ in calls) == ["print_summary", "study_result",
                                                 "write_best_yaml", "write_outcome_json"]
    outcomes = {id(args[0]) for _, args in calls}
    assert len(outcomes) == 1                                  # the same object, every renderer
    for name, args in calls:
        assert isinstance(args[0], StudyOutcome)
        assert len(args) == (2 if name == "print_summary" else 1)    # + the line sink
    best_path = tmp_path / "studies" / "best" / "t.yaml"
    best = yaml.safe_load(best_path.read_text())
    assert json_texts(best) == [], json_texts(best)
    assert isinstance(best["deploy"]["python"], str)            # the in-process answer
    path = best_path.with_suffix(".outcome.json")
    body = json.loads(path.read_text())
    assert body["version"] == OUTCOME_VERSION
    assert StudyOutcome.from_json(body).to_json() == body       # the typed reader, round trip
    outcome = read_outcome(path)
    assert outcome.study == "t" and outcome.winner.trial == result["trial"]
    assert outcome.winner.params == result["params"] == outcome.deployed_params
    assert outcome.confirmed["held_out_prompts"] == 2
    positions = outcome.acceptance["positions"]
    assert [p["position"] for p in positions] == list(range(1, len(positions) + 1))
    assert all(p["drafts"] > 0 and 0 <= p["accepted_fraction"] <= 1 for p in positions)
    assert outcome.decisions == ()                              # one request at a time
    assert outcome.deploy == best["deploy"]
    assert outcome.cost["spent_s"]["trials_s"] > 0                 # what the search spent
    assert [t["trial"] for t in outcome.trials] and \
        {t["state"] for t in outcome.trials} == {"COMPLETE"}


def test_without_held_out_prompts_nothing_reads_as_a_recommendation(tmp_path):
    run_study(tmp_path, *GRID, "task.n_held_out=0")
    best_path = tmp_path / "studies" / "best" / "t.yaml"
    best = yaml.safe_load(best_path.read_text())
    assert "deploy" not in best and "python" in best["deploy_unconfirmed"]
    outcome = read_outcome(best_path.with_suffix(".outcome.json"))
    assert outcome.confirmed == {} and "unconfirmed" in outcome.recommendation


def levels_study(ratios: dict[int, dict[int, float]]) -> optuna.Study:
    """Recorded trials: per size_n, the throughput ratio per level."""
    study = optuna.create_study(direction="maximize")
    for size_n, by_level in ratios.items():
        study.add_trial(optuna.trial.create_trial(
            params={"size_n": size_n}, distributions={"size_n": IntDistribution(1, 12)},
            value=max(by_level.values()),
            user_attrs={f"throughput_ratio@c{level}": r for level, r in by_level.items()}))
    return study


def engine_settings(levels, rates=(), objective="throughput_ratio", method="prompt_lookup"):
    from types import SimpleNamespace

    from tuner.measure.rates import Traffic
    return SimpleNamespace(space={"size_n": {"type": "int", "low": 1, "high": 12}},
                           default={"size_n": 2}, concurrency=tuple(levels),
                           params_at=lambda values: {"size_n": 2, **values},
                           engine_object=SimpleNamespace(max_concurrency=64,
                                                         default_objective="decode_speedup"),
                           traffic=Traffic(tuple(rates), 8, {"tpot_ms": 50} if rates else None),
                           objectives=[objective], min_held_out_prompts=3,
                           method_choice=method)


def test_each_level_is_decided_once_and_the_advice_has_one_answer_per_level(monkeypatch):
    settings = engine_settings((1, 4, 8))
    study = levels_study({1: {1: 0.9, 4: 1.3, 8: 1.2}, 2: {1: 0.95, 4: 1.1, 8: 1.25}})
    confirmed = {"held_out_speedup": 0.9, "held_out_prompts": 5,
                 "held_out_throughput_ratio@c1": 0.9, "held_out_throughput_ratio@c4": 1.2,
                 "held_out_throughput_ratio_lcb@c4": 1.1,
                 "held_out_throughput_ratio@c8": 0.97, "held_out_throughput_ratio_lcb@c8": 0.9}
    counted: list[int] = []
    real = decide.level_decision
    monkeypatch.setattr(decide, "level_decision",
                        lambda s, st, c, level, *a: counted.append(level) or
                        real(s, st, c, level, *a))
    levels, rates = decide.decisions(settings, study, confirmed)
    assert counted == [1, 4, 8] and rates == ()
    states = {d.at: d.state for d in levels}
    assert states == {"1": State.OFF, "4": State.ON, "8": State.OFF}
    assert dict(levels[1].deployed) == {"size_n": 1} and levels[0].deployed is None
    advice = decide.recommendation(settings, confirmed, levels, rates)
    assert advice == ("at concurrency 1: use vanilla decoding; at concurrency 4: deploy trial #0 "
                      "(1.200x vanilla held out; the deploy lines below); at concurrency 8: use "
                      "vanilla decoding")


# every combination of ON / OFF / NOT_CONFIRMED over one to three levels and a rate: the text and
# outcome.json must say the same, place by place, and never both "use vanilla" and ON
PLANTED = {  # state -> (tuning figure, held-out figure or None, its lower bound)
    State.ON: (1.3, 1.2, 1.1), State.OFF: (1.3, 0.95, 0.9), State.NOT_CONFIRMED: (1.3, None, None)}
RATE_PLANTED = {  # state -> (tuning goodput, held-out goodput or None), vanilla's always 1.0
    State.ON: (1.5, 1.6), State.OFF: (1.5, 1.0), State.NOT_CONFIRMED: (1.5, None)}


def planted(level_states, rate_state):
    """A one-trial study and a held-out record that give each level (and the rate) its state."""
    attrs, confirmed = {}, {"held_out_prompts": 3, "held_out_speedup": 1.0,
                            "held_out_speedup_min": 1.0, "held_out_speedup_max": 1.0}
    for level, state in level_states.items():
        tuning, held, low = PLANTED[state]
        attrs[f"decode_speedup@c{level}"] = tuning
        if held is not None:
            confirmed[f"held_out_decode_speedup@c{level}"] = held
            confirmed[f"held_out_decode_speedup_lcb@c{level}"] = low
    if rate_state is not None:
        tuning, held = RATE_PLANTED[rate_state]
        attrs.update({"goodput@r2": tuning, "vanilla_goodput@r2": 1.0})
        if held is not None:
            confirmed.update({"held_out_goodput@r2": held, "held_out_vanilla_goodput@r2": 1.0})
    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(
        params={"size_n": 3}, distributions={"size_n": IntDistribution(1, 12)}, value=1.3,
        user_attrs=attrs))
    return study, confirmed


def combinations():
    import itertools
    states = list(State)
    for count in (1, 2, 3):
        for combo in itertools.product(states, repeat=count):
            for rate in (None, *states):
                yield dict(zip((1, 4, 16)[:count], combo)), rate


def test_every_combination_of_decisions_reads_the_same_in_the_text_and_outcome_json():
    checked = 0
    for level_states, rate_state in combinations():
        settings = engine_settings(tuple(level_states), (2.0,) if rate_state else (),
                                   objective="decode_speedup")
        study, confirmed = planted(level_states, rate_state)
        levels, rates = decide.decisions(settings, study, confirmed, winner=0)
        advice = decide.recommendation(settings, confirmed, levels, rates)
        outcome = StudyOutcome("s", "prompt_lookup", "cnndm", "decode_speedup", {}, None,
                               confirmed, levels=levels, rates=rates,
                               deploy={"per_level": {int(d.at): d.deployed for d in levels}},
                               recommendation=advice)
        body = json.loads(json.dumps(outcome.to_json()))
        back = StudyOutcome.from_json(body)        # the typed reader: the same decisions back
        assert back.to_json() == body and back.decisions == outcome.decisions
        text = dict(render.rows(outcome))
        wanted = {**{f"concurrency {lv}": st for lv, st in level_states.items()},
                  **({"request rate 2/s": rate_state} if rate_state else {})}
        assert {d["kind"] + d["at"]: d["state"] for d in body["decisions"]} == \
            {("level" + k.split()[1] if k.startswith("concurrency") else "rate2"): v.value
             for k, v in wanted.items()}, (level_states, rate_state)
        assert body["recommendation"] == advice
        all_off = all(st is State.OFF for st in wanted.values())
        for label, state in wanted.items():
            line = text[label]
            assert ("speculation ON" in line) == (state is State.ON), (label, line)
            assert ("speculation OFF" in line) == (state is State.OFF), (label, line)
            assert ("not confirmed" in line) == (state is State.NOT_CONFIRMED), (label, line)
            clause = next((c for c in advice.split("; ") if c.startswith(f"at {label}:")), None)
            if all_off:
                assert advice.startswith("use vanilla decoding") and "deploy" not in advice
                continue
            assert clause is not None, (label, advice)
            assert ("deploy trial #0" in clause) == (state is State.ON), clause
            assert ("use vanilla decoding" in clause) == (state is State.OFF), clause
            assert ("until held-out prompts confirm" in clause) == \
                (state is State.NOT_CONFIRMED), clause
        for d in body["decisions"]:
            deployed = body["deploy"]["per_level"].get(d["at"]) if d["kind"] == "level" else \
                d["deployed"]
            assert (deployed is None) == (d["state"] == "OFF"), d
        checked += 1
    assert checked == (3 + 9 + 27) * 4


@pytest.mark.parametrize("body,message", [
    ({"version": 0, "study": "s"}, "outcome version 0 is not"),
    ([1, 2], "not a JSON object \\(a list\\)"),
    ({"version": OUTCOME_VERSION, "study": "s", "method": "m", "task": "t", "objective": "o",
      "prediction": ["x"]}, "not a study outcome of version"),
    ({"version": OUTCOME_VERSION, "study": "s"}, "not a study outcome of version"),
])
def test_the_typed_reader_refuses_what_it_cannot_read(tmp_path, body, message):
    path = tmp_path / "s.outcome.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ValueError, match=message):
        read_outcome(path)
    path.write_bytes(b"\x00\x01 not json")
    with pytest.raises(ValueError, match="not JSON"):
        read_outcome(path)
