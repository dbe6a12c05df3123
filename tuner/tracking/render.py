"""Renderers of a ``StudyOutcome``: each takes the outcome and nothing else.

* ``rows``: the summary table (terminal and the MLflow note);
* ``print_summary``: the table and the recommendation on the terminal;
* ``study_result``: the MLflow parent run's metrics, tags, files, note and trials table;
* ``write_best_yaml``: the winner as a Hydra config that replays (``+best=<study>``), its deploy
  block as YAML structures (an outcome without held-out prompts writes it as
  ``deploy_unconfirmed``: nothing unconfirmed reads as a recommendation);
* ``write_outcome_json``: the versioned ``outcome.json`` beside it;
* ``publish``: all of them, in order, after the plots of the study's trials.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

import optuna
from omegaconf import OmegaConf

from tuner.study.callbacks import Callback, StudyResult
from tuner.answer.outcome import StudyOutcome
from tuner.study.record import FIGURES
from tuner.tracking.report import plots_html, plots_png, summary_rows


def text(value: Any) -> str:
    """A deploy entry on one line: text as is, structures as compact JSON."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def deploy_key(outcome: StudyOutcome) -> str:
    return "deploy" if outcome.confirmed_any else "deploy_unconfirmed"


def rows(outcome: StudyOutcome) -> list[tuple[str, str]]:
    """The summary table: the head rows, one line per level and rate decision, prediction,
    time, the per-level plan, the deploy entries."""
    out = list(outcome.summary) if outcome.winner is None else head_rows(outcome)
    out += [(d.label, d.reason) for d in outcome.decisions]
    out += [(f"method {m['method']}", method_line(m)) for m in outcome.methods]
    p = outcome.prediction
    if p.calibration_line:
        out.append(("prediction (search.profile)", p.calibration_line))
    if p.profile_check:
        out.append(("profile check (trial 0)", p.profile_check))
    if outcome.time:
        out.append(("time", outcome.time))
    if p.served is not None:
        out += [tuple(row) for row in p.served["rows"]]
    if p.elsewhere is not None:
        out.append(("predicted for another machine (search.predict_for)", p.elsewhere["line"]))
        out += [("predicted schedule", line) for line in p.elsewhere.get("schedule_lines", [])]
    label = "deploy" if outcome.confirmed_any else "deploy (unconfirmed)"
    out += [(f"{label}: {key}", text(value)) for key, value in outcome.deploy.items()]
    return out


def head_rows(outcome: StudyOutcome) -> list[tuple[str, str]]:
    """The table's head: the winner, its tuning and held-out figures, quality, energy, notes."""
    w = outcome.winner
    best = {"trial": w.trial, "value": w.value, "trials": w.trials}
    return summary_rows(outcome.study, w.shown, best, outcome.confirmed, w.figures,
                        outcome.budget, list(outcome.notes), outcome.energy_reason,
                        outcome.quality_bound, outcome.objective)


def print_summary(outcome: StudyOutcome, say: Callable[[str], None]) -> None:
    say("\n" + "=" * 78)
    for key, value in rows(outcome):
        say(f"{key:<32} {value}")
    say(f"RECOMMENDATION: {outcome.recommendation}")
    say("=" * 78)


def study_result(outcome: StudyOutcome) -> StudyResult:
    """What the MLflow parent run records: the best trial's figures and the held-out ones as
    metrics, the decisions and the deploy answer as tags (JSON text where a tag needs one)."""
    metrics = dict(outcome.metrics)
    tags: dict[str, str] = {}
    files: list[tuple[str, Path]] = []
    if outcome.winner is not None:
        metrics.update({f"best_{k}": v for k, v in outcome.winner.figures.items()
                        if k in FIGURES})
        metrics.update({f"best_{k}": v for k, v in outcome.confirmed.items()})
        tags.update({"best_params": json.dumps(dict(outcome.winner.params)),
                     "best_trial": str(outcome.winner.trial)})
        tags.update({f"deploy_{key}": text(value) for key, value in outcome.deploy.items()})
        if not outcome.confirmed_any:
            tags["deploy_confirmed"] = "false"
        if "infeasible_trials" in outcome.metrics:      # a quality bound: the winner kept it
            tags["best_feasible"] = "true"
        if outcome.best_path is not None:
            files.append(("best", outcome.best_path))
            files.append(("best", outcome.outcome_path))
        files += [("plots", plot) for plot in outcome.plots]
    else:
        tags.update({"best_trial": "none", "best_feasible": "none"})
    for d in outcome.decisions:
        tags[f"decision_{d.kind}_{d.at}"] = d.state.value
    p = outcome.prediction
    if p.served is not None:
        tags["predicted_schedule_checks"] = json.dumps(p.served["checks_data"])
    if p.elsewhere is not None:
        tags.update({"predicted_for_machine": f"{p.elsewhere['machine']} "
                                              f"({p.elsewhere['kind']})",
                     "predicted_for_best_params": json.dumps(p.elsewhere["params"])})
    table = rows(outcome)
    return StudyResult(table, outcome.recommendation, metrics, tags, files,
                       None if outcome.winner is None else outcome.winner.trial,
                       list(outcome.trials))


def write_best_yaml(outcome: StudyOutcome) -> Path:
    """The winner as a Hydra config (``outcome.replay``, written by the finish from the study's
    settings) and its deploy block as YAML structures."""
    path = outcome.best_path
    assert path is not None and outcome.winner is not None
    path.parent.mkdir(parents=True, exist_ok=True)
    body = dict(outcome.replay)
    if outcome.deploy:
        body[deploy_key(outcome)] = dict(outcome.deploy)
    path.write_text(outcome.replay_header + OmegaConf.to_yaml(body))
    return path


def write_outcome_json(outcome: StudyOutcome) -> Path:
    """``<study>.outcome.json`` beside the best YAML."""
    path = outcome.outcome_path
    path.write_text(json.dumps(outcome.to_json(), indent=1, sort_keys=False) + "\n")
    return path


def publish(outcome: StudyOutcome, study: optuna.Study, callbacks: Callback,
            say: Callable[[str], None]) -> None:
    """Every rendering of a finished study: the plots of its trials (made from the Optuna study,
    beside the best YAML), then each renderer given the outcome alone."""
    if outcome.winner is not None and outcome.best_path is not None:
        path = outcome.best_path
        path.parent.mkdir(parents=True, exist_ok=True)
        outcome = replace(outcome, plots=tuple(plot for plot in (
            plots_png(study, path.with_suffix(".history.png")),
            plots_html(study, path.with_suffix(".plots.html"))) if plot))
        write_best_yaml(outcome)
        write_outcome_json(outcome)
    callbacks.study_finished(study_result(outcome))
    print_summary(outcome, say)
    if outcome.winner is not None:
        say(f"best configuration written to {outcome.best_path}")


def method_line(row: Mapping[str, Any]) -> str:
    """One method of a cross-method study: its best measured, its best predicted, its trials."""
    best = "no finished trial" if row.get("best") is None else \
        f"best {row['best']:.3f}x {row.get('objective', '')} (trial #{row['best_trial']})"
    predicted = row.get("predicted_best")
    shown = "not ranked (no profile prices it: measured at its start point)" \
        if row.get("ranked") is False else \
        "no prediction" if predicted is None else f"best predicted {predicted:.3f}x"
    return (f"{best}; {shown}; {row['finished']} finished, {row['dropped']} dropped, "
            f"{row['failed']} failed, {row['seconds']:.0f} s")
