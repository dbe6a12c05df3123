"""What the summary tells beside the decisions: the notes a reader must know, where the search's
time went, and one row per trial (the finish step puts them into ``StudyOutcome``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from optuna.trial import TrialState

from tuner.engines.base import Engine
from tuner.search.plans import point_key
from tuner.study.guard import CONTROL, OVERRIDE, SKIPPED
from tuner.study.holding import held_point
from tuner.search.ranking import RACE_STOPPED, RANKING
from tuner.study.record import TrialRecord
from tuner.study.trials import completed, counts, failure_reason, trial_params

if TYPE_CHECKING:
    import optuna

    from tuner.study.settings import StudySettings


def control_notes(study: optuna.Study) -> list[str]:
    """What the A/A guard before the first trial read (``tuner.study.guard``)."""
    attrs = study.user_attrs
    if attrs.get(SKIPPED):
        return ["A/A control skipped (control.guard=false): this path was not checked against "
                "itself"]
    report = attrs.get(CONTROL)
    if not report:
        return []
    shown = ", ".join(f"{r['figure']} {r['ratio']:.3f}x ({r['low']:.3f}-{r['high']:.3f})"
                      for r in report["rows"])
    if attrs.get(OVERRIDE):
        return [f"A/A control BEYOND its bound, measured anyway (control.override=true): "
                f"{attrs[OVERRIDE]}"]
    return [f"A/A control before the first trial, within its bound: {shown}"]


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
    out += control_notes(study)
    trials = study.get_trials(deepcopy=False)
    failed = [t for t in trials if t.state == TrialState.FAIL and counts(study, t)]
    if failed:
        out.append(f"{len(failed)} trial(s) failed; first: "
                   f"{failure_reason(study, failed[0])[:120]}")
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    race = settings.race
    if pruned and race is not None:
        prompts = len(settings.tuning)
        out.append("dropped by the race's paired rule (behind the leader by more than "
                   f"{race.margin:.0%}; a point within it is dropped with probability at most "
                   f"{race.looks_error(prompts):.1%} at {prompts} prompts): " + ", ".join(
                       f"trial {t.number} at prompt {t.user_attrs.get('pruned_at', '?')}"
                       for t in pruned))
    elif pruned:
        out.append(f"trials {[t.number for t in pruned]} were pruned (clearly slower on their "
                   "first prompts)")
    stopped = study.user_attrs.get(RACE_STOPPED)
    if stopped:
        ranking = study.user_attrs.get(RANKING) or {}
        held = {point_key(held_point(t)) for t in trials}
        left = [p for p, _ in ranking.get("chosen", []) if point_key(p) not in held]
        out.append(f"the race stopped: {stopped}" + (f"; {len(left)} ranked point(s) not "
                                                      "reached" if left else ""))
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



def time_line(study: optuna.Study) -> str:
    """Where the search's time went (``phase_seconds``, summed over runs of this study) and what
    was estimated after its first trial (``tuner.search.cost``)."""
    from tuner.search.cost import duration
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
            "contended": record.contended, "stage": t.user_attrs.get("stage", ""),
            "stopped": stop_reason(t, record)})
    done = [r for r in rows if r["state"] == "COMPLETE"]
    rest = [r for r in rows if r["state"] != "COMPLETE"]
    key = settings.objectives[0]
    return sorted(done, key=lambda r: -settings.sign * r[key]) + rest


def stop_reason(trial: optuna.trial.FrozenTrial, record: TrialRecord) -> str:
    """Why a trial ended: finished, dropped by the paired rule at prompt n, failed, running."""
    if trial.state == TrialState.COMPLETE:
        return "finished"
    if trial.state == TrialState.PRUNED:
        return f"dropped at prompt {record.pruned_at}" if record.pruned_at else "dropped"
    return trial.state.name.lower()


def compare_previous(folder: Path, family: str, name: str, params: Mapping[str, Any],
                     confirmed: Mapping[str, float]) -> str | None:
    """For scheduled re-runs (``<family>-<tag>`` studies): did the winner or its speedup change?"""
    import yaml
    earlier = sorted(p for p in folder.glob(f"{family}-*.yaml") if p.stem < name
                     and not p.stem.endswith((".plots", ".history")))
    if not earlier:
        return None
    previous = yaml.safe_load(earlier[-1].read_text())
    old_params = Engine.recorded_params(previous)
    old_speed = (previous.get("replay") or {}).get("held_out_speedup")
    changed = {k: (old_params.get(k), v) for k, v in params.items() if old_params.get(k) != v}
    what = ("best parameters unchanged" if not changed else "best parameters changed: " +
            ", ".join(f"{k} {a} -> {b}" for k, a, b in ((k, *v) for k, v in changed.items())))
    new_speed = confirmed.get("held_out_speedup")
    if isinstance(old_speed, (int, float)) and new_speed:
        what += (f"; held-out speedup {old_speed:.3f}x -> {new_speed:.3f}x "
                 f"({(new_speed / old_speed - 1) * 100:+.1f} %)")
    return f"since {earlier[-1].stem}: {what}"
