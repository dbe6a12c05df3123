"""What a search will cost, said before its first trial, refined as trials finish, and capped.

  * Before the first trial (``SearchCost.announce``): the number of points and the estimated wall
    time. With ``search.profile`` in our own loops the profile prices each tuning prompt's vanilla
    generation and the method is assumed as fast as vanilla (its speed is what the search
    measures: for a method slower than vanilla this is a lower bound); a trial is its warm-up
    plus every prompt, both sides, plus the untimed run its prediction needs; search=predict adds
    the ranking (an untimed run per point for methods that do not replay, the draft's forwards
    for draft-model replays). Without a profile the estimate comes from the first trial.
  * After every trial (``after_trial``, and on the progress line): the mean duration of the
    study's finished trials (from the storage, so a resumed study and other workers' trials
    count; search=predict's ranking is left out of trial 0's) times the trials left, plus the
    finish (the winner's held-out confirmation: a trial on the held-out prompts).
  * The cap, ``search.max_hours`` (``auto``: 2 hours without a GPU, 12 with one; a number; null:
    none), refuses in one line naming the estimate and the override a search whose estimate
    exceeds it: before the first trial where a profile prices it, else right after the first
    trial (which is kept). ``search.timeout`` stops starting trials after that many seconds, so
    the trials' part of an estimate is bounded by it: a search with a timeout under the cap is
    refused only for what the timeout does not bound (the ranking, the finish).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

from optuna.trial import TrialState

from tuner.config.errors import ConfigError
from tuner.config.union import METHOD, is_union
from tuner.search.plans import PredictPlan

if TYPE_CHECKING:
    import optuna

    from tuner.study.settings import StudySettings

AUTO_CAP_HOURS = {"cpu": 2.0, "gpu": 12.0}
RANKING_S = "ranking_s"          # trial 0's user attr: seconds of search=predict's ranking in it


class Claims(Protocol):
    """What the cost reads of a worker's claiming of points (``tuner.search.points.Points``,
    which imports this module's ranking: named here by its shape, so no import goes back)."""

    plan: Any

    def limit(self) -> int: ...
DONE = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def cap_hours(settings: StudySettings) -> float | None:
    """``search.max_hours`` resolved (validated in ``tuner.config.search``)."""
    value = settings.search.get("max_hours", "auto")
    if value == "auto":
        return AUTO_CAP_HOURS["gpu" if settings.device.type == "cuda" else "cpu"]
    return None if value is None else float(value)


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class Estimate:
    """Seconds a search still needs, by part, and where the figures come from."""

    trials: int                      # trials left to run
    per_trial_s: float
    source: str                      # e.g. "the profile", "3 finished trials"
    ranking_s: float = 0.0           # search=predict's ranking, not done yet
    finish_s: float = 0.0            # the winner's held-out confirmation
    timeout_s: float | None = None   # search.timeout left: no trial starts after it

    @property
    def trials_s(self) -> float:
        seconds = self.trials * self.per_trial_s
        if self.timeout_s is not None:        # the trial running at the timeout still ends
            seconds = min(seconds, max(self.timeout_s, 0.0) + self.per_trial_s)
        return seconds

    @property
    def total_s(self) -> float:
        return self.ranking_s + self.trials_s + self.finish_s

    def describe(self) -> str:
        parts = [f"ranking ~{duration(self.ranking_s)}"] if self.ranking_s else []
        parts.append(f"{self.trials} trial(s) at ~{duration(self.per_trial_s)}" +
                     (" (bounded by search.timeout)" if self.trials_s < self.trials *
                      self.per_trial_s else ""))
        if self.finish_s:
            parts.append(f"held-out confirmation ~{duration(self.finish_s)}")
        return f"~{duration(self.total_s)} ({', '.join(parts)}; from {self.source})"


class SearchCost:
    """The estimate of one worker's search (module docstring)."""

    def __init__(self, settings: StudySettings, study: optuna.Study, points: Claims,
                 say: Callable[[str], None]) -> None:
        self.settings, self.study, self.points, self.say = settings, study, points, say
        self.cap_h = cap_hours(settings)
        self.began = time.monotonic()
        self.checked_trials = False      # the cap was checked against the trials' estimate
        self.prices: list[float] | None = None      # the profile's vanilla per tuning prompt

    # -- the parts ----------------------------------------------------------------------------

    def warm_and_measured(self, prompts: int) -> float:
        """How many prompt-generations a paired measurement on ``prompts`` prompts makes per
        side: the warm-up prompts, then every prompt at every concurrency level."""
        s = self.settings
        return min(s.warmup_prompts, len(s.tuning)) + prompts * len(s.concurrency)

    def finish_share(self) -> float:
        """The held-out confirmation's cost in trials (none without held-out prompts)."""
        s = self.settings
        if not s.held_out:
            return 0.0
        return self.warm_and_measured(len(s.held_out)) / self.warm_and_measured(len(s.tuning))

    def trials_left(self) -> int:
        """Trials the estimate counts: the plan's (or budget's) limit, less those spent; for a
        raced search=predict, the unraced count (default + top + spread: where a race usually
        stops; it may measure more, up to the limit, and the progress line follows it)."""
        from tuner.study.trials import spent
        used = spent(self.study)
        plan = self.points.plan
        if isinstance(plan, PredictPlan) and plan.race is not None:
            expected = min(self.points.limit(), 1 + plan.top + plan.spread)
            return max(expected - used, 1 if used < self.points.limit() and
                       plan.stopped is None else 0)
        return max(self.points.limit() - used, 0)

    def ranking_points(self) -> int:
        """Points search=predict still has to rank (0 once ranked, or for other searches)."""
        plan = self.points.plan
        if plan is None or not plan.needs_ranking or plan.ranked:
            return 0
        return len(plan.points)

    def ranking_s(self, prices: Sequence[float], method_s: float | None = None) -> float:
        """The points still to rank, each by ``point_ranking_s``; a union of methods' points
        each by its member's (``method_s``, trial 0's, prices trial 0's member only)."""
        s, plan = self.settings, self.points.plan
        if not self.ranking_points():
            return 0.0
        if not is_union(s.method):
            return self.reach(plan.points, self.point_ranking_s(prices, method_s), prices)
        from dataclasses import replace
        first = s.default[METHOD]
        total = 0.0
        for name, member in s.method["members"].items():
            if name in (s.method.get("unpriced") or ()):
                continue                        # measured, never ranked
            own = [p for p in plan.points if p[METHOD] == name]
            view = replace(s, method=member)
            each = self.point_ranking_s(prices, method_s if name == first else None, view)
            total += self.reach(own, each, prices)
        return total

    def reach(self, points: Sequence[Mapping[str, Any]], each: float,
              prices: Sequence[float]) -> float:
        """``points``' ranking at ``each`` a point: every point, or where the sweep runs the
        costly ones (``search.untimed=sweep``), at most one point per value swept."""
        from tuner.predict.halving import sweep_reach
        if self.settings.untimed == "sweep" and each > 0.01 * len(prices):
            return sweep_reach(points) * each
        return len(points) * each

    def point_ranking_s(self, prices: Sequence[float], method_s: float | None = None,
                        settings: Any = None) -> float:
        """One point's ranking: an untimed run of the method on every tuning prompt (a method
        that does not replay; ``method_s``: trial 0's measured method seconds over its prompts,
        else vanilla's priced), or a replay: the draft's forwards for a draft model, next to
        nothing for model-free drafters. ``settings``: another method's (a union's member)."""
        s = settings or self.settings
        if not s.method_class.replayable or not s.greedy:
            return method_s if method_s is not None else sum(prices)
        profile = s.profile
        if s.method.get("needs_draft") and profile is not None and profile.draft is not None:
            budget = s.budget["max_new_tokens"]
            return len(prices) * budget * profile.draft.step_s(128, 1)
        return 0.01 * len(prices)

    # -- estimates --------------------------------------------------------------------------------

    def from_profile(self, prices: Sequence[float]) -> Estimate:
        """Before any trial: vanilla priced by the profile, the method assumed as fast."""
        mean = sum(prices) / len(prices)
        trial = 2 * mean * self.warm_and_measured(len(prices))
        if self.settings.profile is not None and not self._replays():
            trial += sum(prices)                 # the untimed run a trial's prediction needs
        ranking = self.ranking_s(prices)
        if ranking and self._replays():
            ranking += sum(prices)               # vanilla's trajectories, once per study
        return Estimate(self.trials_left(), trial,
                        "the profile, with the method as fast as vanilla", ranking,
                        trial * self.finish_share(), self._timeout_left())

    def from_trials(self) -> Estimate | None:
        """From the study's finished trials (None before the first)."""
        seconds = []
        for t in self.study.get_trials(deepcopy=False, states=DONE):
            if t.datetime_start is None or t.datetime_complete is None:
                continue
            if t.state == TrialState.FAIL and not t.user_attrs.get("params"):
                continue                         # a duplicate or refused claim: no work done
            took = (t.datetime_complete - t.datetime_start).total_seconds()
            seconds.append(max(took - float(t.user_attrs.get(RANKING_S) or 0.0), 0.0))
        if not seconds:
            return None
        per_trial = sum(seconds) / len(seconds)
        ranking = 0.0
        if self.ranking_points():
            ranking = self.ranking_points() * per_trial / 2    # about a trial's method side
        return Estimate(self.trials_left(), per_trial, f"{len(seconds)} finished trial(s)",
                        ranking, per_trial * self.finish_share(), self._timeout_left())

    def _replays(self) -> bool:
        return self.settings.method_class.replayable and self.settings.greedy

    def _timeout_left(self) -> float | None:
        timeout = self.settings.search.get("timeout")
        return None if not timeout else float(timeout) - (time.monotonic() - self.began)

    # -- what the user sees -----------------------------------------------------------------------

    def announce(self, prices: Sequence[float] | None) -> None:
        """Before the first trial: the points and the estimate; ConfigError over the cap."""
        self.prices = list(prices) if prices else None
        self.began = time.monotonic()
        s, plan = self.settings, self.points.plan
        kind = s.search["kind"]
        if plan is not None and plan.needs_ranking and not plan.ranked:
            what = (f"search=predict ranks {len(plan.points)} points by prediction, then "
                    f"measures at most {self.points.limit()}" +
                    ("" if plan.race is None else f" (raced: about {self.trials_left()} "
                     "counted in the estimate)"))
        else:
            what = f"search={kind}: at most {self.trials_left()} trial(s) to run"
        if not s.engine_object.own_loops:     # a server launched per setting: in each trial's time
            launches = None if plan is None else plan.launches
            what += (f" (each a launch of {s.engine_object.name}'s server with its settings, "
                     "beside its baseline's where that differs" +
                     ("" if not launches else
                      f": {launches} baseline setting(s), the points ordered so that each "
                      "starts once") +
                     "; counted in the trial's time)")
        estimate = self.from_trials() or (self.from_profile(self.prices) if self.prices
                                          else None)
        if estimate is None:
            self.say(f"{what}; the time is estimated after the first trial (no search.profile "
                     f"prices it), and refused then if over the cap ({self._cap_text()})")
            return
        self.say(f"{what}: estimated {estimate.describe()}; cap {self._cap_text()}")
        self._keep("before_first_trial", estimate)
        self._check_cap(estimate)

    def after_trial(self) -> str | None:
        """After a trial: the first estimate from trials is said and checked against the cap
        (once: a refusal line then, else None; later estimates show on the progress line)."""
        if self.checked_trials:
            return None
        estimate = self.from_trials()
        if estimate is None:
            return None
        self.checked_trials = True
        self.say(f"search estimate now: {estimate.describe()}")
        self._keep("after_first_trial", estimate)
        try:
            self._check_cap(estimate)
        except ConfigError as err:
            return str(err)
        return None

    def ranking_refusal(self, method_s: float) -> str | None:
        """search=predict after trial 0: the ranking priced again with trial 0's measured method
        time; a refusal line over the cap (trial 0 is kept), else None."""
        if self.cap_h is None or not self.prices:
            return None
        ranking = self.ranking_s(self.prices, method_s)
        if ranking <= self.cap_h * 3600:
            return None
        return (f"search=predict's ranking of {self.ranking_points()} points is estimated at "
                f"~{duration(ranking)} from trial 0's measured method time, over "
                f"search.max_hours={self._cap_value()}: {self._override(ranking)}")

    def progress(self) -> str:
        """The progress line's part: time left and the total, from the finished trials."""
        estimate = self.from_trials()
        if estimate is None:
            return ""
        elapsed = time.monotonic() - self.began
        return (f", ~{duration(estimate.total_s)} left of ~{duration(elapsed + estimate.total_s)}"
                f" at ~{duration(estimate.per_trial_s)} per trial")

    def elapsed(self) -> float:
        """Seconds since this worker's search began (``announce``)."""
        return time.monotonic() - self.began

    def _keep(self, key: str, estimate: Estimate) -> None:
        """The estimate in the study (``estimates``: when it was made, what it said), to be
        held against the time the search took (``phase_seconds.search_s``)."""
        kept = dict(self.study.user_attrs.get("estimates") or {})
        kept.setdefault(key, {"elapsed_s": round(self.elapsed(), 3),
                              "left_s": round(estimate.total_s, 3), "source": estimate.source})
        self.study.set_user_attr("estimates", kept)

    def _check_cap(self, estimate: Estimate) -> None:
        if self.cap_h is None or estimate.total_s <= self.cap_h * 3600:
            return
        raise ConfigError(f"search={self.settings.search['kind']} is estimated at "
                          f"{estimate.describe()}, over search.max_hours={self._cap_value()}: "
                          f"{self._override(estimate.total_s)}")

    def _cap_value(self) -> str:
        value = self.settings.search.get("max_hours", "auto")
        return f"auto ({self.cap_h:g} h here)" if value == "auto" else f"{value}"

    def _cap_text(self) -> str:
        return "none (search.max_hours=null)" if self.cap_h is None else \
            f"{self.cap_h:g} h (search.max_hours={self.settings.search.get('max_hours', 'auto')})"

    def _override(self, total_s: float) -> str:
        hours = math.ceil(total_s / 3600 * 10) / 10
        return ("narrow the search (search.ranges=heuristic, fewer points or prompts), bound its "
                f"trials with search.timeout=<seconds>, or raise the cap (search.max_hours="
                f"{hours:g} or more, or null for none)")


def record_seconds(study: optuna.Study, key: str, seconds: float) -> None:
    """Where a study's time went, per process: the study attr ``phase_seconds`` holds a list per
    key (``open_s``: models loaded or servers started, ``trials_s``, ``held_out_s``,
    ``finish_s``), one entry per run of that part (bench/tuner_search.py reads them)."""
    spent = dict(study.user_attrs.get("phase_seconds") or {})
    spent[key] = [*spent.get(key, []), round(seconds, 3)]
    study.set_user_attr("phase_seconds", spent)
