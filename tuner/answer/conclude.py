"""From a confirmed winner to the ``StudyOutcome`` (``tuner.answer.outcome``): every decision
made once (``tuner.answer.decide``), the deploy answer as nested data (the evaluator's launch line
and request, per level and per rate as decided, the schedule forms prediction wrote), what
prediction added, the summary's head rows, notes and the replay body of the best YAML. Nothing
here writes or prints: the renderers do (``tuner.tracking.render``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from optuna.trial import FrozenTrial

from tuner.config.union import METHOD, is_union, member_of
from tuner.predict.predict import summary_line
from tuner.search.space import active_params
from tuner.answer import decide
from tuner.study.guard import CONTROL, OVERRIDE
from tuner.study.level_plan import level_schedule
from tuner.study.level_plan import rows as level_plan_rows
from tuner.answer.notes import compare_previous, study_notes, time_line, trials_table
from tuner.answer.outcome import Decision, Prediction, StudyOutcome, Winner
from tuner.answer.predicted import predict_elsewhere, prediction_calibration
from tuner.study.record import TrialRecord
from tuner.study.trials import completed, trial_params
from tuner.answer.verdict import verdict_key

if TYPE_CHECKING:
    import optuna

    from tuner.measure.evaluator import Evaluator
    from tuner.study.settings import StudySettings


def conclude(settings: StudySettings, study: optuna.Study, evaluator: Evaluator,
             winner: FrozenTrial, confirmed: Mapping[str, float],
             say: Callable[[str], None]) -> StudyOutcome:
    """The winner and its held-out confirmation (``confirmed``) into one ``StudyOutcome``, with
    every decision made once (``tuner.answer.decide``)."""
    params = trial_params(settings, winner)
    own_settings, own = settings, params       # a union's winner: its member's (tuner.config.union)
    if is_union(settings.method):
        name, _, own = member_of(settings.method, params)
        from tuner.study.settings import member_settings
        own_settings = member_settings(settings, name)
    best = {"trial": winner.number, "value": winner.values[0], "trials": len(completed(study)),
            "run_id": winner.user_attrs.get("mlflow_run_id")}
    margin = control_margin(study)
    levels, rates = decide.decisions(settings, study, confirmed, winner.number, margin)
    prediction, forms = predictions(settings, study, evaluator, params, say)
    deploy = deploy_answer(settings, evaluator, params, levels, rates, forms)
    record = TrialRecord.read(winner)
    figures = {**record.figures, **({} if record.feasible is None else
                                    {"feasible": record.feasible})}
    folder = Path(settings.studies_dir) / "best"
    notes = study_notes(settings, study, confirmed, figures)
    since = compare_previous(folder, settings.family, settings.name, params, confirmed)
    header, replay = replay_body(own_settings, own, best, confirmed)
    described = evaluator.describe()
    advice = decide.recommendation(settings, confirmed, levels, rates, margin)
    methods = ()
    if own_settings is not settings:          # which method, in the answer's own words
        methods = tuple(methods_table(settings, study))
        advice = name_the_method(advice, own_settings.method_choice,
                                 active_params(own, own_settings.space))
    return StudyOutcome(
        study=settings.name, method=own_settings.method_choice, task=settings.task.name,
        objective=settings.objectives[0], engine={"kind": settings.engine["kind"],
                                                   **described},
        winner=Winner(winner.number, float(winner.values[0]), best["trials"], best["run_id"],
                      own, active_params(own, own_settings.space), figures),
        confirmed=confirmed, levels=levels, rates=rates, deploy=deploy, prediction=prediction,
        recommendation=advice, methods=methods,
        notes=(*([since] if since else []), *notes), acceptance=acceptance(confirmed),
        budget=dict(settings.budget), energy_reason=described.get("energy", ""),
        quality_bound=settings.bound.describe() if settings.bound.active or
        not settings.lossless else None,
        time=time_line(study), cost=search_cost(study),
        trials=tuple(trials_table(settings, study)),
        metrics=study_metrics(settings, study, prediction), replay=replay,
        replay_header=header, best_path=folder / f"{settings.name}.yaml")


def control_margin(study: optuna.Study) -> float:
    """What a held-out ratio must beat vanilla by beyond its lower bound: the A/A control's
    bias where the study measured anyway although the control read beyond its bound
    (``control.override``); within its bound the control's deviation is noise, which the lower
    bound already holds (0)."""
    report = study.user_attrs.get(CONTROL)
    if not report or report.get("within") or not study.user_attrs.get(OVERRIDE):
        return 0.0
    return max(abs(row["ratio"] - 1.0) for row in report["rows"])


def predictions(settings: StudySettings, study: optuna.Study, evaluator: Evaluator,
                params: Mapping[str, Any], say: Callable[[str], None]
                ) -> tuple[Prediction, dict[str, Any]]:
    """What prediction adds (calibration, the profile check, the per-level plan, the answer for
    another machine) and the schedule forms it yields for the deploy block."""
    forms: dict[str, Any] = {}
    calib = prediction_calibration(study)
    line = None
    if calib is not None:
        shown = f"; profile {settings.profile.describe()}" if settings.profile else ""
        what = "trial-levels (the cost side: each trial's own acceptance)" if \
            calib.get("per_level") else "trials"
        line = summary_line(calib, what) + shown
    check = study.user_attrs.get("profile_check") or {}
    try:
        served = level_schedule(settings, study, params)
    except Exception as err:          # noqa: BLE001 - the schedule never costs the finish
        say(f"the predicted per-level schedule failed ({type(err).__name__}: {err}); the "
            "study finishes without it")
        served = None
    planned = None
    base = evaluator.speculative_base(params)       # a vLLM form's fixed entries, else None
    if served is not None:
        forms.update(settings.engine_object.schedule_form(served["schedule"], base))
        planned = {"rows": level_plan_rows(served), "confirmed": float(
            sum(c.confirmed for c in served["checks"])), "checks_data": [
            {"batch": c.batch, "k": c.k, "predicted": c.predicted, "measured": c.measured,
             "best_k": c.best_k, "best": c.best} for c in served["checks"]]}
    elsewhere = predict_elsewhere(settings, evaluator, params, say)
    if elsewhere is not None:
        schedule = elsewhere.pop("schedule", None)
        if schedule is not None:
            from tuner.predict.forms import every_form
            elsewhere["schedule_lines"] = schedule.lines()
            forms.update({f"predicted_{key}": value for key, value in every_form(
                schedule, base).items()})
    return Prediction(calib, line, (check.get("line") or "").removeprefix("profile check: ")
                      or None, settings.profile.describe() if settings.profile else None,
                      planned, elsewhere), forms


def deploy_answer(settings: StudySettings, evaluator: Evaluator, params: Mapping[str, Any],
                  levels: tuple[Decision, ...], rates: tuple[Decision, ...],
                  forms: Mapping[str, Any]) -> dict[str, Any]:
    """How to run the winner (the evaluator's launch line and request), per level as decided,
    per rate as decided, and the schedule forms prediction wrote: nested data."""
    per_level = {int(d.at): d.deployed for d in levels} if len(settings.concurrency) >= 2 \
        else {}
    deploy = dict(evaluator.deployment(params, per_level))
    if settings.traffic.rates:
        deploy["per_rate"] = {d.at: None if d.deployed is None else dict(d.deployed)
                              for d in rates}
    return {**deploy, **forms}


def acceptance(confirmed: Mapping[str, float]) -> dict[str, Any]:
    """The held-out winner's acceptance per draft position, with its draft counts."""
    rates = sorted(k for k in confirmed if k.startswith("held_out_acceptance_pos_"))
    return {"where": "held-out prompts, the winner", "positions": [
        {"position": int(k.rsplit("_", 1)[1]), "accepted_fraction": confirmed[k],
         "drafts": confirmed.get(k.replace("acceptance_pos_", "drafted_pos_"))}
        for k in rates]} if rates else {}


def search_cost(study: optuna.Study) -> dict[str, Any]:
    """What the search was estimated to cost (``tuner.search.cost``) and what each phase spent,
    summed over the runs of this study (seconds)."""
    spent = study.user_attrs.get("phase_seconds") or {}
    return {"estimates": study.user_attrs.get("estimates") or {},
            "spent_s": {k: round(sum(v), 1) for k, v in spent.items()}}


def study_metrics(settings: StudySettings, study: optuna.Study,
                  prediction: Prediction) -> dict[str, float]:
    """Study-level numbers for the MLflow parent run."""
    out: dict[str, float] = {}
    calib = prediction.calibration
    if calib is not None and calib["median_abs_error"] is not None:
        out["prediction_median_abs_error"] = float(calib["median_abs_error"])
        if calib["spearman"] is not None:
            out["prediction_spearman"] = float(calib["spearman"])
    if prediction.served is not None:
        out["schedule_levels_confirmed"] = prediction.served["confirmed"]
    if prediction.elsewhere is not None:
        out["predicted_for_best_speedup"] = float(prediction.elsewhere["speedup"])
        if prediction.elsewhere["winner_speedup"] > float("-inf"):
            out["predicted_for_winner_speedup"] = float(prediction.elsewhere["winner_speedup"])
    if settings.bound.active:
        out["infeasible_trials"] = float(sum(TrialRecord.read(t).infeasible
                                             for t in completed(study)))
    return out


QUALITY_KEYS = ("held_out_perplexity_ratio", "held_out_quality_drop", "held_out_feasible")
REPLAYED_GROUPS = ("models", "engine", "budget")     # config groups the best YAML re-selects


def replay_body(settings: StudySettings, params: Mapping[str, Any], best: Mapping[str, Any],
                   confirmed: Mapping[str, float]) -> tuple[str, dict[str, Any]]:
    """(header, body) of the winner as a Hydra config that replays as printed: every parameter
    that built it (searched and fixed), the config groups it ran with (models, engine, budget),
    its sampling, seed and budget (task sizes). The deploy block is added where the outcome is
    rendered (``tuner.tracking.render.write_best_yaml``)."""
    speed = confirmed.get("held_out_speedup")
    key = verdict_key(settings.objectives[0], confirmed)      # what the verdict read
    shown = confirmed.get(f"held_out_{key}")
    kind = "decode-phase speedup" if key == "decode_speedup" else "speedup"
    task = settings.task.name
    header = (f"# @package _global_\n# Best configuration of study {settings.name}"
              f"{f' (held-out {kind} {shown:.3f}x vs vanilla)' if shown else ''}.\n"
              f"# Replay (a fresh paired measurement against vanilla on the study's held-out "
              f"prompts and budget):\n#   python -m tuner +task={task} "
              f"method={settings.method_choice} +best={settings.name}\n")
    where = settings.engine_object.best_params(settings.method_choice, params)
    body = {"defaults": [{f"override /{group}": choice}
                         for group, choice in settings.choices.items()
                         if group in REPLAYED_GROUPS and choice],
            **where, "models": dict(settings.models), "sampling": dict(settings.sampling),
            "seed": settings.seed,
            "budget": {"concurrency": list(settings.concurrency),
                       **({"request_rate": list(settings.traffic.rates),
                           "requests_per_rate": settings.traffic.requests_per_rate}
                          if settings.traffic.rates else {})},
            **({"search": {"slo": dict(settings.traffic.slo)}} if settings.traffic.slo else {}),
            "task": {"n_prompts": settings.budget["n_prompts"],
                     "n_held_out": settings.budget["n_held_out"],
                     "max_new_tokens": settings.budget["max_new_tokens"]},
            "replay": {"study": settings.name, "trial": best["trial"],
                       "budget": {**{k: settings.budget[k] for k in ("n_prompts", "n_held_out",
                                                                     "max_new_tokens")},
                                  "concurrency": list(settings.concurrency)},
                       "tuning_objective": settings.objectives[0],   # what tuning_speedup holds
                       "tuning_speedup": float(best["value"]),
                       "held_out_speedup": float(speed) if speed else None,
                       **({"held_out_decode_speedup": float(confirmed["held_out_decode_speedup"])}
                          if "held_out_decode_speedup" in confirmed else {}),
                       **{k: float(confirmed[k]) for k in QUALITY_KEYS if k in confirmed}}}
    return header, body


def name_the_method(advice: str, method: str, shown: Mapping[str, Any]) -> str:
    """A cross-method study's recommendation with its winner's method named."""
    what = f"method={method} {dict(shown)}"
    if "the best parameters" in advice:
        return advice.replace("the best parameters", what, 1)
    if "the winner" in advice:
        return advice.replace("the winner", f"the winner ({what})", 1)
    return f"{advice} (the winner: {what})"


def methods_table(settings: StudySettings, study: optuna.Study) -> list[dict[str, Any]]:
    """A cross-method study's methods, best measured first: each member's best tuning value
    (finished trials), its best prediction (the stored ranking), its trials by state and the
    seconds they took (the ranking of every method, inside trial 0, left out: the summary's
    time line holds it)."""
    from optuna.trial import TrialState

    from tuner.search.cost import RANKING_S
    from tuner.search.ranking import RANKING
    predicted: dict[str, float] = {}
    for point, value in (study.user_attrs.get(RANKING) or {}).get("predicted", []):
        if value is not None and value > float("-inf") and METHOD in point:
            name = str(point[METHOD])
            predicted[name] = max(predicted.get(name, float("-inf")), float(value))
    rows: dict[str, dict[str, Any]] = {
        name: {"method": name, "best": None, "best_trial": None,
               "predicted_best": predicted.get(name),
               "ranked": name not in (settings.method.get("unpriced") or ()),
               "finished": 0, "dropped": 0,
               "failed": 0, "seconds": 0.0}
        for name in settings.method["members"]}
    key = settings.objectives[0]
    for t in study.get_trials(deepcopy=False):
        name = str(trial_params(settings, t).get(METHOD, ""))
        row = rows.get(name)
        if row is None or t.state in (TrialState.WAITING, TrialState.RUNNING):
            continue
        if t.datetime_start is not None and t.datetime_complete is not None:
            row["seconds"] += (t.datetime_complete - t.datetime_start).total_seconds() - \
                float(t.user_attrs.get(RANKING_S) or 0.0)     # trial 0 ranked every method
        if t.state == TrialState.COMPLETE:
            row["finished"] += 1
            value = settings.sign * t.values[0]
            if not TrialRecord.read(t).infeasible and \
                    (row["best"] is None or value > settings.sign * row["best"]):
                row["best"], row["best_trial"] = float(t.values[0]), t.number
        elif t.state == TrialState.PRUNED:
            row["dropped"] += 1
        else:
            row["failed"] += 1
    for row in rows.values():
        row["seconds"] = round(row["seconds"], 1)
        row["objective"] = key
    return sorted(rows.values(), key=lambda r: (
        r["best"] is None, -settings.sign * (r["best"] or 0.0),
        -(r["predicted_best"] or float("-inf"))))
