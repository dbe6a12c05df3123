"""Quality of lossy trials: perplexity under the target, the quality bound as Optuna constraints,
and studies that never report an infeasible trial as best (tuner/measure/quality.py,
tuner/answer/finish.py)."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from optuna.trial import TrialState

from decoding import build_method, generate
from tests.conftest import tiny_pair
from tests.conftest import compose_cfg, load_study
from tuner.measure.measurement import Measurement
from tuner.measure.timing import time_generation
from tuner.measure.quality import QualityBound, compare, mean_log_prob, perplexity
from decoding.acceptance import AcceptanceCounts

# mjsd on the tiny pair (target seed 0, unrelated draft seed 1), greedy, a 2-point grid over τ
TINY_MJSD = ["method=mjsd", "sampling=greedy", "models=tiny", "task.n_prompts=2",
             "task.n_held_out=1", "task.max_new_tokens=6", "warmup_prompts=0",
             "method.params.num_beams=2", "method.params.num_draft_tokens=2",
             "~method.space", "+method.space={tau:{type:float,low:0.0,high:0.9,step:0.9}}"]


pytestmark = pytest.mark.usefixtures("in_tmp")


def test_perplexity_of_vanilla_greedy_output_equals_a_direct_computation():
    pair = tiny_pair("related", initializer_range=0.3)       # peaked: greedy beats uniform
    prompt = [3, 1, 4, 1, 5]
    tokens = list(generate(build_method("vanilla", pair), prompt, 12).tokens)
    log_probs = []
    for t, token in enumerate(tokens):                     # one full forward per position
        with torch.no_grad():
            logits = pair.target(torch.tensor([prompt + tokens[:t]])).logits[0, -1].double()
        log_probs.append(float(torch.log_softmax(logits, -1)[token]))
    direct = math.exp(-sum(log_probs) / len(log_probs))
    mine = perplexity([mean_log_prob(pair.target, prompt, tokens)])
    assert mine == pytest.approx(direct, rel=1e-5)
    assert mine < pair.target.config.vocab_size             # greedy is better than uniform
    assert perplexity([-1.0, -3.0]) == pytest.approx(math.exp(2.0))   # mean over outputs


def test_quality_record_and_bound():
    record = compare({"accuracy": 0.5}, {"accuracy": 0.75}, [-1.0], [-0.5])
    assert record["quality_drop"] == 0.25 and record["vanilla_quality_accuracy"] == 0.75
    assert record["perplexity_ratio"] == pytest.approx(math.exp(0.5))
    bound = QualityBound(max_quality_drop=0.3, max_perplexity_ratio=1.5)
    assert bound.constraints(record, lossless=False) == pytest.approx(
        {"quality_drop": -0.05, "perplexity_ratio": math.exp(0.5) - 1.5})
    assert bound.constraints(record, lossless=True) == {"quality_drop": 0.0,
                                                        "perplexity_ratio": 0.0}
    assert QualityBound().constraints(record, False) == {} and not QualityBound().active


@pytest.fixture
def rigged(monkeypatch):
    """τ = 0 looks twice as fast (within its physical bound: it accepts most drafts) but accepts
    the unrelated draft's tokens: perplexity 20 where
    vanilla's greedy output (and every τ > 0 output, identical at T = 0) has 10."""
    import tuner.engines.inprocess as run_module
    vanilla_outputs: dict[tuple, tuple] = {}

    def fake_log_prob(model, prompt_ids, tokens):
        key = (tuple(prompt_ids), len(tokens))
        if key not in vanilla_outputs:
            vanilla_outputs[key] = generate(build_method("vanilla", tiny_pair("same")),
                                            list(prompt_ids), len(tokens)).tokens
        return -math.log(10.0 if tuple(tokens) == vanilla_outputs[key] else 20.0)

    def timer(method, ids, max_new_tokens, device):
        out, wall = time_generation(method, ids, max_new_tokens, device)
        return out, wall * (0.5 if getattr(method, "tau", None) == 0.0 else 1.0)

    monkeypatch.setattr(run_module, "mean_log_prob", fake_log_prob)
    return timer


def test_a_constrained_study_never_reports_an_infeasible_trial_as_best(tmp_path, rigged):
    from tuner.run import run
    result = run(compose_cfg(tmp_path, *TINY_MJSD, "search=grid", "search.ranges=full",
                             "search.max_perplexity_ratio=1.5", "tracking.experiment=q"), rigged)
    study = load_study(tmp_path)
    trials = {t.params["tau"]: t for t in study.get_trials(states=(TrialState.COMPLETE,))}
    fast, slow = trials[0.0], trials[0.9]
    assert fast.values[0] > slow.values[0]                  # the infeasible one is faster ...
    assert fast.user_attrs["feasible"] is False and fast.constraints["perplexity_ratio"] > 0
    assert slow.user_attrs["feasible"] is True and slow.constraints["perplexity_ratio"] <= 0
    assert result["trial"] == slow.number and result["params"]["tau"] == 0.9   # ... never best
    assert study.best_trial.number == slow.number           # Optuna agrees (constraints)
    assert result["held_out_feasible"] == 1.0
    assert result["held_out_perplexity_ratio"] == pytest.approx(1.0)
    best = yaml.safe_load((tmp_path / "studies" / "best" / "t.yaml").read_text())
    assert best["method"]["params"]["tau"] == 0.9
    assert best["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["q"], output_format="list")
    by_trial = {r.data.tags.get("trial"): r for r in runs if r.data.tags.get("kind") == "trial"}
    assert by_trial[str(fast.number)].data.tags["feasible"] == "false"
    assert by_trial[str(slow.number)].data.tags["feasible"] == "true"
    assert by_trial[str(fast.number)].data.metrics["perplexity_ratio"] == pytest.approx(2.0)
    assert by_trial[str(slow.number)].data.params["sampling.temperature"] == "0.0"
    parent = next(r for r in runs if r.data.tags.get("kind") == "study")
    assert parent.data.params["search.max_perplexity_ratio"] == "1.5"
    assert parent.data.tags["best_feasible"] == "true"
    assert parent.data.metrics["infeasible_trials"] == 1.0
    assert "perplexity_ratio <= 1.5" in parent.data.tags["mlflow.note.content"]


def test_with_no_feasible_trial_the_study_recommends_vanilla(tmp_path, rigged, capsys):
    from tuner.run import run
    result = run(compose_cfg(tmp_path, *TINY_MJSD, "search=grid", "search.ranges=full",
                             "search.max_perplexity_ratio=0.5", "tracking=none"), rigged)
    assert result["feasible"] is False and result["trials"] == 2
    assert "use vanilla decoding: no configuration met the quality bound" in \
        capsys.readouterr().out
    assert not (Path("studies") / "best" / "t.yaml").exists()


def test_tpe_gets_the_constraints_and_pareto_runs_speed_against_perplexity(tmp_path, rigged):
    from tuner.run import run
    run(compose_cfg(tmp_path, *TINY_MJSD, "search=tpe", "search.n_trials=2", "search.pruner=null",
                    "search.max_perplexity_ratio=1.5", "tracking=none"), rigged)
    study = load_study(tmp_path)
    done = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(done) == 2 and all("perplexity_ratio" in t.constraints for t in done)
    result = run(compose_cfg(tmp_path, *TINY_MJSD, "search=pareto", "search.n_trials=2",
                             "tracking=none", "study_name=p"), rigged)
    pareto = load_study(tmp_path, "p")
    assert [d.name for d in pareto.directions] == ["MAXIMIZE", "MINIMIZE"]
    assert all(len(t.values) == 2 for t in pareto.get_trials(states=(TrialState.COMPLETE,)))
    assert result["trial"] in {t.number for t in pareto.best_trials}


def test_energy_against_vanilla_is_per_token_and_needs_nvml():
    from tuner.measure.paired import energy_versus as _energy_versus

    def m(tokens, joules):
        return Measurement("p", "", (1,) * tokens, "", 1.0, AcceptanceCounts(steps=1), 0.0, 0.0,
                           energy_j=joules)

    assert _energy_versus({"energy_j_per_token": 0.5}, [m(4, 4.0), m(6, 6.0)]) == {
        "vanilla_energy_j_per_token": 1.0, "energy_ratio": 0.5}
    assert _energy_versus({"energy_j_per_token": 0.5}, [m(4, None)]) == {}
    assert _energy_versus({}, [m(4, 4.0)]) == {}            # CPU: the method has no reading


def test_optuna_reads_the_constraints_we_set():
    """Trial.set_constraint (Optuna 5; constraints_func is deprecated) reaches Study.best_trial."""
    study = optuna.create_study(direction="maximize")
    for value, violation in ((3.0, 1.0), (1.0, -0.5), (2.0, 0.0)):
        trial = study.ask()
        trial.set_constraint("perplexity_ratio", violation)
        study.tell(trial, value)
    assert study.best_trial.value == 2.0
