"""Reading a study's trials: which used budget, which completed, which is best.

A failed trial uses budget unless its failure says nothing about its point (a retried failure):
its worker died (orphaned, interrupted), it lost a race for a point (duplicate), or it was a
configuration error found by an earlier run (fixed since). PRUNED trials used budget and are never
best; infeasible trials (a broken quality bound) are never best either.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.study.liveness import RUN_TOKEN, orphans
from tuner.study.record import TrialRecord

if TYPE_CHECKING:
    from tuner.study.settings import StudySettings

RETRIED = ("orphaned", "interrupted", "duplicate")   # failures whose point is evaluated again


def failure_reason(study: optuna.Study, trial: FrozenTrial) -> str:
    """A trial's own ``error`` attribute, or the one a reaper recorded on the study."""
    return str(trial.user_attrs.get("error") or
               study.user_attrs.get(f"trial_{trial.number}_error", ""))


def dead_trials(study: optuna.Study) -> set[int]:
    """Trials whose worker died (their points are evaluated again)."""
    return orphans(study)


def is_retried(study: optuna.Study, trial: FrozenTrial, dead: set[int] = frozenset()) -> bool:
    """A failure that says nothing about its point: the point is evaluated again."""
    if trial.state != TrialState.FAIL:
        return False
    if failure_reason(study, trial).startswith(RETRIED) or trial.number in dead:
        return True
    # a configuration error found by an earlier run does not burn budget once the config is fixed
    return trial.user_attrs.get("error_kind") == "config" and \
        trial.user_attrs.get("run_token") != RUN_TOKEN


def counts(study: optuna.Study, trial: FrozenTrial, dead: set[int] | None = None) -> bool:
    """Whether ``trial`` used budget: COMPLETE, PRUNED, or a failure that is not retried."""
    dead = dead_trials(study) if dead is None else dead
    return trial.state in (TrialState.COMPLETE, TrialState.PRUNED) or \
        (trial.state == TrialState.FAIL and not is_retried(study, trial, dead))


def spent(study: optuna.Study) -> int:
    dead = dead_trials(study)
    return sum(counts(study, t, dead) for t in study.get_trials(deepcopy=False))


def completed(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def ranked(settings: StudySettings, study: optuna.Study) -> list[FrozenTrial]:
    """Feasible completed trials, best first by the first objective (Pareto front first)."""
    done = [t for t in completed(study) if not TrialRecord.read(t).infeasible]
    if len(settings.directions) > 1 and done:     # Study.best_trials honours the constraints too
        front = {t.number for t in study.best_trials if not TrialRecord.read(t).infeasible}
        return sorted(done, key=lambda t: (t.number not in front, -settings.sign * t.values[0]))
    return sorted(done, key=lambda t: -settings.sign * t.values[0])


def trial_params(settings: StudySettings, trial: FrozenTrial) -> dict[str, Any]:
    """Every parameter that built the trial's method (searched + fixed)."""
    return json.loads(trial.user_attrs.get("params", "null")) or \
        settings.params_at(trial.params)
