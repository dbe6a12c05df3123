"""The tuner end to end on tiny models, its search plans, resume after SIGKILL, failure handling."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import optuna
import pytest
import torch
import yaml
from optuna.trial import TrialState

from tuner.measure.lossless import LosslessViolation, check_against_vanilla
from tuner.measure.measurement import Measurement
from tuner.search.plans import GridPlan, HeuristicPlan, point_key
from tuner.search.space import distributions, grid_size, suggest, validate_params
from tuner.study.trials import failure_reason

from tests.conftest import CONF, ENV, FAST, ROOT, compose_cfg, load_study, run_study
from decoding.acceptance import AcceptanceCounts

pytestmark = pytest.mark.usefixtures("in_tmp")


def run_cfg(tmp_path, *overrides):
    return run_study(tmp_path, *overrides)


# ----------------------------------------------------------------------------------------------
# Configs


@pytest.mark.parametrize("method", sorted(p.stem for p in (CONF / "method").glob("*.yaml")
                                          if p.stem != "auto"))   # a union: test_across.py
@pytest.mark.parametrize("search", sorted(p.stem for p in (CONF / "search").glob("[!_]*.yaml")))
def test_every_method_and_search_composes_and_instantiates(tmp_path, method, search):
    from tuner.config.build import build_method, load_models, plain
    cfg = compose_cfg(tmp_path, f"method={method}", f"search={search}")
    validate_params(cfg.method.params, plain(cfg.method.space))
    pair, _ = load_models(cfg.models, cfg.method.needs_draft)
    built = build_method(plain(cfg.method), plain(cfg.method.params), pair, cfg.sampling, 0)
    assert type(built).__module__.startswith("decoding.")


def test_bad_configs_get_clear_errors(tmp_path):
    from tuner.config.build import method_class
    with pytest.raises(ValueError, match=r"_target_='os.system' is not allowed"):
        method_class({"_target_": "os.system"})
    with pytest.raises(ValueError, match=r"num_draft_tokens=0 is outside its search space"):
        validate_params({"num_draft_tokens": 0}, {"num_draft_tokens": {"type": "int", "low": 1,
                                                                       "high": 4}})
    with pytest.raises(ValueError, match=r"low=5, high=2 is not a valid range"):
        distributions({"num_draft_tokens": {"type": "int", "low": 5, "high": 2}})
    with pytest.raises(ValueError, match=r"num_draft_tokens=0 is outside"):
        run_cfg(tmp_path, "method.params.num_draft_tokens=0", "tracking=none")


def test_cli_without_a_task_or_with_an_unknown_one(tmp_path):
    env = ENV
    no_task = subprocess.run([sys.executable, "-m", "tuner"], cwd=tmp_path, env=env,
                             capture_output=True, text=True)
    assert no_task.returncode != 0 and "choose a task: python -m tuner +task=NAME" in \
        no_task.stderr and "gsm8k" in no_task.stderr
    unknown = subprocess.run([sys.executable, "-m", "tuner", "+task=gsm9k"], cwd=tmp_path,
                             env=env, capture_output=True, text=True)
    assert unknown.returncode != 0 and "gsm9k" in unknown.stderr


# ----------------------------------------------------------------------------------------------
# Plans


def test_heuristic_visits_algorithm_1_sequence():
    """γ swept first with W, β held at their drawn values, then W at the best γ, then β."""
    space = {"gamma": {"type": "int", "low": 1, "high": 20, "heuristic": {"HH": [7, 9],
                                                                          "LH": [2, 4]}},
             "window": {"type": "int", "low": 10, "high": 25, "heuristic": {"HH": [15, 17],
                                                                            "LH": [15, 17]}},
             "beta": {"type": "int", "low": 3, "high": 8, "heuristic": {"HH": [5, 6],
                                                                        "LH": [5, 6]}},
             "k": {"type": "int", "low": 1, "high": 5, "heuristic": {"HH": [3, 3],
                                                                     "LH": [3, 3]}}}
    plan = HeuristicPlan(space, "HH", seed=0)
    w0, b0 = plan.initial["window"], plan.initial["beta"]
    assert w0 in (15, 16, 17) and b0 in (5, 6) and plan.initial["k"] == 3

    def objective(p):   # known argmax: gamma 8, window 17, beta 5
        return -((p["gamma"] - 8) ** 2 + (p["window"] - 17) ** 2 + (p["beta"] - 5) ** 2)

    results, visited = {}, []
    while (step := plan.next_point(results)) is not None:
        point, stage = step
        visited.append((stage, point["gamma"], point["window"], point["beta"], point["k"]))
        results[point_key(point)] = objective(point)
    sequence = [("gamma", g, w0, b0, 3) for g in (7, 8, 9)] + \
        [("window", 8, w, b0, 3) for w in (15, 16, 17)] + [("beta", 8, 17, b, 3) for b in (5, 6)]
    expected, seen = [], set()            # Algorithm 1's sequence; a point is never re-measured
    for stage, *point in sequence:
        if tuple(point) not in seen:
            seen.add(tuple(point))
            expected.append((stage, *point))
    assert visited == expected
    assert max(results, key=results.get) == point_key({"gamma": 8, "window": 17, "beta": 5, "k": 3})
    assert plan.size() == 8


TREE_LIKE = {"shape": {"type": "categorical", "choices": ["dynamic", "2-1", "3-1"],
                       "heuristic": {"HH": ["dynamic", "2-1", "3-1"]}},
             "width": {"type": "int", "low": 1, "high": 4, "heuristic": {"HH": [1, 3]},
                       "active_when": {"shape": ["dynamic"]}}}


def test_heuristic_does_not_sweep_a_parameter_where_it_does_not_act():
    """A static shape wins: the dynamic tree's width is not swept (each point would build the same
    method); a dynamic shape wins: it is."""
    for best_shape, sweeps in (("2-1", 3), ("dynamic", 5)):
        plan = HeuristicPlan(TREE_LIKE, "HH", seed=0, default={"shape": "dynamic", "width": 2})
        results, visited = {}, []
        while (step := plan.next_point(results)) is not None:
            point, _ = step
            visited.append(point)
            results[point_key(point)] = float(point["shape"] == best_shape) + point["width"] / 10
        assert len(visited) == sweeps
        assert all(p["width"] == 2 for p in visited if p["shape"] != "dynamic")
        assert len({point_key(p) for p in visited}) == len(visited)


NGRAM_LIKE = {   # llama.cpp's prompt lookup: a type first, then that type's own sizes, whose
                 # defaults (llama.cpp's) lie outside the heuristic ranges
    "spec_type": {"type": "categorical", "choices": ["simple", "mod"]},
    "size_n": {"type": "int", "low": 1, "high": 12, "heuristic": {"HH": [2, 4]},
               "active_when": {"spec_type": ["simple"]}},
    "mod_n": {"type": "int", "low": 1, "high": 24, "heuristic": {"HH": [5, 6]},
              "active_when": {"spec_type": ["mod"]}}}


def test_heuristic_brings_a_parameter_a_sweep_turns_on_in_at_its_start_value():
    """Whatever type the draw starts at, the sweep of the type measures every type at sizes
    inside the heuristic ranges (the draw), never at a default outside them (llama.cpp's
    size_n 12 finds no 12-token match: every type but the drawn one would read 1.00x)."""
    default = {"spec_type": "simple", "size_n": 12, "mod_n": 24}
    starts = set()
    for seed in range(8):
        plan = HeuristicPlan(NGRAM_LIKE, "HH", seed=seed, default=default)
        starts.add(plan.initial["spec_type"])
        results, visited = {}, []
        while (step := plan.next_point(results)) is not None:
            point, _ = step
            visited.append(point)
            results[point_key(point)] = float(point["spec_type"] == "mod")
        for point in visited:
            active = "size_n" if point["spec_type"] == "simple" else "mod_n"
            assert point[active] in (range(2, 5) if active == "size_n" else (5, 6)), point
        assert {p["spec_type"] for p in visited} == {"simple", "mod"}
        assert len({point_key(p) for p in visited}) == len(visited)
    assert starts == {"simple", "mod"}      # both draws were exercised


def test_grid_keeps_inactive_parameters_at_their_default_and_measures_each_method_once():
    plan = GridPlan(TREE_LIKE, {"shape": "dynamic", "width": 2}, "heuristic", "HH")
    points = plan.points
    assert points[0] == {"shape": "dynamic", "width": 2}
    assert sorted(point_key(p) for p in points) == sorted(point_key(p) for p in [
        {"shape": "dynamic", "width": w} for w in (1, 2, 3)] + [
        {"shape": s, "width": 2} for s in ("2-1", "3-1")])


def test_tpe_draws_a_parameter_only_where_it_acts():
    """Define-by-run: with a static shape TPE does not draw a width (it stays at the default), so
    no two trials build the same method from different inactive values."""
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=4))
    seen = []
    for _ in range(24):
        trial = study.ask()
        values = suggest(trial, TREE_LIKE, conditional=True)
        seen.append(values)
        study.tell(trial, float(values["shape"] == "dynamic") + values.get("width", 0) / 10)
    assert {v["shape"] for v in seen} == {"dynamic", "2-1", "3-1"}
    assert all(("width" in v) == (v["shape"] == "dynamic") for v in seen)
    assert all(set(t.params) == set(v) for t, v in zip(study.trials, seen))
    assert set(suggest(study.ask(), TREE_LIKE)) == {"shape", "width"}    # plans: every value


def test_grid_plan_is_complete_and_starts_with_the_default():
    space = {"a": {"type": "int", "low": 1, "high": 3}, "b": {"type": "categorical",
                                                             "choices": ["x", "y"]}}
    plan = GridPlan(space, {"a": 2, "b": "y"})
    results, seen = {}, []
    while (step := plan.next_point(results)) is not None:
        seen.append(step[0])
        results[point_key(step[0])] = 0.0
    assert seen[0] == {"a": 2, "b": "y"} and len(seen) == grid_size(space) == 6
    assert {point_key(p) for p in seen} == {point_key({"a": a, "b": b}) for a in (1, 2, 3)
                                            for b in "xy"}


# moved from tests/test_study.py (its small correctness fixes)
def test_table9_grid_is_the_papers_27_points():
    from tuner.search.plans import GridPlan
    method = yaml.safe_load((ROOT / "conf" / "method" / "ouroboros.yaml").read_text())
    plan = GridPlan(method["space"], {k: method["params"][k] for k in method["space"]}, "table9")
    points = {(p["num_draft_tokens"], p["window"], p["phrase_length"], p["num_phrases"])
              for p in plan.points}
    assert plan.size() == 27 and points == {(g, w, b, 3) for g in (3, 4, 5)
                                             for w in (14, 15, 16) for b in (5, 6, 7)}


# moved from tests/test_study.py (its small correctness fixes)
def test_heuristic_ranges_are_clipped_to_the_space():
    from tuner.search.space import search_values
    space = {"g": {"type": "int", "low": 1, "high": 5, "heuristic": {"HH": [4, 9]}}}
    with pytest.warns(UserWarning, match=r"clipped to \[4, 5\]"):
        assert search_values(space, "heuristic", "HH") == {"g": [4, 5]}


def test_wilcoxon_pruning_stops_a_clearly_worse_trial():
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.WilcoxonPruner(
        p_threshold=0.1, n_startup_steps=2))
    good = study.ask()
    for step in range(20):
        good.report(2.0 + 0.01 * step, step)
    study.tell(good, 2.0)
    bad = study.ask()
    pruned_at = None
    for step in range(20):
        bad.report(0.5 + 0.01 * step, step)
        if bad.should_prune():
            pruned_at = step
            break
    assert pruned_at is not None and pruned_at < 19


# ----------------------------------------------------------------------------------------------
# Lossless check


def _measurement(tokens):
    return Measurement("p0", "", tuple(tokens), "", 1.0, AcceptanceCounts(steps=1), 0.0, 0.0)


def test_lossless_check_fp32_divergence_fails_naming_prompt_and_position():
    target = torch.nn.Linear(2, 2)
    assert check_against_vanilla(_measurement([1, 2, 3]), [1, 2, 3], [0], target,
                                 4).matches_vanilla is True
    with pytest.raises(LosslessViolation, match="prompt p0 differs from vanilla at new-token "
                                                "position 1 \\(fp32"):
        check_against_vanilla(_measurement([1, 5, 3]), [1, 2, 3], [0], target, 4)


def test_lossless_check_bf16_near_tie_versus_real_divergence():
    target = torch.nn.Linear(2, 2).to(torch.bfloat16)
    asked = []

    def gap(ulps):
        return lambda model, ids, chosen, other: (asked.append((ids, chosen, other)), ulps)[1]

    near = check_against_vanilla(_measurement([1, 5]), [1, 2], [0], target, 4, gap_fn=gap(1.0))
    assert near.matches_vanilla is False and near.near_tie
    assert asked == [([0, 1], 2, 5)]      # baseline context, vanilla's token, the method's token
    with pytest.raises(LosslessViolation, match="trails vanilla's by 9.0 ulp"):
        check_against_vanilla(_measurement([1, 5]), [1, 2], [0], target, 4, gap_fn=gap(9.0))
    with pytest.raises(LosslessViolation, match="stops early"):
        check_against_vanilla(_measurement([1]), [1, 2], [0], target, 4, gap_fn=gap(0.0))


class _FixedLogits(torch.nn.Module):
    """A 'model' whose next-token logits are fixed bf16 values (tests the ulp arithmetic)."""

    def __init__(self, logits):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(logits, dtype=torch.bfloat16))

    def forward(self, input_ids, logits_to_keep=1):
        from types import SimpleNamespace
        return SimpleNamespace(logits=self.weight.detach()[None, None])


def test_logit_gap_is_counted_in_bf16_ulps_at_the_chosen_logit():
    from tuner.measure.lossless import logit_gap_ulps, ulp
    assert ulp(20.0, torch.bfloat16) == 0.125 and ulp(1.5, torch.bfloat16) == 2 ** -7
    model = _FixedLogits([20.0, 19.875, 19.0, -3.0])      # 1 ulp and 8 ulp behind token 0
    assert logit_gap_ulps(model, [0], 0, 1) == 1.0
    assert logit_gap_ulps(model, [0], 0, 2) == 8.0
    assert logit_gap_ulps(model, [0], 0, None) == 1.0     # runner-up


# ----------------------------------------------------------------------------------------------
# End to end



def test_the_mlflow_view_sorts_by_the_first_objective_in_its_direction():
    """Best first is the first objective's best: a minimised one sorts ascending, a levelled one
    by its MLflow name, and its column comes first (the others follow, none twice)."""
    from tuner.tracking.trackers import VIEW_METRICS, view_state
    view = view_state("s", ["gamma"], "energy_ratio", "minimize")
    assert view["orderByKey"] == "metrics.`energy_ratio`" and view["orderByAsc"] is True
    levelled = view_state("s", [], "decode_speedup@c4", "maximize")
    assert levelled["orderByKey"] == "metrics.`decode_speedup_at_c4`"
    assert levelled["orderByAsc"] is False
    default = view_state("s", ["gamma"])
    assert default["selectedColumns"] == [f"metrics.`{m}`" for m in VIEW_METRICS] + \
        ["params.`gamma`"] == default["columnOrder"]
    decode = view_state("s", [], "decode_speedup", "maximize")["selectedColumns"]
    assert decode[0] == "metrics.`decode_speedup`" and len(decode) == len(set(decode))

def test_study_end_to_end_with_mlflow(tmp_path, capsys):
    import mlflow
    result = run_cfg(tmp_path, "search=grid", "search.ranges=full",
                     "method.space.num_draft_tokens.high=2",
                     "method.params.num_draft_tokens=2",
                     "tracking.experiment=e2e")
    out = capsys.readouterr().out
    # the default (γ=2) is one of the grid's two points: two trials in all
    assert "trial 0 [default] {'num_draft_tokens': 2} (1 of at most 2 trials)" in out
    assert "trial 1 [grid] {'num_draft_tokens': 1} (2 of at most 2 trials, ~" in out
    assert "(at most 2 trials)" in out
    assert result["params"]["num_draft_tokens"] in (1, 2)
    assert result["held_out_matches_vanilla"] == 1.0
    study = load_study(tmp_path)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 2 and {t.params["num_draft_tokens"] for t in complete} == {1, 2}
    assert study.user_attrs["fingerprint"]["budget.max_new_tokens"] == "6"
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["e2e"], output_format="list")
    kinds = sorted(r.data.tags.get("kind") for r in runs)
    assert kinds == ["baseline", "study", "trial", "trial"]
    parent = next(r for r in runs if r.data.tags["kind"] == "study")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 3
    trial_run = next(r for r in children if r.data.tags["kind"] == "trial")
    for metric in ("tokens_per_s", "speedup", "mean_accepted_tokens", "acceptance_rate",
                   "matches_vanilla", "quality_accuracy", "acceptance_pos_01",
                   "vanilla_tokens_per_s"):
        assert metric in trial_run.data.metrics, metric
    assert trial_run.data.metrics["matches_vanilla"] == 1.0
    if not torch.cuda.is_available():     # energy unavailable: the reason is recorded instead
        assert "energy_j_per_token" not in trial_run.data.metrics
        assert "NVML" in parent.data.tags["energy"]
    assert "pid" not in trial_run.data.metrics and "best_pid" not in parent.data.metrics
    baseline = next(r for r in children if r.data.tags["kind"] == "baseline")
    assert baseline.data.metrics["speedup"] == 1.0
    assert all(r.info.status == "FINISHED" for r in runs)
    winner = [r for r in children if r.data.tags.get("winner") == "true"]
    assert len(winner) == 1 and winner[0].data.tags["trial"] == str(result["trial"])
    assert winner[0].info.run_name == f"best: trial-{result['trial']}"
    assert all(r.data.tags["study_name"] == "t" for r in children)
    first_trial = min((r for r in children if r.data.tags["kind"] == "trial"),
                      key=lambda r: int(r.data.tags["trial"]))
    # the baseline run spans the trial that measured it, not a few ms at its end
    assert baseline.info.start_time == pytest.approx(first_trial.info.start_time, abs=1000)
    assert baseline.info.end_time - baseline.info.start_time > 100
    client = mlflow.MlflowClient()
    table = client.download_artifacts(parent.info.run_id, "trials.csv", str(tmp_path))
    lines = open(table).read().splitlines()
    assert lines[0].startswith("trial,state,num_draft_tokens,speedup") and len(lines) == 3
    assert f"| {result['trial']} | COMPLETE |" in parent.data.tags["mlflow.note.content"]
    assert study.metric_names == ["speedup"]
    assert parent.data.tags["best_trial"] == str(result["trial"])
    assert "Recommendation" in parent.data.tags["mlflow.note.content"]
    assert parent.data.params["budget.max_new_tokens"] == "6"
    assert parent.data.params["models.target.kind"] == "tiny"
    assert parent.data.params["sampling.temperature"] == "0.0"
    # the printed link opens a view saved as the UI's Share button saves one: this study's runs,
    # best first, each column naming a metric or parameter its runs carry
    key = re.search(r"runs\?workflowType=machine_learning&viewStateShareKey=([0-9a-f]+)$",
                    out, re.M).group(1)
    experiment = client.get_experiment_by_name("e2e")
    view = json.loads(experiment.tags[f"mlflow.sharedViewState.{key}"])
    assert view["searchFilter"] == 'tags.study_name = "t"' and view["orderByAsc"] is False
    assert view["orderByKey"] == "metrics.`speedup`"
    logged = {f"metrics.`{m}`" for r in runs for m in r.data.metrics} | \
        {f"params.`{k}`" for r in runs for k in r.data.params}
    assert view["selectedColumns"][0] == "metrics.`speedup`"
    assert set(view["selectedColumns"]) <= logged, set(view["selectedColumns"]) - logged
    assert {"metrics.`best_held_out_speedup`", "metrics.`decode_speedup`",
            "params.`num_draft_tokens`"} <= set(view["selectedColumns"])
    assert "best_held_out_speedup" in parent.data.metrics
    assert parent.data.tags["torch"] == torch.__version__ and parent.data.tags["git_commit"]
    best = tmp_path / "studies" / "best" / "t.yaml"
    loaded = yaml.safe_load(best.read_text())
    assert loaded["method"] == {"params": result["params"]}
    assert loaded["replay"]["study"] == "t" and loaded["replay"]["trial"] == result["trial"]
    replay = compose_cfg(tmp_path, "+best=t")
    assert replay.method.params.num_draft_tokens == result["params"]["num_draft_tokens"]


def test_a_raising_trial_does_not_stop_the_study(tmp_path, monkeypatch):
    from tuner.engines.inprocess import HFEvaluator
    real = HFEvaluator.measure

    def flaky(self, params, prompts, parity, store=None):
        if params["num_draft_tokens"] == 2:
            raise torch.OutOfMemoryError("simulated out of memory")
        return real(self, params, prompts, parity, store)

    monkeypatch.setattr(HFEvaluator, "measure", flaky)
    result = run_cfg(tmp_path, "search=grid", "search.ranges=full",
                     "method.space.num_draft_tokens.high=3",
                     "method.params.num_draft_tokens=1",
                     "tracking=none")
    study = load_study(tmp_path)
    failed = study.get_trials(states=(TrialState.FAIL,))
    assert len(failed) == 1 and "simulated out of memory" in failed[0].user_attrs["error"]
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 2
    assert result["params"]["num_draft_tokens"] in (1, 3)


def test_a_lossless_violation_fails_the_trial(tmp_path, monkeypatch):
    from decoding.speculative import SpeculativeDecoding
    real = SpeculativeDecoding._verify

    def broken(self, draft, logits, generator):   # accept one token more than allowed
        verdict = real(self, draft, logits, generator)
        if verdict.accepted < draft.size:
            return type(verdict)(verdict.accepted + 1, verdict.next_token)
        return verdict

    monkeypatch.setattr(SpeculativeDecoding, "_verify", broken)
    with pytest.raises(RuntimeError, match="no trial completed"):
        run_cfg(tmp_path, "search=grid", "search.ranges=full",
                "method.space.num_draft_tokens.high=1",
                "method.params.num_draft_tokens=1", "tracking=none")
    failed = load_study(tmp_path).get_trials(states=(TrialState.FAIL,))
    assert failed and "differs from vanilla at new-token position" in failed[0].user_attrs["error"]


def test_always_failing_trials_stop_at_the_trial_budget(tmp_path, monkeypatch):
    from tuner.engines.inprocess import HFEvaluator

    def broken(self, params, prompts, parity, store=None):
        raise RuntimeError("always broken")

    monkeypatch.setattr(HFEvaluator, "measure", broken)
    with pytest.raises(RuntimeError, match="no trial completed"):
        run_cfg(tmp_path, "search=tpe", "search.n_trials=3", "tracking=none")
    assert len(load_study(tmp_path).get_trials(states=(TrialState.FAIL,))) == 3


def test_tpe_search_with_pruner_runs(tmp_path):
    run_cfg(tmp_path, "search=tpe", "search.n_trials=3", "tracking=none")
    study = load_study(tmp_path)
    assert len(study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))) == 3
    assert study.trials[0].params == {"num_draft_tokens": 4}          # trial 0 = the default


def test_a_clearly_slower_trial_is_pruned_and_never_wins(tmp_path):
    """The Wilcoxon pruner really fires: a configuration ten times slower than trial 0 on
    every prompt is stopped after a few of its 8 prompts, ends PRUNED (not COMPLETE), is recorded
    as such in MLflow and is never the winner. (The timer is the real generation's; only the
    method's wall time is scaled, so the paired speedups are clearly ordered.)"""
    from tuner.measure.timing import time_generation

    def timer(method, ids, max_new_tokens, device):
        out, wall = time_generation(method, ids, max_new_tokens, device)
        slow = getattr(method, "num_draft_tokens", 4) != 4       # vanilla has none
        return out, wall * (10.0 if slow else 1.0)

    from tuner.run import run
    result = run(compose_cfg(tmp_path, "search=tpe", "search.n_trials=3", "task.n_prompts=8",
                             "budget=full",
                             "tracking.experiment=prune"), timer)
    study = load_study(tmp_path)
    pruned = study.get_trials(states=(TrialState.PRUNED,))
    assert pruned, [(t.number, t.state, t.params) for t in study.trials]
    for trial in pruned:
        assert trial.params["num_draft_tokens"] != 4
        assert 2 <= trial.user_attrs["pruned_at"] < 8             # stopped before the end
        assert len(trial.intermediate_values) == trial.user_attrs["pruned_at"]
    assert result["trial"] not in {t.number for t in pruned}
    assert result["params"]["num_draft_tokens"] == 4
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["prune"], output_format="list")
    states = {r.data.tags["trial"]: r.data.tags["state"] for r in runs
              if r.data.tags.get("kind") == "trial"}
    assert all(states[str(t.number)] == "PRUNED" for t in pruned)


def test_an_energy_objective_without_gpu_energy_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="includes energy_j_per_token, which needs GPU energy "
                                         "measurements, unavailable here: NVML unavailable"):
        run_cfg(tmp_path, "search=pareto_energy", "tracking=none")


def test_killed_study_resumes_without_losing_trials(tmp_path):
    """SIGKILL a real subprocess mid-trial; the rerun keeps every COMPLETE trial, fails the orphan."""
    args = [sys.executable, "-m", "tuner", "+task=gsm8k", *FAST, "search=grid",
            "search.ranges=full",
            "method.space.num_draft_tokens.high=4", "tracking=none", "study_name=t",
            "task.max_new_tokens=24"]
    env = ENV
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:       # wait until trial 1 has started measuring prompts
        text = (tmp_path / "first.log").read_text()
        if "trial 1 prompt 1/" in text:
            break
        assert proc.poll() is None, text
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = load_study(tmp_path)
    complete_before = {t.number: t.params for t in before.get_trials(states=(TrialState.COMPLETE,))}
    assert complete_before and before.trials[-1].state == TrialState.RUNNING
    rerun = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert "marked FAIL, its point will be evaluated again" in rerun.stdout
    after = load_study(tmp_path)
    for number, params in complete_before.items():
        assert after.trials[number].state == TrialState.COMPLETE
        assert after.trials[number].params == params
    orphan = after.trials[len(complete_before)]
    assert orphan.state == TrialState.FAIL
    assert failure_reason(after, orphan).startswith("orphaned")
    done = {t.params["num_draft_tokens"] for t in after.get_trials(states=(TrialState.COMPLETE,))}
    assert done == {1, 2, 3, 4}


def test_summary_reports_speed_per_category():
    from tuner.measure.measurement import summarize

    def m(category, wall, speedup):
        return Measurement("p", category, (1, 2, 3, 4), "", wall,
                           AcceptanceCounts(steps=2, prefills=1, drafts=2, drafted=2, accepted=1,
                                            accepted_per_position=(1,),
                                            drafted_per_position=(2,)), 0.0, 0.0,
                           speedup=speedup)

    summary = summarize([m("qa", 1.0, 2.0), m("qa", 1.0, 0.5), m("rag", 2.0, 1.5)], None,
                        torch.device("cpu"))
    assert summary["truncated_fraction"] == 0.0
    assert summary["tokens_per_s_qa"] == pytest.approx(4.0)
    assert summary["tokens_per_s_rag"] == pytest.approx(2.0)
    assert summary["speedup_qa"] == pytest.approx(1.0) and summary["speedup_rag"] == 1.5
    assert summary["speedup"] == pytest.approx((2.0 * 0.5 * 1.5) ** (1 / 3))
    assert summary["mean_accepted_tokens"] == pytest.approx(1 + 3 / 6)


def test_a_stale_journal_lock_from_a_killed_run_is_released(tmp_path):
    """A writer SIGKILLed while holding the journal lock must not hang the next run forever:
    the lock, unchanged for the grace period (30 s by default; 3 s here, the test's time), is
    removed and the run goes on, after the grace and long before Optuna's default."""
    code = """
import os, time, optuna
from pathlib import Path
from tuner.study.storage import make_storage
optuna.logging.set_verbosity(optuna.logging.ERROR)
optuna.create_study(study_name="s", storage=make_storage(None, "studies/s.journal"))
lock = Path("studies/s.journal.lock")
lock.write_text("")                                    # the lock a killed writer leaves behind
os.utime(lock, (time.time() - 100, time.time() - 100))
began = time.monotonic()
optuna.load_study(study_name="s",
                  storage=make_storage(None, "studies/s.journal", lock_grace_s=3)).ask()
print("released after", round(time.monotonic() - began, 1), "s")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=150, env=ENV)
    assert result.returncode == 0 and "released after" in result.stdout, result.stderr[-2000:]
    waited = float(result.stdout.split("released after")[1].split()[0])
    assert 3 <= waited < 20, waited          # the grace passed reaches Optuna's lock
