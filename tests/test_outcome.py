"""One typed outcome per study (tuner.study.outcome): every decision made once, every renderer
given the outcome alone, the best YAML holding YAML structures (no JSON text), ``outcome.json``
versioned beside it, and nothing unconfirmed written as a recommendation.

The engine study that exercises per-level and per-rate decisions end to end is
tests/test_engines.py::test_a_prompt_lookup_study_finishes_with_the_servers_counts (the same
spies); here, a tiny in-process study and a levels study made of recorded trials."""

from __future__ import annotations

import optuna
import pytest
import yaml
from optuna.distributions import IntDistribution

from tests.conftest import run_study
from tests.helpers.outcome import json_texts
from tuner.study import decide
from tuner.study.outcome import OUTCOME_VERSION, State, StudyOutcome, read_outcome
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
    outcome = read_outcome(best_path.with_suffix(".outcome.json"))
    assert outcome["version"] == OUTCOME_VERSION and outcome["study"] == "t"
    assert outcome["winner"]["trial"] == result["trial"]
    assert outcome["winner"]["params"] == result["params"]
    assert outcome["confirmed"]["held_out_prompts"] == 2
    positions = outcome["acceptance"]["positions"]
    assert [p["position"] for p in positions] == list(range(1, len(positions) + 1))
    assert all(p["drafts"] > 0 and 0 <= p["accepted_fraction"] <= 1 for p in positions)
    assert outcome["decisions"] == []                           # one request at a time
    assert outcome["deploy"] == best["deploy"]
    assert outcome["cost"]["spent_s"]["trials_s"] > 0              # what the search spent
    assert [t["trial"] for t in outcome["trials"]] and \
        {t["state"] for t in outcome["trials"]} == {"COMPLETE"}


def test_without_held_out_prompts_nothing_reads_as_a_recommendation(tmp_path):
    run_study(tmp_path, *GRID, "task.n_held_out=0")
    best_path = tmp_path / "studies" / "best" / "t.yaml"
    best = yaml.safe_load(best_path.read_text())
    assert "deploy" not in best and "python" in best["deploy_unconfirmed"]
    outcome = read_outcome(best_path.with_suffix(".outcome.json"))
    assert outcome["confirmed"] == {} and "unconfirmed" in outcome["recommendation"]


def levels_study(ratios: dict[int, dict[int, float]]) -> optuna.Study:
    """Recorded trials: per size_n, the throughput ratio per level."""
    study = optuna.create_study(direction="maximize")
    for size_n, by_level in ratios.items():
        study.add_trial(optuna.trial.create_trial(
            params={"size_n": size_n}, distributions={"size_n": IntDistribution(1, 12)},
            value=max(by_level.values()),
            user_attrs={f"throughput_ratio@c{level}": r for level, r in by_level.items()}))
    return study


def test_each_level_is_decided_once_and_the_advice_names_the_on_levels(monkeypatch):
    from types import SimpleNamespace

    from tuner.measure.rates import Traffic
    settings = SimpleNamespace(space={"size_n": {"type": "int", "low": 1, "high": 12}},
                               default={"size_n": 2}, concurrency=(1, 4, 8),
                               engine_object=SimpleNamespace(max_concurrency=64),
                               traffic=Traffic((), 8, None), objectives=["throughput_ratio"],
                               min_held_out_prompts=3)
    study = levels_study({1: {1: 0.9, 4: 1.3, 8: 1.2}, 2: {1: 0.95, 4: 1.1, 8: 1.25}})
    confirmed = {"held_out_speedup": 0.9, "held_out_prompts": 5,
                 "held_out_throughput_ratio@c1": 0.9, "held_out_throughput_ratio@c4": 1.2,
                 "held_out_throughput_ratio@c8": 0.97}
    counted: list[int] = []
    real = decide.level_decision
    monkeypatch.setattr(decide, "level_decision",
                        lambda s, st, c, level: counted.append(level) or real(s, st, c, level))
    levels, rates = decide.decisions(settings, study, confirmed)
    assert counted == [1, 4, 8] and rates == ()
    states = {d.at: d.state for d in levels}
    assert states == {"1": State.OFF, "4": State.ON, "8": State.OFF}
    assert dict(levels[1].deployed) == {"size_n": 1} and levels[0].deployed is None
    advice = decide.recommendation(settings, confirmed, levels, rates)
    assert "vanilla decoding" in advice and "except where the lines above say ON " \
        "(concurrency 4)" in advice
