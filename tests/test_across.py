"""One study across methods (``method=auto``): the union's points in one study, ranked by one
profile, raced on wall clock, an outcome that names the method (tuner.config.union,
tuner.study.union, tuner.search.plans, tuner.answer.conclude)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import compose_cfg
from tuner.config.errors import ConfigError
from tuner.config.methods import union_class
from tuner.config.union import member_of, params_at, point_space, union_method
from tuner.search.plans import PredictPlan, point_key
from tuner.search.racing import Race

SPEC = {"_target_": "decoding.speculative.SpeculativeDecoding", "lossless": True,
        "needs_draft": True, "params": {"num_draft_tokens": 4},
        "space": {"num_draft_tokens": {"type": "int", "low": 1, "high": 16}}}
LOOKUP = {"_target_": "decoding.prompt_lookup.PromptLookup", "lossless": True,
          "needs_draft": False, "params": {"num_draft_tokens": 10, "max_ngram": 3},
          "space": {"num_draft_tokens": {"type": "int", "low": 1, "high": 16},
                    "max_ngram": {"type": "int", "low": 1, "high": 5,
                                  "active_when": {"num_draft_tokens": [2, 3]}}}}

# the tiny pair, two tuning prompts of 12 tokens, three members (one an EAGLE head: unpriced)
STUDY = ["method=auto", "method.members=[prompt_lookup,speculative,eagle]",
         "task.n_prompts=2", "task.n_held_out=3", "task.max_new_tokens=12",
         "search.profile_rounds=1", "tracking=none"]


def test_a_union_namespaces_each_member_and_a_point_splits_back():
    union = union_method({"prompt_lookup": LOOKUP, "speculative": SPEC})
    space = union["space"]
    assert space["method"] == {"type": "categorical", "choices": ["prompt_lookup",
                                                                  "speculative"]}
    # one name, two ranges: kept apart; each active for its member only (and its own condition)
    assert space["speculative.num_draft_tokens"]["active_when"] == {"method": ["speculative"]}
    assert space["prompt_lookup.max_ngram"]["active_when"] == {
        "method": ["prompt_lookup"], "prompt_lookup.num_draft_tokens": [2, 3]}
    assert union["params"] == {"method": "prompt_lookup", "prompt_lookup.num_draft_tokens": 10,
                               "prompt_lookup.max_ngram": 3}
    assert union["needs_draft"] is True and union["lossless"] is True
    point = {"method": "speculative", "speculative.num_draft_tokens": 2}
    assert params_at(union, point) == point              # no other member's parameters
    name, cfg, own = member_of(union, {**point, "prompt_lookup.max_ngram": 5})
    assert (name, cfg["_target_"], own) == ("speculative", SPEC["_target_"],
                                            {"num_draft_tokens": 2})
    assert set(point_space(union, point)) == {"method", "speculative.num_draft_tokens"}
    with pytest.raises(ValueError, match="method='tree' is not a member of this study"):
        member_of(union, {"method": "tree"})
    # what the members share: none keeps a history, so each trial shuffles its prompts; with
    # Ouroboros (its pool may carry across prompts) every trial runs them in one order
    assert union_class(union).keeps_history is False
    ouroboros = {**SPEC, "_target_": "decoding.ouroboros.Ouroboros"}
    assert union_class(union_method({"speculative": SPEC, "ouroboros": ouroboros})
                       ).keeps_history is True


def test_an_unpriced_point_is_measured_before_a_race_can_stop():
    """An EAGLE head's start point has no prediction: it comes right after the default and the
    stop rule waits for it; the ranked points follow in order of prediction."""
    default = {"method": "a", "a.k": 1}
    points = [default, {"method": "a", "a.k": 2}, {"method": "a", "a.k": 3},
              {"method": "e", "e.s": 1}]
    plan = PredictPlan({}, default, "heuristic", "HH", 3, 2, Race(min_measured=0),
                       points=points, unpriced=[points[3]])
    chosen = plan.rank([1.0, 0.5, 1.2, float("-inf")])
    assert [stage for _, stage in chosen] == ["default", "unpriced", "race", "race"]
    assert chosen[1][0] == points[3] and chosen[2][0] == points[2]
    results = {point_key(default): 2.0}        # the leader already far ahead: a race would stop
    assert plan.next_point(results) == (points[3], "unpriced")
    results[point_key(points[3])] = 0.9
    assert plan.next_point(results) == (points[2], "race")     # the best predicted next


def test_ties_across_methods_go_to_the_cheaper_deployment_then_the_smaller_draft():
    """Within the race's margin the cheaper deployment wins (prompt lookup before speculative,
    whatever their draft sizes); beyond it the faster point wins; within one method, the
    smaller draft."""
    from tuner.search.racing import deployment_rank, tie_break
    union = union_method({"prompt_lookup": LOOKUP, "speculative": SPEC})
    size = {"prompt_lookup": lambda p: p["prompt_lookup.num_draft_tokens"],
            "speculative": lambda p: p["speculative.num_draft_tokens"]}

    def win(*finished):
        return tie_break(finished, 0.02, lambda p: size[p["method"]](p),
                         lambda p: deployment_rank(p["method"]))
    lookup = {"method": "prompt_lookup", "prompt_lookup.num_draft_tokens": 10}
    spec = {"method": "speculative", "speculative.num_draft_tokens": 2}
    assert member_of(union, spec)[0] == "speculative"
    assert win(("s", spec, 1.20), ("l", lookup, 1.19)) == "l"      # within 2 %: cheaper
    assert win(("s", spec, 1.20), ("l", lookup, 1.10)) == "s"      # beyond it: faster
    short = {**spec, "speculative.num_draft_tokens": 1}
    assert win(("s", spec, 1.20), ("t", short, 1.19)) == "t"       # one method: smaller draft


@pytest.mark.parametrize("better", ["speculative", "prompt_lookup"])
def test_algorithm_1_across_methods_sweeps_the_members_then_the_best_ones_parameters(better):
    """search=heuristic on a union: ``method`` is swept first, each member at its own start
    point; then the parameters of the member that measured best, and no other member's; every
    point holds ``method`` and its member's parameters only; the size counts the members and
    the largest member's sweeps (what an engine server's study across methods runs)."""
    from tuner.search.plans import HeuristicPlan
    spec = {**SPEC, "space": {"num_draft_tokens": {"type": "int", "low": 1, "high": 16,
                                                   "heuristic": {"HH": [2, 4], "LH": [2, 4]}}}}
    lookup = {**LOOKUP, "params": {"num_draft_tokens": 2, "max_ngram": 1},
              "space": {"num_draft_tokens": {"type": "int", "low": 1, "high": 3},
                        "max_ngram": {"type": "int", "low": 1, "high": 2}}}
    union = union_method({"prompt_lookup": lookup, "speculative": spec})
    plan = HeuristicPlan(union["space"], "HH", 3, union["params"],
                         lambda p: {k: p[k] for k in point_space(union, p)})
    assert plan.size() == 2 + 3 + 2           # the members, then prompt lookup's 3 + 2 values
    results, visited = {}, []
    while (step := plan.next_point(results)) is not None:
        point, stage = step
        visited.append((point, stage))
        own = float(point.get("speculative.num_draft_tokens",
                              point.get("prompt_lookup.num_draft_tokens")))
        results[point_key(point)] = (2.0 if point["method"] == better else 1.0) + own / 100
    assert [p["method"] for p, stage in visited[:2]] == ["prompt_lookup", "speculative"]
    assert {stage for _, stage in visited[:2]} == {"method"}
    assert all(set(p) - {"method"} <= {k for k in p if k.startswith(p["method"] + ".")}
               and len(p) > 1 for p, _ in visited)
    swept = visited[2:]
    assert swept and all(p["method"] == better for p, _ in swept)
    assert {stage for _, stage in swept} <= {f"{better}.num_draft_tokens", f"{better}.max_ngram"}
    assert len(visited) <= plan.size()


@pytest.mark.parametrize("overrides,message", [
    (["engine=llamacpp", "models=smollm2"],
     "search=predict is invalid for method=auto on engine=llamacpp: nothing ranks an engine "
     "server's points before they are measured"),
    (["search=tpe"], "search=tpe is invalid for method=auto: a study across methods ranks "
                     "every method's points by one profile, then races them (search=predict), "
                     "or sweeps the methods at their start points"),
    (["search=predict", "method.members=[speculative,nope]"],
     "methods=['speculative', 'nope'] is invalid: nope is not a method"),
    (["search=predict", "method.members=7"], "method.members=7 is invalid: allowed are all, "
                                             "or a non-empty list of"),
    (["search=predict", "+method.gamma=3"], "method.gamma is not a setting of method=auto"),
    (["search=predict", "search.predict_for=x.json"],
     "search.predict_for is invalid for method=auto"),
])
def test_what_a_study_across_methods_cannot_do_gets_one_line(overrides, message):
    from tuner.study.settings import union_settings
    with pytest.raises(ConfigError) as err:
        union_settings(compose_cfg(None, "models=tiny", "method=auto", *overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_one_study_across_methods_names_the_method_and_resumes(tmp_path, monkeypatch,
                                                                 capsys):
    """The union in one journal: trial 0 is the cheapest deployment's default (prompt lookup),
    the EAGLE head's start point is measured unranked, the rest raced by prediction; the
    outcome names the method, its own parameters, a replay line of that method and every
    method's best; the same command again finishes nothing twice."""
    from tests.conftest import load_study, run_study
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECTUNE_PROFILES", str(tmp_path / "profiles"))
    run_study(tmp_path, *STUDY)
    out = capsys.readouterr().out
    # priced members first, cheapest deployment first; the unpriced head after them
    assert "methods: prompt_lookup, speculative, eagle (and off: vanilla)" in out
    assert "method=eagle: no hardware profile prices its drafts" in out
    assert "method=speculative: 5 points ranked in" in out
    study = load_study(tmp_path)
    trials = sorted(study.trials, key=lambda t: t.number)
    points = [json.loads(t.user_attrs["params"]) for t in trials]
    assert points[0] == {"method": "prompt_lookup", "prompt_lookup.num_draft_tokens": 10,
                         "prompt_lookup.max_ngram": 3, "prompt_lookup.min_ngram": 1,
                         "prompt_lookup.num_matches": 1}
    assert trials[1].user_attrs["stage"] == "unpriced" and points[1]["method"] == "eagle"
    assert all(set(p) - {"method"} <= {k for k in p if k.startswith(p["method"] + ".")}
               for p in points)                  # a trial holds its own member's parameters
    body = json.loads((tmp_path / "studies" / "best" / "t.outcome.json").read_text())
    won = next(t for t in trials if t.number == body["winner"]["trial"])
    method = json.loads(won.user_attrs["params"])["method"]
    assert body["method"] == method and "." not in "".join(body["winner"]["params"])
    assert {m["method"] for m in body["methods"]} == {"prompt_lookup", "eagle", "speculative"}
    assert f"method={method}" in body["recommendation"]
    best = (tmp_path / "studies" / "best" / "t.yaml").read_text()
    assert f"python -m tuner +task=gsm8k method={method} +best=t" in best
    assert body["deploy"]["python"].startswith(f"decoding.build_method({method!r}, pair")

    run_study(tmp_path, *STUDY)                  # the same command: resumed, nothing twice
    out = capsys.readouterr().out
    assert "(resumed)" in out and "is already finished with these" in out
    assert len(load_study(tmp_path).trials) == len(trials)


def planted(factors: dict[str, float]):
    """A timer that runs each generation for real (its tokens, its counts, the lossless check)
    and reports a planted time: 30 ms per token times the method class's factor (vanilla 1),
    plus its real first step (a few ms: the paired speedup reads about 1 / factor). Trial 0's
    vanilla then decodes for under the 1 s a profile check needs: the profile is not judged
    by planted times."""
    from tuner.measure.timing import time_generation

    def timer(method, ids, max_new_tokens, device):
        out, _ = time_generation(method, ids, max_new_tokens, device)
        factor = factors.get(type(method).__name__, 1.0)
        return out, out.stats.first_step_s + 0.03 * factor * len(out.tokens)
    return timer


# every ranked point measured (the stop rule never acts, the budget holds all 35): the planted
# cost alone decides what the race ends with (the profile knows nothing of it)
RACE_ALL = ["method.members=[prompt_lookup,speculative]", "search.race.min_measured=100",
            "cpu_budget.n_trials=40"]


@pytest.mark.parametrize("factors,answer", [
    ({"SpeculativeDecoding": 0.8}, "speculative"),                  # speculative 1.25x: it
    ({"SpeculativeDecoding": 1.25, "PromptLookup": 1.25}, None),    # every method slower: off
])
def test_a_planted_cost_decides_the_method_or_off(tmp_path, monkeypatch, factors, answer):
    from tests.conftest import run_study
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECTUNE_PROFILES", str(tmp_path / "profiles"))
    run_study(tmp_path, *[o for o in STUDY if not o.startswith("method.members")], *RACE_ALL,
              timer=planted(factors))
    body = json.loads((tmp_path / "studies" / "best" / "t.outcome.json").read_text())
    advice = body["recommendation"]
    if answer is None:
        assert "use vanilla decoding" in advice, advice
        assert all(m["best"] is None or m["best"] < 1.0 for m in body["methods"]), body["methods"]
    else:
        assert body["method"] == answer and advice.startswith(f"use method={answer} "), advice
        assert body["confirmed"]["held_out_speedup"] == pytest.approx(1.25, rel=0.06)


def test_a_race_resumed_in_the_middle_measures_nothing_twice(tmp_path, monkeypatch, capsys):
    """Stopped after 3 trials (search.n_trials), the same study resumed with room for more
    restores its ranking (nothing predicted again) and measures only points no trial holds."""
    from optuna.trial import TrialState

    from tests.conftest import load_study, run_study
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECTUNE_PROFILES", str(tmp_path / "profiles"))
    run_study(tmp_path, *STUDY, *RACE_ALL, "search.n_trials=3")
    assert len(load_study(tmp_path).trials) == 3
    capsys.readouterr()
    run_study(tmp_path, *STUDY, *RACE_ALL, "search.n_trials=8")
    out = capsys.readouterr().out
    assert "(resumed)" in out and "search=predict: predicting" not in out
    trials = load_study(tmp_path).get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    points = [t.user_attrs["point"] for t in trials]
    assert len(trials) > 3 and len(points) == len(set(points)), points


def test_two_workers_share_one_study_across_methods(tmp_path, monkeypatch, tiny_profile):
    """phase=prepare, then two phase=work processes started together on one journal, then
    phase=finish: one of them ranks (the other waits for its ranking), no point is measured
    twice, and the finish names a method of the union."""
    import os
    import subprocess
    import sys

    from optuna.trial import TrialState

    from tests.conftest import FAST, ROOT, load_study, run_study
    monkeypatch.chdir(tmp_path)
    common = [*[o for o in STUDY if o != "search.profile_rounds=1"],
              f"search.profile={tiny_profile}", "method.members=[prompt_lookup,speculative]"]
    run_study(tmp_path, *common, "phase=prepare")
    argv = [sys.executable, "-m", "tuner", "+task=gsm8k", *FAST, "study_name=t", *common,
            "phase=work"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [w.communicate(timeout=600)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), [o[-1500:] for o in outs]
    assert sum("search=predict: predicting" in o for o in outs) == 1, outs
    study = load_study(tmp_path)
    held = [t.user_attrs["point"] for t in study.trials
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(held) >= 2 and len(held) == len(set(held)), held
    run_study(tmp_path, *common, "phase=finish")
    body = json.loads((tmp_path / "studies" / "best" / "t.outcome.json").read_text())
    assert body["method"] in ("prompt_lookup", "speculative")
