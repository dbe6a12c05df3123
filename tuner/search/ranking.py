"""What a study does once its default (trial 0) is measured, before any other point: check the
hardware profile against it and, for ``search=predict``, rank the grid by that profile.

  * ``search.profile`` (any search in our own loops): the profile's price of vanilla against
    trial 0's measured vanilla (``tuner.predict.check.vanilla_check``); a decisive reading beyond
    the bound is measured once more, vanilla timed beside its forwards, and that one decides
    (``AfterDefault.confirmed``). The verdict is kept in the
    study (``PROFILE_CHECK``), so every worker and a resumed study read it instead of checking
    again. A profile beyond the bound is not used: no trial records a prediction by it, and
    ``search=predict`` stops after trial 0 with one line (``ConfigError``): ranking by a profile
    known to misprice, or running the whole grid instead, could each cost the user far more than
    making the profile again (a few minutes).
  * ``search=predict``: the ranking's cost is estimated again with trial 0's measured method time
    (``tuner.search.cost``) and refused over the cap; then every point is predicted
    (``tuner.predict.ranker.Ranker.rank_points``), ranked, and the ranking stored in the study
    (``RANKING``) before trial 0 is told complete. Other workers wait for it (the plan says WAIT while trial 0
    runs) and a resumed study restores it (``restore``): neither ranks again. If this worker dies
    while ranking, trial 0 is re-queued by the reaper and whoever measures it again ranks.
    The ranking keeps its predictions in the study as it goes (``PARTIAL`` chunks, every
    ``FLUSH_S``): Ctrl-C during a ranking completes trial 0, keeps what was predicted and stops
    the study (``interrupted``); the same command resumes the ranking where it stopped.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tuner.config.errors import ConfigError
from tuner.search.plans import point_key
from tuner.search.cost import RANKING_S
from tuner.study.objective import shared_order

if TYPE_CHECKING:
    import optuna

    from tuner.measure.evaluator import Paired
    from tuner.predict.ranker import Ranker
    from tuner.search.cost import SearchCost
    from tuner.study.settings import StudySettings

PROFILE_CHECK = "profile_check"      # study user attr: the check's record (tuner.predict.check)
RANKING = "predict_ranking"          # study user attr: PredictPlan.stored()
RACE_STOPPED = "race_stopped"        # study user attr: why search=predict's race stopped
PARTIAL = "predict_partial_"         # study user attrs: {grid index: prediction} chunks
FLUSH_S = 30.0                       # a ranking keeps its predictions at least this often


def restore(plan: Any, study: optuna.Study) -> None:
    """A ranking plan's stored ranking (or refusal), where the study holds one."""
    if plan is not None and plan.needs_ranking and not plan.ranked:
        stored = study.user_attrs.get(RANKING)
        if stored:
            plan.restore(stored)


def profile_refused(study: optuna.Study) -> str | None:
    """The line of a profile check that failed in this study, else None."""
    record = study.user_attrs.get(PROFILE_CHECK) or {}
    return record.get("line") if record.get("ok") is False else None


class AfterDefault:
    """``Objective``'s ``after_default`` hook (module docstring), on the evaluator's ranker
    (``tuner.run`` hands it in; None for an engine server: nothing to check or rank here).

    It runs inside trial 0, before trial 0 is told complete, and not as a step of its own
    after it, because of several workers: while trial 0 runs, the others wait for the ranking
    (the plan says WAIT), and if this worker dies while ranking, the reaper re-queues trial 0
    and whoever measures it again ranks; a ranking after trial 0's tell would leave a dead
    ranker's study waiting with no trial to re-queue."""

    def __init__(self, settings: StudySettings, study: optuna.Study, plan: Any,
                 ranker: Ranker | None, cost: SearchCost, say: Callable[[str], None],
                 remake: Callable[[], Any] | None = None) -> None:
        """``remake``: ``search.profile=auto``'s way to make the profile again, once, where it
        fails its check against trial 0 (then it is checked again: failed twice, refused)."""
        self.settings, self.study, self.plan = settings, study, plan
        self.ranker, self.cost, self.say, self.remake = ranker, cost, say, remake
        self.interrupted = False        # Ctrl-C during the ranking: trial 0 ends, then the stop

    def __call__(self, trial: optuna.Trial, pairs: Sequence[Paired]) -> None:
        record = self.check_profile(pairs)
        restore(self.plan, self.study)
        if self.plan is None or not self.plan.needs_ranking or self.plan.ranked or \
                self.ranker is None:
            return
        if record is not None and record.get("ok") is False:
            again = " (made again once already)" if self.remake is not None else ""
            self.plan.refuse(
                f"search=predict stops after trial 0: {record['line']}{again}; ranking by it "
                "would misprice every point. Make the profile again on a quiet machine (python "
                "-m tuner.profile; check uptime first), or measure the same points with "
                "search=grid")
        else:
            # an untimed run per point: the method's side of trial 0 (one request at a time)
            refusal = self.cost.ranking_refusal(sum(p.method.wall_s for p in pairs))
            if refusal is not None:
                self.plan.refuse(refusal)
            else:
                began = time.perf_counter()
                try:
                    rank(self.plan, self.ranker, self.study, self.say,
                         [prompt for _, prompt in shared_order(self.settings)])
                except KeyboardInterrupt:
                    self.interrupted = True      # trial 0 is kept; the study stops after it
                    self.say("ranking interrupted: trial 0 and the predictions so far are kept; "
                             "the same command resumes the ranking")
                    return
                finally:
                    trial.set_user_attr(RANKING_S, time.perf_counter() - began)
        self.study.set_user_attr(RANKING, self.plan.stored())

    def stop(self) -> None:
        """After a trial: the interrupt a ranking caught, raised now that trial 0 is told."""
        if self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt

    def check_profile(self, pairs: Sequence[Paired]) -> dict[str, Any] | None:
        """The profile's check against this trial 0 (stored; said in one line), or the stored
        one where a trial 0 measured earlier was checked already."""
        s = self.settings
        if s.profile is None or self.ranker is None:
            return None
        stored = self.study.user_attrs.get(PROFILE_CHECK)
        if stored is not None:
            return stored
        name = f"search.profile={s.search.get('profile')}"
        try:
            check = self.ranker.check_profile(pairs)
        except Exception as err:          # noqa: BLE001 - a check never fails the trial
            self.say(f"profile check failed ({type(err).__name__}: {err}): {name} is used "
                     "unchecked")
            return None
        if check is None:
            return None
        check = self.confirmed(check, name, pairs)
        if not check.ok and self.remake is not None:
            self.say(f"{check.line(name)}: making the profile again, once")
            try:
                self.ranker.profile = self.remake()
            except ConfigError as err:        # flagged twice, or a loaded machine: said
                self.say(str(err))
            else:                             # trial 0 is older still: measured beside it now
                check = self.ranker.confirm_profile(pairs) or self.ranker.check_profile(pairs)
                if check is None:
                    return None
        record = {**check.to_json(), "line": check.line(name)}
        self.study.set_user_attr(PROFILE_CHECK, record)
        if check.ok:
            self.say(record["line"])
        else:
            self.say(f"{record['line']}: this study does not use it (no trial records a "
                     "prediction by it); make it again on a quiet machine")
            self.ranker.refuse_profile(record["line"])
        return record

    def confirmed(self, check: Any, name: str, pairs: Sequence[Paired]) -> Any:
        """A decisive reading beyond the bound, measured once more with vanilla timed beside its
        forwards (``tuner.predict.check``, "Confirmed before it is refused"): that reading
        decides. Others as they are."""
        if check.ok or not check.decisive:
            return check
        self.say(f"{check.line(name)}: measuring vanilla again beside its 1-row forwards, "
                 "once (this machine's speed may have moved since trial 0) ...")
        try:
            again = self.ranker.confirm_profile(pairs)
        except Exception as err:          # noqa: BLE001 - the first reading stands
            self.say(f"the profile's check was not measured again ({type(err).__name__}: "
                     f"{err}): trial 0's reading stands")
            return check
        return check if again is None else again


def rank(plan: Any, ranker: Ranker, study: optuna.Study,
         say: Callable[[str], None], prompts: Sequence[Any]) -> float:
    """``search=predict``: every grid point's predicted speedup on ``prompts`` (the study's
    shared order, ``tuner.study.objective.shared_order``) by ``ranker.rank_points`` (what an
    interrupted ranking of this study kept is not predicted again, and what is predicted now
    is kept as it goes), ranked; says which points the plan will measure; returns the seconds
    it took."""
    known: dict[int, tuple[float, int | None]] = {}
    for key, chunk in study.user_attrs.items():
        if key.startswith(PARTIAL):
            for i, v in chunk.items():      # a value, or [value, prompts seen when cut]
                value, cut = (v if isinstance(v, list) else (v, None))
                known[int(i)] = (float("-inf") if value is None else float(value),
                                 None if cut is None else int(cut))
    known = {i: v for i, v in known.items() if i < len(plan.points)}
    say(f"search=predict: predicting {len(plan.points)} points (acceptance replayed, or from "
        "one untimed run per point) ..." + (f" {len(known)} kept from an interrupted ranking"
                                            if known else ""))
    pending: dict[int, float | None] = {}
    flushed = [time.monotonic(), sum(k.startswith(PARTIAL) for k in study.user_attrs)]

    def flush() -> None:
        if pending:
            study.set_user_attr(f"{PARTIAL}{flushed[1]}", {str(i): v for i, v in pending.items()})
            flushed[1] += 1
            pending.clear()
        flushed[0] = time.monotonic()

    def keep(i: int, value: float, cut: int | None) -> None:
        kept = None if value == float("-inf") else value
        pending[i] = kept if cut is None else [kept, cut]
        if time.monotonic() - flushed[0] >= FLUSH_S:
            flush()
    start = time.perf_counter()
    try:
        predicted, cut = ranker.rank_points(plan.points, prompts, known, keep)
    finally:
        flush()
    chosen = plan.rank(predicted, cut)
    seconds = time.perf_counter() - start
    shown = chosen if plan.race is None else chosen[:4]
    say(f"predicted in {seconds:.1f} s; measuring " + ", ".join(
        f"{dict(point)} ({stage}" + (f", predicted {plan.predicted[point_key(point)]:.3f}x)"
                                     if plan.predicted.get(point_key(point), float("-inf")) >
                                     float("-inf") else ")")
        for point, stage in shown) + ("" if plan.race is None else
                                      f", ... in order of prediction until the race stops "
                                      f"({len(chosen) - 1} ranked)"))
    return seconds
