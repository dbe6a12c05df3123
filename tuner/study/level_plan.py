"""An engine study's per-batch-size schedule, predicted from the engine's cost surface and
confirmed by the study's own measurements at each level.

With ``search.profile`` (the engine's profile, one surface per level: ``python -m tuner.profile
--engine <name> --levels ...``) and two or more ``budget.concurrency`` levels, the finish takes
the completed trials that share the winner's parameters but the drafted-token knob (k: llama.cpp's
``n_max``, vLLM's ``num_speculative_tokens``) and:

* predicts each k's decode-phase speedup at every batch size from 1 to the largest level
  (``tuner.predict.served``: its acceptance as counted at the nearest measured level at or below
  that batch size, priced by the profile, linear between the profile's batch sizes);
* plans the schedule from those predictions (``tuner.predict.schedule.plan``: the best k per
  level, thresholds between levels where the predictions cross, the loss of the wrong side);
* checks it per level against the measured ``decode_speedup@c<level>`` of the same trials
  (``tuner.predict.schedule.check``): the predicted k's measured speedup and the measured best.
Trials outside the quality bound are left out; a trial measured while vanilla drifted or the
machine was busy is kept, and a level's line names it where it decides that level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from tuner.predict.served import acceptance_of, plan_levels
from tuner.study.record import TrialRecord
from tuner.study.trials import completed, trial_params

if TYPE_CHECKING:
    import optuna

    from tuner.predict.schedule import LevelCheck
    from tuner.study.settings import StudySettings


def level_schedule(settings: StudySettings, study: optuna.Study,
                   winner: Mapping[str, Any]) -> dict[str, Any] | None:
    """{"schedule": tuner.predict.schedule.Schedule, "checks": [LevelCheck], "ks": [...]}, or None
    without an engine profile, with one level, or with no trial to plan from."""
    knob = settings.engine_object.draft_tokens_knob
    profile = settings.profile
    levels = sorted(settings.concurrency)
    if profile is None or knob is None or len(levels) < 2 or knob not in winner:
        return None
    same = {k: v for k, v in winner.items() if k != knob}
    by_k: dict[int, Mapping[str, Any]] = {}
    flagged: dict[int, str] = {}            # k -> why its measurement is doubtful
    for trial in completed(study):          # in trial order: a later rerun of a k replaces it
        params = trial_params(settings, trial)
        record = TrialRecord.read(trial)
        if record.infeasible or {k: v for k, v in params.items() if k != knob} != same or \
                any(acceptance_of(record.figures, c) is None for c in levels):
            continue
        k = int(params[knob])
        by_k[k] = record.figures
        why = [text for flag, text in ((record.vanilla_drift, "vanilla's speed drifted"),
                                       (record.contended, "the machine was busy")) if flag]
        if why:
            flagged[k] = f"trial #{trial.number}: {' and '.join(why)}"
        else:
            flagged.pop(k, None)
    if not by_k:
        return None
    planned, checks = plan_levels(by_k, levels, profile)
    return {"schedule": planned, "checks": checks, "ks": sorted(by_k), "knob": knob,
            "flagged": flagged}


def rows(found: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The summary's lines: the schedule, then each level's confirmation."""
    planned, checks = found["schedule"], found["checks"]
    confirmed = sum(c.confirmed for c in checks)
    out = [("predicted schedule", line) for line in planned.lines()]
    flagged = found.get("flagged") or {}

    def noted(check: LevelCheck) -> str:
        doubtful = sorted({k for k in (check.k, check.best_k) if k in flagged})
        return check.line() + "".join(f" (k={k} measured in {flagged[k]})" for k in doubtful)
    out += [("checked (decode phase)", noted(c)) for c in checks]
    out.append(("schedule confirmed", f"{confirmed} of {len(checks)} levels: the predicted "
                f"{found['knob']} is the measured best there (decode-phase speedup, from "
                f"{found['ks']} and speculation off; the concurrency lines above judge "
                "end-to-end throughput, the prefill included, which the profile does not "
                "price)"))
    return out
