"""The finish step: choose the winner, confirm it on held-out prompts, write and report it.

  1. the best feasible COMPLETE trial by the first objective (Pareto front first); a leader that
     was measured while the machine was busy is re-measured on the tuning prompts before it can
     win (``contention``), so no winner rests on a contended measurement alone;
  2. the winner against vanilla on held-out prompts the search never saw (interleaved);
  3. ``studies/best/<study>.yaml``, Optuna's plots, the summary table and the recommendation,
     told to the listeners (terminal, MLflow).
No feasible trial: the summary says so and recommends vanilla; no trial at all: an error that says
how to resume.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from optuna.trial import FrozenTrial, TrialState

from tuner.measure.quality import feasible
from tuner.measure.rates import rate_key
from tuner.predict.predict import calibration, summary_line
from tuner.predict.served import PREDICTED
from tuner.search.objectives import objective_values
from tuner.search.space import active_params
from tuner.study.cost import record_seconds
from tuner.study.level_plan import level_schedule
from tuner.study.level_plan import rows as level_plan_rows
from tuner.study.record import FIGURES, LEVEL, TrialRecord
from tuner.study.trials import completed, counts, failure_reason, ranked, trial_params
from tuner.tracking import report
from tuner.tracking.callbacks import Callback, StudyResult

if TYPE_CHECKING:
    import optuna

    from tuner.measure.evaluator import Evaluation, Evaluator
    from tuner.study.settings import StudySettings

FINISHED = "finished_with_trials"   # study attribute: completed trials when last finished
REMEASURE_AT_MOST = 3      # contended leaders re-measured before a winner is chosen
QUALITY_PREFIXES = ("quality_", "vanilla_quality_")
PERPLEXITY_KEYS = ("perplexity", "vanilla_perplexity", "perplexity_ratio")


def finish(settings: StudySettings, study: optuna.Study, evaluator: Evaluator,
           callbacks: Callback, say: Callable[[str], None]) -> dict[str, Any]:
    """Steps 1–3 of the module docstring, once: several workers reaching the finish step at
    once (``phase=all`` in several processes) write the result once; the others wait and say
    where it is."""
    folder = Path(settings.studies_dir) / "best"
    with finish_lock(folder / f"{settings.name}.finish.lock"):
        done = len(completed(study))
        if study.user_attrs.get(FINISHED) == done and (folder / f"{settings.name}.yaml").exists():
            say(f"study {settings.name} is already finished with these {done} trials (by this "
                f"command earlier or by another worker): {folder / f'{settings.name}.yaml'}; "
                "add trials (search.n_trials) to search further")
            return {"study_name": settings.name, "finished_elsewhere": True}
        result = _finish(settings, study, evaluator, callbacks, say)
        study.set_user_attr(FINISHED, done)
        return result


@contextmanager
def finish_lock(path: Path, poll_s: float = 2.0) -> Iterator[None]:
    """One finisher at a time per study (an O_EXCL lock file next to the best YAML; a lock whose
    process died on this host is taken over)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _stale(path):
                path.unlink(missing_ok=True)
                continue
            time.sleep(poll_s)          # another worker is finishing this study
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
        break
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _stale(path: Path) -> bool:
    try:
        host, pid = path.read_text().split()
    except (OSError, ValueError):
        return False                    # being written right now
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def prediction_calibration(study: optuna.Study) -> dict[str, Any] | None:
    """Predicted vs measured paired speedup over the completed trials that recorded a
    prediction (``search.profile``): in our own loops one point per trial, in an engine one per
    trial and level (``predicted_decode_speedup@c<level>`` against ``decode_speedup@c<level>``);
    None where none did."""
    points = [(t.user_attrs["predicted_speedup"], t.user_attrs["speedup"], f"trial {t.number}")
              for t in completed(study) if "predicted_speedup" in t.user_attrs
              and "speedup" in t.user_attrs]
    per_trial = len(points)
    for t in completed(study):
        for key, value in sorted(t.user_attrs.items()):
            base, _, level = key.partition(LEVEL)
            measured = t.user_attrs.get(f"decode_speedup{LEVEL}{level}")
            if base == PREDICTED and measured is not None:
                points.append((value, measured, f"trial {t.number} c{level}"))
    if not points:
        return None
    return {**calibration([(p, m) for p, m, _ in points], [n for _, _, n in points]),
            "per_level": len(points) > per_trial}


MAX_FOREIGN_POINTS = 512     # search.predict_for ranks at most this many grid points
MAX_UNTIMED_POINTS = 32      # ... or this many where each takes an untimed run (not replayed)


def predict_elsewhere(settings: StudySettings, evaluator: Evaluator, params: Mapping[str, Any],
                      say: Callable[[str], None]) -> dict[str, Any] | None:
    """``search.predict_for``: the grid (``search.ranges``) ranked by the speedup predicted on
    the other machine (acceptance replayed, or from one untimed run, here; priced by its
    profile): the best point there,
    and there the default's and this study's winner's; with a profile of several batch sizes,
    the per-batch-size schedule of ``num_draft_tokens`` around the winner
    (``tuner.predict.schedule``). None without ``search.predict_for``."""
    profile = settings.predict_for
    if profile is None or not hasattr(evaluator, "acceptance_points"):
        return None
    from tuner.search.plans import GridPlan, point_key
    default = settings.searched(settings.default)
    ranges = settings.search.get("ranges", "heuristic")
    points = GridPlan(settings.space, default, ranges, settings.task.task_class).points
    from tuner.config.values import get_class
    replays = getattr(get_class(str(settings.method.get("_target_", ""))), "replayable", False)
    most = MAX_FOREIGN_POINTS if replays else MAX_UNTIMED_POINTS
    cut = len(points) > most
    points = points[:most]
    winner = settings.searched(params)
    for extra in (winner, default):          # both are shown, in the grid or not
        if point_key(extra) not in {point_key(p) for p in points}:
            points = points + [extra]
    say(f"search.predict_for: predicting {len(points)} points of the {ranges} grid"
        f"{f' (its first {most})' if cut else ''}, the default and the winner "
        f"for {profile.machine} ...")
    replayed = evaluator.acceptance_points(points)
    one = profile.at_batch(1)
    predicted = [float("-inf") if g is None else evaluator.price(g, one).speedup
                 for g in replayed]
    by_key = {point_key(p): v for p, v in zip(points, predicted)}
    best = max(range(len(points)), key=lambda i: predicted[i])
    if not predicted[best] > float("-inf"):
        return None
    shown = active_params(points[best], settings.space)
    what = "an ESTIMATE (roofline)" if profile.kind == "roofline" else \
        f"a profile measured there ({profile.made or 'undated'})"

    def there(point: Mapping[str, Any]) -> str:
        value = by_key[point_key(point)]
        return f"{value:.2f}x" if value > float("-inf") else "not predicted"
    line = (f"on {profile.machine}, {what}, not measured here: best of {len(points)} points "
            f"{shown} {predicted[best]:.2f}x (predicted); this study's winner there "
            f"{there(winner)}, the default {there(default)}")
    out = {"line": line, "machine": profile.machine, "kind": profile.kind,
           "params": dict(points[best]), "speedup": predicted[best],
           "winner_speedup": by_key[point_key(winner)]}
    schedule = batch_schedule(settings, evaluator, profile, winner, points, replayed)
    if schedule is not None:
        out["schedule"] = schedule
    return out


def batch_schedule(settings: StudySettings, evaluator: Evaluator, profile: Any,
                   winner: Mapping[str, Any], points: list, replayed: list) -> Any:
    """The schedule of ``num_draft_tokens`` over the profile's batch sizes, the winner's other
    parameters held (``tuner.predict.schedule.plan``); None with one batch size or without
    ``num_draft_tokens`` in the space."""
    from tuner.predict.schedule import plan
    sizes = profile.batch_sizes()
    if len(sizes) < 2 or "num_draft_tokens" not in settings.space:
        return None
    same = {k: v for k, v in winner.items() if k != "num_draft_tokens"}
    by_k = {int(p["num_draft_tokens"]): g for p, g in zip(points, replayed) if g is not None
            and {k: v for k, v in p.items() if k != "num_draft_tokens"} == same}
    if not by_k:
        return None
    at: dict[int, Any] = {}                     # the profile blended once per batch size
    cache: dict[tuple[int, int], float] = {}    # each (k, batch) priced once

    def speedup(k: int, batch: int) -> float:
        if (k, batch) not in cache:
            if batch not in at:
                at[batch] = profile.at_batch(batch)
            cache[k, batch] = evaluator.price(by_k[k], at[batch]).speedup
        return cache[k, batch]
    return plan(speedup, sorted(by_k), sizes)


def _finish(settings: StudySettings, study: optuna.Study, evaluator: Evaluator,
            callbacks: Callback, say: Callable[[str], None]) -> dict[str, Any]:
    winner = choose_winner(settings, study, evaluator, say)
    if winner is None and completed(study):
        return no_feasible_trial(settings, study, callbacks, say)
    if winner is None:
        failed = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        reason = failure_reason(study, failed[-1]) if failed else "none ran"
        raise RuntimeError(f"no trial completed in study {settings.name} ({len(failed)} failed; "
                           f"last: {reason[:300]}); fix the cause and re-run the same command "
                           "to resume")
    params = trial_params(settings, winner)
    best = {"trial": winner.number, "value": winner.values[0], "trials": len(completed(study)),
            "run_id": winner.user_attrs.get("mlflow_run_id")}
    confirming = time.perf_counter()
    confirmed = confirm(settings, evaluator, params, say)
    record_seconds(study, "held_out_s", time.perf_counter() - confirming)
    folder = Path(settings.studies_dir) / "best"
    deploy = evaluator.deployment(params, level_winners(settings, study, confirmed))
    per_rate = {rate: decision for rate in rates_of(settings)       # measured rates only
                if (decision := rate_decision(settings, study, confirmed, rate)) is not None}
    if settings.traffic.rates:
        deploy = {**deploy, "per_rate": json.dumps({rate: d[0] for rate, d in per_rate.items()})}
    try:
        served = level_schedule(settings, study, params)
    except Exception as err:          # noqa: BLE001 - the schedule never costs the finish
        say(f"the predicted per-level schedule failed ({type(err).__name__}: {err}); the "
            "study finishes without it")
        served = None
    if served is not None:
        deploy = {**deploy, **settings.engine_object.schedule_form(served["schedule"])}
    elsewhere = predict_elsewhere(settings, evaluator, params, say)
    schedule = (elsewhere or {}).get("schedule")
    if schedule is not None:
        vllm = schedule.vllm()
        deploy = {**deploy,
                  "predicted_vllm_schedule": json.dumps(vllm) if vllm else
                  "speculation off at every batch size",
                  "predicted_sglang_adaptive_config_untested": json.dumps(schedule.sglang()),
                  "predicted_llamacpp_per_level": json.dumps(schedule.llamacpp())}
    path = report.write_best_yaml(folder, settings, params, best, confirmed, deploy)
    record = TrialRecord.read(winner)
    summary = {**record.figures, **({} if record.feasible is None else
                                    {"feasible": record.feasible})}
    notes = study_notes(settings, study, confirmed, summary)
    since = report.compare_previous(folder, settings.family, settings.name, params, confirmed)
    if since:
        notes.insert(0, since)
    rows = report.summary_rows(settings.name, active_params(params, settings.space), best,
                               confirmed, summary, settings.budget,
                               notes, evaluator.describe().get("energy", ""),
                               settings.bound.describe() if settings.bound.active or
                               not settings.lossless else None, settings.objectives[0])
    rows += level_rows(settings, study, confirmed)
    rows += [(f"request rate {rate}/s", line) for rate, (_, line) in per_rate.items()]
    calib = prediction_calibration(study)
    if calib is not None:
        shown = f"; profile {settings.profile.describe()}" if settings.profile else ""
        what = "trial-levels (the cost side: each trial's own acceptance)" if \
            calib.get("per_level") else "trials"
        rows.append(("prediction (search.profile)", summary_line(calib, what) + shown))
    check = study.user_attrs.get("profile_check")
    if check and check.get("line"):
        rows.append(("profile check (trial 0)", check["line"].removeprefix("profile check: ")))
    spent = time_line(study)
    if spent:
        rows.append(("time", spent))
    rows += level_plan_rows(served) if served is not None else []
    if elsewhere is not None:
        rows.append(("predicted for another machine (search.predict_for)", elsewhere["line"]))
        rows += [("predicted schedule", line) for line in schedule.lines()] if schedule else []
    rows += [(f"deploy: {key}", value) for key, value in deploy.items()]
    advice = report.recommendation(confirmed, settings.min_held_out_prompts,
                                   settings.objectives[0])
    advice = rate_advice(settings, confirmed, per_rate) or advice
    on_at = [key for key, line in rows if key.startswith(("concurrency ", "request rate "))
             and "speculation ON" in line]
    advice = report.with_exceptions(advice, on_at)
    files = [("best", path)] + [("plots", plot) for plot in (
        report.plots_png(study, path.with_suffix(".history.png")),
        report.plots_html(study, path.with_suffix(".plots.html"))) if plot]
    metrics = {**{f"best_{k}": v for k, v in summary.items() if k in FIGURES},
               **{f"best_{k}": v for k, v in confirmed.items()}}
    tags = {"best_params": json.dumps(params), "best_trial": str(winner.number),
            **{f"deploy_{key}": value for key, value in deploy.items()}}
    if calib is not None and calib["median_abs_error"] is not None:
        metrics["prediction_median_abs_error"] = float(calib["median_abs_error"])
        if calib["spearman"] is not None:
            metrics["prediction_spearman"] = float(calib["spearman"])
    if served is not None:
        metrics["schedule_levels_confirmed"] = float(sum(c.confirmed for c in served["checks"]))
        tags["predicted_schedule_checks"] = json.dumps(
            [{"batch": c.batch, "k": c.k, "predicted": c.predicted, "measured": c.measured,
              "best_k": c.best_k, "best": c.best} for c in served["checks"]])
    if elsewhere is not None:
        tags.update({"predicted_for_machine": f"{elsewhere['machine']} ({elsewhere['kind']})",
                     "predicted_for_best_params": json.dumps(elsewhere["params"])})
        metrics["predicted_for_best_speedup"] = float(elsewhere["speedup"])
        if elsewhere["winner_speedup"] > float("-inf"):
            metrics["predicted_for_winner_speedup"] = float(elsewhere["winner_speedup"])
    if settings.bound.active:
        tags["best_feasible"] = "true"
        metrics["infeasible_trials"] = float(sum(TrialRecord.read(t).infeasible
                                                 for t in completed(study)))
    callbacks.study_finished(StudyResult(rows, advice, metrics, tags, files, winner.number,
                                         trials_table(settings, study)))
    report.print_summary(rows, advice, say)
    say(f"best configuration written to {path}")
    return {"params": params, "study_name": settings.name, **best, **confirmed}


def choose_winner(settings: StudySettings, study: optuna.Study, evaluator: Evaluator,
                  say: Callable[[str], None]) -> FrozenTrial | None:
    """The best feasible trial; contended leaders are re-measured first (see module doc)."""
    candidates = ranked(settings, study)
    if not candidates or not TrialRecord.read(candidates[0]).contended:
        return candidates[0] if candidates else None
    value = {t.number: settings.sign * t.values[0] for t in candidates}
    contended = [t for t in candidates if TrialRecord.read(t).contended]
    for trial in contended[:REMEASURE_AT_MOST]:
        key = f"remeasured_{trial.number}"
        if key not in study.user_attrs:
            say(f"trial {trial.number} was measured while the machine was busy: re-measuring "
                "it on the tuning prompts before it can win")
            evaluation = measure(settings, evaluator, trial_params(settings, trial),
                                 settings.tuning)
            study.set_user_attr(key, objective_values(evaluation.summary,
                                                      settings.objectives)[0])
        value[trial.number] = settings.sign * study.user_attrs[key]
    return max(candidates, key=lambda t: value[t.number])


def measure(settings: StudySettings, evaluator: Evaluator, params: Mapping[str, Any],
            prompts) -> Evaluation:
    """The configuration vs vanilla on ``prompts``, interleaved (vanilla first on even pairs)."""
    pairs = list(evaluator.measure(params, list(enumerate(prompts)), parity=1))
    return evaluator.assess(pairs)


def time_line(study: optuna.Study) -> str:
    """Where the search's time went (``phase_seconds``, summed over runs of this study) and what
    was estimated after its first trial (``tuner.study.cost``)."""
    from tuner.study.cost import duration
    phases = {k: sum(v) for k, v in (study.user_attrs.get("phase_seconds") or {}).items()}
    ranking = sum(float(t.user_attrs.get("ranking_s") or 0) for t in
                  study.get_trials(deepcopy=False))
    if "trials_s" not in phases:
        return ""
    parts = [f"models loaded {duration(phases.get('open_s', 0.0))}"]
    if ranking:
        parts.append(f"ranking {duration(ranking)}")
    parts.append(f"trials {duration(phases['trials_s'] - ranking)}")
    if "held_out_s" in phases:
        parts.append(f"held-out confirmation {duration(phases['held_out_s'])}")
    text = ", ".join(parts)
    estimate = (study.user_attrs.get("estimates") or {}).get("after_first_trial")
    if estimate:
        total = estimate["elapsed_s"] + estimate["left_s"]
        text += f"; estimated after the first trial: ~{duration(total)} in all"
    return text


def confirm(settings: StudySettings, evaluator: Evaluator, params: Mapping[str, Any],
            say: Callable[[str], None]) -> dict[str, float]:
    """The configuration vs vanilla on held-out prompts the search never saw."""
    if not settings.held_out:
        return {}
    say(f"held-out confirmation on {len(settings.held_out)} prompts: vanilla vs {dict(params)}")
    return held_out_record(settings, measure(settings, evaluator, params, settings.held_out))


def held_out_record(settings: StudySettings, evaluation: Evaluation) -> dict[str, float]:
    """The confirmation's numbers, ``held_out_``-prefixed."""
    s = evaluation.summary
    out = {"speedup": s["speedup"], "speedup_min": s["speedup_min"],
           "speedup_max": s["speedup_max"], "tokens_per_s": s["tokens_per_s"],
           "vanilla_tokens_per_s": s["vanilla_tokens_per_s"],
           "mean_accepted_tokens": s["mean_accepted_tokens"], "prompts": s["prompts"],
           "truncated_fraction": s["truncated_fraction"]}
    if "matches_vanilla" in s:
        out["matches_vanilla"] = s["matches_vanilla"]
    out.update({k: s[k] for k in ("decode_speedup", "decode_speedup_min", "decode_speedup_max")
                if k in s})
    quality = {k: v for k, v in s.items() if k.startswith(QUALITY_PREFIXES) or
               k in PERPLEXITY_KEYS}
    out.update(quality)
    out.update({k: v for k, v in s.items() if "@c" in k or "@r" in k or k == "throughput_ratio"})
    if settings.bound.active:
        out["feasible"] = float(feasible(settings.bound.constraints(quality, settings.lossless)))
    return {f"held_out_{k}": v for k, v in out.items()}


def trials_table(settings: StudySettings, study: optuna.Study) -> list[dict]:
    """One row per trial, best first: its searched values, first objective, state and flags."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING:
            continue
        value = t.values[0] if t.values else None
        record = TrialRecord.read(t)
        rows.append({"trial": t.number, "state": t.state.name, **settings.searched(
            trial_params(settings, t)), settings.objectives[0]:
            None if value is None else round(value, 4),
            "feasible": "" if record.feasible is None else record.feasible,
            "contended": record.contended, "stage": t.user_attrs.get("stage", "")})
    done = [r for r in rows if r["state"] == "COMPLETE"]
    rest = [r for r in rows if r["state"] != "COMPLETE"]
    key = settings.objectives[0]
    return sorted(done, key=lambda r: -settings.sign * r[key]) + rest


def level_rows(settings: StudySettings, study: optuna.Study,
               confirmed: Mapping[str, float]) -> list[tuple[str, str]]:
    """Per concurrency level: the best trial there, the winner's held-out figure, and whether
    speculation should be on at that level (``level_decision``: the same rule the per-batch-size
    schedule follows, so the two never disagree)."""
    if settings.engine_object.max_concurrency == 1:      # one request at a time: no levels
        return []
    rows = []
    for level in settings.concurrency:
        decision = level_decision(settings, study, confirmed, level)
        if decision is not None:
            rows.append((f"concurrency {level}", decision[1]))
    return rows


def level_decision(settings: StudySettings, study: optuna.Study,
                   confirmed: Mapping[str, float], level: int
                   ) -> tuple[dict[str, Any] | None, str] | None:
    """(the parameters to run at ``level``, or None for speculation off; the summary's line), or
    None where no trial measured the level.

    ON needs both: the level's best tuning trial beat vanilla there, and the held-out
    confirmation (which measures the overall winner) was faster than vanilla at that level.
    Without held-out prompts nothing is confirmed, and the line says so."""
    top = level_best(study, "throughput_ratio", level)
    if top is None:
        return None
    ratio = TrialRecord.read(top).at_level("throughput_ratio", level)
    held = confirmed.get(f"held_out_throughput_ratio@c{level}")
    params = trial_params(settings, top)
    shown = active_params(params, settings.space)
    line = (f"best tuning throughput {ratio:.3f}x vanilla (trial #{top.number}); the winner on "
            f"held-out prompts {'n/a' if held is None else f'{held:.3f}x'}; ")
    return on_off(line, "level", ratio > 1.0, None if held is None else held > 1.0, params,
                  f"trial #{top.number} {shown}", "vanilla is faster",
                  "faster on the tuning prompts only; vanilla was faster on the held-out ones")


def on_off(line: str, where: str, tuning_better: bool, held_better: bool | None,
           params: dict[str, Any], chosen: str, tuning_lost: str, held_lost: str
           ) -> tuple[dict[str, Any] | None, str]:
    """The rule every level and rate line follows: ON needs the best tuning trial there to beat
    vanilla *and* the held-out confirmation to beat it there; "not confirmed" without held-out
    figures; OFF says which one lost."""
    if not tuning_better:
        return None, line + f"speculation OFF at this {where} ({tuning_lost})"
    if held_better is None:
        return params, line + (f"not confirmed (no held-out prompts at this {where}): tuning "
                               f"favours {chosen}")
    if not held_better:
        return None, line + f"speculation OFF at this {where} ({held_lost})"
    return params, line + f"speculation ON: {chosen}"


def rates_of(settings: StudySettings) -> list[str]:
    """``budget.request_rate`` as the figures' keys name them (``4``, ``0.5``)."""
    return [rate_key(rate).removeprefix("@r") for rate in settings.traffic.rates]


def rate_gain(figures: Mapping[str, float], rate: str, slo: bool,
              prefix: str = "") -> float | None:
    """How much better than vanilla at ``rate``: with an SLO, goodput minus vanilla's
    (requests/s that met it); without, vanilla's TPOT p50 over the method's, minus 1. None
    where the rate was not measured."""
    if slo:
        got, ref = (figures.get(f"{prefix}{side}goodput@r{rate}") for side in ("", "vanilla_"))
        gain = None if got is None or ref is None else got - ref
    else:
        ratio = figures.get(f"{prefix}tpot_ratio@r{rate}")
        gain = None if ratio is None else ratio - 1.0
    return gain if gain is not None and math.isfinite(gain) else None


def rate_decision(settings: StudySettings, study: optuna.Study,
                  confirmed: Mapping[str, float], rate: str
                  ) -> tuple[dict[str, Any] | None, str] | None:
    """(the parameters to run at request rate ``rate``, or None for speculation off; the
    summary's line), or None where no trial measured it. The same rule as ``level_decision``:
    ON needs the rate's best tuning trial to beat vanilla there *and* the held-out confirmation
    (the overall winner) to beat vanilla there; by goodput under ``search.slo``, else by TPOT."""
    slo = bool(settings.traffic.slo)
    done = completed(study)
    gains = {t.number: rate_gain(TrialRecord.read(t).figures, rate, slo) for t in done}
    measured = [t for t in done if gains[t.number] is not None]
    if not measured:
        return None
    top = max(measured, key=lambda t: gains[t.number])
    figures = TrialRecord.read(top).figures
    held = rate_gain(confirmed, rate, slo, "held_out_")
    params = trial_params(settings, top)
    shown = active_params(params, settings.space)

    def pair(prefix: str, name: str, label: str, unit: str, digits: int) -> str:
        source = confirmed if prefix else figures
        got = source.get(f"{prefix}{name}@r{rate}")
        ref = source.get(f"{prefix}vanilla_{name}@r{rate}")
        return f"{label} n/a" if got is None or ref is None else \
            f"{label} {got:.{digits}f} vs vanilla {ref:.{digits}f} {unit}"

    bounds = ", ".join(f"{k} <= {v:g}" for k, v in (settings.traffic.slo or {}).items())
    what = ("goodput", f"goodput (SLO {bounds})", "req/s", 2) if slo else \
        ("tpot_ms_p50", "TPOT p50", "ms", 1)
    line = (f"best tuning {pair('', *what)} (trial #{top.number}); the winner on held-out "
            f"prompts {pair('held_out_', *what)}, "
            f"{pair('held_out_', 'tpot_ms_p90', 'TPOT p90', 'ms', 1)}, "
            f"{pair('held_out_', 'ttft_ms_p90', 'TTFT p90', 'ms', 0)}; ")
    return on_off(line, "rate", gains[top.number] > 0, None if held is None else held > 0,
                  params, f"trial #{top.number} {shown}",
                  f"vanilla {'met the SLO as often' if slo else 'is as fast or faster'}",
                  "better on the tuning prompts only; not on the held-out ones")


def rate_advice(settings: StudySettings, confirmed: Mapping[str, float],
                per_rate: Mapping[str, tuple[dict[str, Any] | None, str]]) -> str | None:
    """The recommendation of a study chosen by a request-rate objective (``goodput@r4``), from
    that rate's own line (``per_rate``: ``rate_decision`` per measured rate), so the two agree;
    None (the usual recommendation)
    for any other objective, without held-out figures, or where the usual gates speak first (the
    winner broke the quality bound, or too few held-out prompts)."""
    objective = settings.objectives[0]
    _, rated, rate = objective.partition("@r")
    if not rated or not confirmed or confirmed.get("held_out_feasible") == 0.0 or \
            int(confirmed.get("held_out_prompts", 0)) < settings.min_held_out_prompts:
        return None
    if rate not in per_rate:
        return None
    params, line = per_rate[rate]
    if params is None:
        verdict = "use vanilla decoding"
    elif "speculation ON" in line:
        verdict = "use the setting this line names (deploy.per_rate in the best YAML)"
    else:
        verdict = "keep vanilla decoding until held-out prompts confirm the setting it names"
    return f"at {rate} requests/s (the objective {objective}): {verdict}; {line}"


def level_best(study: optuna.Study, name: str, level: int) -> optuna.trial.FrozenTrial | None:
    """The completed trial with the highest ``name`` at concurrency ``level``, or None."""
    done = completed(study)
    figures = {t.number: TrialRecord.read(t).at_level(name, level) for t in done}
    measured = [t for t in done if figures[t.number] is not None]
    return max(measured, key=lambda t: figures[t.number]) if measured else None


def level_winners(settings: StudySettings, study: optuna.Study,
                  confirmed: Mapping[str, float]) -> dict[int, dict[str, Any] | None]:
    """Per concurrency level (engine servers, several levels): the parameters to run there, or
    None for speculation off, as the summary's level lines say (``level_decision``)."""
    if settings.engine_object.max_concurrency == 1 or len(settings.concurrency) < 2:
        return {}
    out: dict[int, dict[str, Any] | None] = {}
    for level in settings.concurrency:
        decision = level_decision(settings, study, confirmed, level)
        if decision is not None:
            out[level] = decision[0]
    return out


def study_notes(settings: StudySettings, study: optuna.Study, confirmed: Mapping[str, float],
                summary: Mapping[str, Any]) -> list[str]:
    """What the reader of the summary must know."""
    out = []
    truncated = confirmed.get("held_out_truncated_fraction",
                              summary.get("truncated_fraction", 0.0)) or 0.0
    if settings.task.metric.__name__ != "_speed_only" and truncated >= 0.5:
        out.append(f"quality is not meaningful: {truncated:.0%} of the outputs were cut at "
                   f"max_new_tokens={settings.budget['max_new_tokens']} before an answer "
                   "(raise task.max_new_tokens, or budget=full)")
    if settings.device.type == "cpu":
        out.append("CPU run: a wide verification forward costs several single-token forwards "
                   "here; speedups on a GPU differ")
    trials = study.get_trials(deepcopy=False)
    failed = [t for t in trials if t.state == TrialState.FAIL and counts(study, t)]
    if failed:
        out.append(f"{len(failed)} trial(s) failed; first: "
                   f"{failure_reason(study, failed[0])[:120]}")
    pruned = [t.number for t in trials if t.state == TrialState.PRUNED]
    if pruned:
        out.append(f"trials {pruned} were pruned (clearly slower on their first prompts)")
    records = {t.number: TrialRecord.read(t) for t in trials}
    for attr, text in (("vanilla_drift", "vanilla speed drifted beyond drift_threshold"),
                       ("contended", "other processes used this machine's CPUs while measuring")):
        flagged = [n for n, r in records.items() if getattr(r, attr)]
        if flagged:
            out.append(f"{text} in trials {flagged}")
    varies = [n for n, r in records.items() if r.engine_varies]
    if varies:
        out.append(f"trials {varies}: some outputs at concurrency > 1 differed from the engine's "
                   "own non-speculative output where that output itself changed when the same "
                   "batch was sent again (batching changes the engine's numerics, e.g. with "
                   "quantised weights): not judged; re-typed F32/F16 weights make it repeatable")
    if not settings.lossless and not settings.greedy:
        out.append("lossy method at temperature > 0: quality is compared with one sampled "
                   "vanilla output per prompt; with few prompts the perplexity ratio and the "
                   "quality drop are noisy")
    if settings.bound.active:
        done = completed(study)
        broken = [t.number for t in done if TrialRecord.read(t).infeasible]
        out.append(f"quality bound {settings.bound.describe()}: {len(broken)} of {len(done)} "
                   f"trials broke it{f' (trials {broken})' if broken else ''}; they are never "
                   "chosen")
    return out


def no_feasible_trial(settings: StudySettings, study: optuna.Study, callbacks: Callback,
                      say: Callable[[str], None]) -> dict[str, Any]:
    """Every completed trial broke the quality bound: say so, recommend vanilla, no winner."""
    done = completed(study)
    fastest = max(done, key=lambda t: settings.sign * t.values[0])
    rows = [("study", settings.name), ("quality bound", settings.bound.describe()),
            ("feasible trials", f"0 of {len(done)}"),
            ("best infeasible trial", f"#{fastest.number}: {fastest.params}, "
             f"{settings.objectives[0]} {fastest.values[0]:.3f}, constraint values "
             f"{TrialRecord.read(fastest).constraints}")]
    rows += [("note", note) for note in study_notes(settings, study, {},
                                                    dict(TrialRecord.read(fastest).figures))]
    advice = (f"use vanilla decoding: no configuration met the quality bound "
              f"({settings.bound.describe()}); relax search.max_quality_drop / "
              "search.max_perplexity_ratio only if that quality loss is acceptable")
    callbacks.study_finished(StudyResult(rows, advice, {"feasible_trials": 0.0,
                                                        "infeasible_trials": float(len(done))},
                                         {"best_trial": "none", "best_feasible": "none"}))
    report.print_summary(rows, advice, say)
    return {"study_name": settings.name, "feasible": False, "trials": len(done)}
