"""Which point a trial holds, and how a worker claims the next one without duplicating another's.

*The point a trial holds* is one notion whatever the trial's state: every trial the tuner enqueues
(trial 0, a plan's next point, a dead trial's retry) records its point as the user attribute
``point`` at enqueue time, so a WAITING trial (whose parameters Optuna keeps as fixed params, not
in ``params``) and a RUNNING trial that has not suggested yet hold their point as visibly as a
COMPLETE one. ``held_point`` reads it (``params`` for trials that never had it: samplers' trials,
studies made before this); it and ``enqueue`` live in ``tuner.study.holding``, below this module
and ``liveness`` (which re-queues a dead worker's point), and can be imported from here too.

With a plan (heuristic, grid), ``next_claim`` asks the plan for a point nobody holds, enqueues it,
asks Optuna for a trial, and keeps it only if no earlier trial holds the same point; otherwise the
trial is failed as a duplicate (a retried failure: it costs no budget). The earliest trial holding
a point always wins, so two workers that enqueue the same point at the same moment evaluate it once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Mapping

import optuna
from optuna.trial import TrialState

from tuner.config.union import is_union, params_at, point_space
from tuner.search.plans import (WAIT, GridPlan, HeuristicPlan, Plan, PredictPlan, point_key,
                                union_grid)
from tuner.search.space import suggest
from tuner.study.holding import enqueue, held_point
from tuner.search.ranking import RACE_STOPPED, restore
from tuner.study.record import TrialRecord
from tuner.study.trials import counts, dead_trials

if TYPE_CHECKING:
    from tuner.study.settings import StudySettings

HOLDING = (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED)


@dataclass(frozen=True)
class Claim:
    """A trial this worker may evaluate, with every searched value and the plan's stage."""

    trial: optuna.Trial
    values: dict[str, Any]     # searched parameters (fixed ones are added by the objective)
    stage: str                 # default | the plan's stage | the search kind


class NoClaim(Enum):
    """Why ``Points.next_claim`` holds no trial for this worker now."""

    RETRY = "retry"     # the claimed trial lost a race to another worker: ask again at once
    WAIT = "wait"       # the plan's next points are held by other workers: ask again later
    DONE = "done"       # the plan is done (samplers never are)


def make_plan(settings: StudySettings, say: Callable[[str], None]) -> Plan | None:
    """The search's plan (None for samplers: Optuna proposes the points)."""
    kind, default = settings.search["kind"], settings.searched(settings.default)
    if kind == "heuristic":    # a union: the members swept at their start points, then the
        #                           best one's parameters (Algorithm 1 with ``method`` first)
        project = (lambda p: {k: p[k] for k in point_space(settings.method, p)}) \
            if is_union(settings.method) else None
        return HeuristicPlan(settings.space, settings.task.task_class, settings.seed, default,
                             project)
    if kind == "predict":
        ranges = settings.search.get("ranges", "heuristic")
        union, unpriced = union_grid(settings.method, ranges, settings.task.task_class,
                                     settings.seed) if is_union(settings.method) else (None, [])
        return PredictPlan(settings.space, default, ranges, settings.task.task_class,
                           int(settings.search["top"]), int(settings.search["spread"]),
                           settings.race, points=union, unpriced=unpriced)
    if kind != "grid":
        return None
    ranges = settings.search.get("ranges", "heuristic")
    engine = settings.engine_object
    launch = None if engine.own_loops else (
        lambda point: engine.baseline_key(settings.engine, settings.method,
                                          params_at(settings.method, point)))
    plan = GridPlan(settings.space, default, ranges, settings.task.task_class, launch)
    trials = settings.budget["n_trials"]
    if plan.size() > trials:
        say(f"WARNING: search.n_trials={trials} truncates the {ranges} grid of {plan.size()} "
            f"points: {plan.size() - trials} points will not be evaluated (raise "
            "search.n_trials, or budget=full)")
    return plan


class Points:
    """Claims points for one worker of a study (plans) or lets the sampler choose (samplers)."""

    def __init__(self, settings: StudySettings, study: optuna.Study, plan: Plan | None) -> None:
        self.settings, self.study, self.plan = settings, study, plan

    def limit(self) -> int:
        """Trials the search may spend: the budget, or the plan's size (+ trial 0 where the
        method's default is not one of the plan's points)."""
        trials = self.settings.budget["n_trials"]
        if self.plan is None:
            return trials
        return min(trials, self.plan.size() + (0 if self.plan.holds_default else 1))

    def next_claim(self) -> Claim | NoClaim:
        """A trial to evaluate, or why there is none now (``NoClaim``: RETRY, WAIT, DONE)."""
        if self.plan is not None and \
                not self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            restore(self.plan, self.study)      # search=predict: a ranking made by trial 0
            step = self.plan.next_point(*self.results_and_held())
            if step is None:
                stopped = self.plan.stopped         # a race's stop line
                if stopped and self.study.user_attrs.get(RACE_STOPPED) != stopped:
                    self.study.set_user_attr(RACE_STOPPED, stopped)
                return NoClaim.DONE
            if step == WAIT:
                return NoClaim.WAIT
            point, stage = step
            enqueue(self.study, point, stage=stage)
        trial = self.study.ask()
        if self.plan is not None and "point" not in trial.user_attrs and \
                "stage" not in trial.user_attrs:       # the queue emptied before our ask
            self._fail_duplicate(trial, "another worker took the queued point")
            return NoClaim.RETRY
        # a union of methods: ``method`` and its member's parameters (tuner.config.union)
        space = point_space(self.settings.method, held_point(trial))
        values = suggest(trial, space, conditional=self.plan is None)
        stage = trial.user_attrs.get("stage", self.settings.search["kind"])
        if self.plan is not None and not self._first_holder(trial, values):
            return NoClaim.RETRY
        return Claim(trial, values, stage)

    def results_and_held(self) -> tuple[dict[tuple, float], set[tuple]]:
        """What the plan reads: final values by point (failed, pruned and infeasible points are
        −inf: never best) and the points other trials hold now (WAITING, RUNNING)."""
        results, held = {}, set()
        dead = dead_trials(self.study)
        sign = self.settings.sign
        for t in self.study.get_trials(deepcopy=False):
            key = point_key(held_point(t))
            if t.state == TrialState.COMPLETE:
                results[key] = -math.inf if TrialRecord.read(t).infeasible \
                    else sign * t.values[0]
            elif t.state == TrialState.PRUNED or (t.state == TrialState.FAIL and
                                                   counts(self.study, t, dead)):
                results[key] = -math.inf
            elif t.state in (TrialState.WAITING, TrialState.RUNNING):
                held.add(key)
        return results, held

    def _first_holder(self, trial: optuna.Trial, values: Mapping[str, Any]) -> bool:
        """Keep ``trial`` unless an earlier trial holds its point (then fail it as a duplicate)."""
        key = point_key(values)
        dead = dead_trials(self.study)
        for other in self.study.get_trials(deepcopy=False):
            if other.number >= trial.number or point_key(held_point(other)) != key:
                continue
            if other.state in HOLDING or (other.state == TrialState.FAIL and
                                          counts(self.study, other, dead)):
                self._fail_duplicate(trial, f"trial {other.number} holds this point")
                return False
        return True

    def _fail_duplicate(self, trial: optuna.Trial, why: str) -> None:
        trial.set_user_attr("error", f"duplicate: {why}")      # a retried failure: no budget
        trial.set_user_attr("error_kind", "duplicate")
        self.study.tell(trial, state=TrialState.FAIL)
