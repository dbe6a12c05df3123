"""A study in three phases: prepare, work, finish (one process runs all three by default).

    settings  validate the whole config, fingerprint it, name the study (nothing loaded yet)
    prepare   create the study (trial 0 = the method's default, once) or resume it (refused if
              its fingerprint differs); the MLflow parent run
    work      the evaluator opens (models load); the search's cost is said (and capped:
              tuner.search.cost); the optimize loop runs trials until the search is done
              (tuner.study.optimize), the default first: the hardware profile is checked
              against it, and search=predict ranks after it (tuner.search.ranking)
    finish    the winner, its held-out confirmation, the best YAML and the summary
              (tuner.answer.finish)

Ctrl-C / SIGTERM marks the running trial FAIL ("interrupted") and its MLflow runs KILLED;
re-running the same command resumes with nothing lost. Several processes may work on one study
at once (``phase=work``). ``+best=<study>`` replays a winner instead (``replay``).
"""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator

import optuna
from hydra.utils import instantiate
from omegaconf import DictConfig

from tuner.cluster.slurm import job_alive_or_none
from tuner.config.errors import ConfigError, Interrupted
from tuner.config.validate import PHASES, plain
from tuner.measure import intervals
from tuner.measure.timing import Timer, time_generation
from tuner.predict.cache import AUTO, PROFILE_USED, obtain, thread_count
from tuner.search.pruners import PairedPruner
from tuner.study.callbacks import Callbacks
from tuner.search.cost import SearchCost, record_seconds
from tuner.answer.finish import confirm, held_out_record, measure
from tuner.study.guard import guard
from tuner.answer.finish import finish as finish_study
from tuner.study.objective import Objective, shared_order
from tuner.study.optimize import optimize
from tuner.search.points import Points, make_plan
from tuner.search.ranking import RANKING, AfterDefault, profile_refused, restore
from tuner.search.ranking import rank as plan_rank
from tuner.study.settings import StudySettings
from tuner.study.storage import make_storage, open_study
from tuner.answer.verdict import held_out, quality_line
from tuner.tracking import render, report
from tuner.tracking.console import ConsoleProgress
from tuner.tracking.trackers import end_replay, make_tracker, start_replay


def say(message: str) -> None:
    print(message, flush=True)


def run(cfg: DictConfig, timer: Timer = time_generation) -> dict[str, Any]:
    """Run (or resume) the study described by ``cfg``; returns the final summary.

    ``phase``: all (default: prepare, work, finish in this process), prepare (create the study,
    trial 0 and the MLflow parent; no models), work (a worker: trials until the search is done),
    finish (best, held-out confirmation, YAML, summary). Any number of workers may run at once.
    """
    quiet_third_parties()
    if cfg.get("replay"):
        return replay(cfg, timer)
    phase = cfg.get("phase", "all")
    if phase not in PHASES:
        raise ConfigError(f"phase={phase!r} is invalid: allowed are {list(PHASES)}")
    settings = StudySettings.from_config(cfg)      # method=auto: across methods
    if (cfg.get("launcher") or {}).get("kind") == "slurm" and phase == "all":
        from tuner.cluster.launch import launch  # noqa: PLC0415 - only for Slurm
        return launch(cfg, settings.name, say)
    for notice in settings.notices:
        say(notice)
    settings, obtained = auto_profile(settings, phase)
    study, created = _open(settings)
    if obtained is not None:
        study.set_user_attr(PROFILE_USED, obtained.record())
    points = Points(settings, study, make_plan(settings, say))
    cost = SearchCost(settings, study, points, say)
    callbacks = Callbacks([ConsoleProgress(say, study, points.limit(), cost),
                           make_tracker(settings.tracking, say)])
    evaluator = settings.engine_object.evaluator(settings.measuring, timer, say)
    say(report.describe(settings, created, points.limit()))
    with sigterm_as_interrupt():
        try:
            callbacks.study_started(settings, study, created)
            if phase == "prepare":
                say(f"prepared study {settings.name}: {len(study.trials)} trial(s) recorded")
                return {"study_name": settings.name, "created": created}
            opened = time.perf_counter()
            evaluator.open()
            intervals.load()                # what trials compute with: not trial 0's time
            record_seconds(study, "open_s", time.perf_counter() - opened)
            if phase in ("all", "work"):
                work(settings, study, points, evaluator, callbacks, cost)
            if phase == "work":
                from tuner.study.trials import spent
                say(f"worker done: {spent(study)} trial(s) spent in study {settings.name}")
                return {"study_name": settings.name}
            finishing = time.perf_counter()
            result = finish_study(settings, study, evaluator, lambda outcome: render.publish(
                outcome, study, callbacks, say), say)
            record_seconds(study, "finish_s", time.perf_counter() - finishing)
            if phase == "all":             # the search as its user waited for it, models loaded
                record_seconds(study, "search_s", cost.elapsed())
            return result
        except KeyboardInterrupt as err:
            callbacks.study_ended("KILLED")
            raise Interrupted(f"study {settings.name} interrupted; its trials are saved") from err
        except BaseException:
            callbacks.study_ended("FAILED")
            raise
        finally:
            evaluator.close()


def work(settings: StudySettings, study: optuna.Study, points: Points, evaluator: Any,
         callbacks: Callbacks, cost: SearchCost) -> None:
    """One worker's trials: the cost said (refused over the cap before the first trial where a
    profile prices it, or after it), the profile's earlier verdict read, then the optimize loop
    (trial 0 first: ``AfterDefault`` checks the profile and ranks for search=predict)."""
    ranker = evaluator.ranker()            # tuner.predict.ranker, or None (engine servers)
    refused = profile_refused(study)
    if refused is not None and settings.profile is not None and ranker is not None:
        say(f"{refused}: this study does not use it (checked against trial 0 earlier)")
        ranker.refuse_profile(refused)
    guard(settings, study, evaluator, say)
    restore(points.plan, study)
    plan = points.plan
    cost.announce(ranker.vanilla_price(settings.profile)
                  if ranker is not None and refused is None else None)
    after_default = AfterDefault(settings, study, plan, ranker, cost, say,
                                 remake=remake_profile(settings, study))
    objective = Objective(settings, evaluator, study, callbacks.prompt_measured, after_default,
                          ranker)

    def stop() -> str | None:
        after_default.stop()               # Ctrl-C caught in a ranking: raised after trial 0
        return cost.after_trial()
    began = time.perf_counter()
    reason = optimize(settings, study, points, objective, callbacks, say,
                      job_alive=job_alive_or_none, stop=stop)
    if plan is not None and plan.needs_ranking and not plan.ranked and reason is None:
        # trial 0 failed, its ranking was interrupted, or a study ranked before rankings were
        # stored: rank here (what an interrupted ranking kept is not predicted again), go on
        restore(plan, study)
        if not plan.ranked:
            plan_rank(plan, ranker, study, say,
                      [prompt for _, prompt in shared_order(settings)])
            study.set_user_attr(RANKING, plan.stored())
        reason = optimize(settings, study, points, objective, callbacks, say,
                          job_alive=job_alive_or_none, stop=stop)
    record_seconds(study, "trials_s", time.perf_counter() - began)
    if reason is None and plan is not None and plan.needs_ranking:
        reason = plan.refused
    if reason is not None:
        raise ConfigError(reason)


def auto_profile(settings: StudySettings, phase: str) -> tuple[StudySettings, Any]:
    """``search.profile=auto`` where no profile is cached: made now, before the models load for
    the trials (``tuner.predict.cache.obtain``: said with its time, cached); the settings with
    it, and what was obtained (None: the setting is not auto, or this phase measures nothing)."""
    if settings.search.get("profile") != AUTO or phase not in ("all", "work"):
        return settings, None
    obtained = obtain_profile(settings)
    return replace(settings, profile=obtained.profile), obtained


def obtain_profile(settings: StudySettings, remake: bool = False) -> Any:
    """``tuner.predict.cache.obtain`` for the study's models, engine, threads and rounds (the
    profile the settings read from the cache reused, unless ``remake``)."""
    return obtain(settings.models, settings.engine_object.name,
                  thread_count(settings.threads), say,
                  int(settings.search.get("profile_rounds", 5)), remake=remake,
                  found=None if remake else settings.profile)


def remake_profile(settings: StudySettings, study: optuna.Study) -> Callable[[], Any] | None:
    """With ``search.profile=auto``: make the profile again (once, when it fails its check
    against trial 0; ``tuner.search.ranking.AfterDefault``), recorded in the study; else None."""
    if settings.search.get("profile") != AUTO:
        return None

    def remake() -> Any:
        obtained = obtain_profile(settings, remake=True)
        study.set_user_attr(PROFILE_USED, obtained.record())
        return obtained.profile
    return remake


def quiet_third_parties() -> None:
    """Our own lines say what happens: Optuna's per-trial logs, transformers' weight-loading bars
    and rouge-score's absl notices are kept off the output (warnings still show)."""
    import logging

    import transformers
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("absl").setLevel(logging.WARNING)


def _open(settings: StudySettings) -> tuple[optuna.Study, bool]:
    """The study's storage, created (trial 0 enqueued once) or resumed after the checks."""
    beat, search = settings.heartbeat, settings.search
    storage = make_storage(settings.storage, settings.journal, int(beat.get("interval", 60)),
                           beat.get("grace"))
    sampler = instantiate(search["sampler"]) if search.get("sampler") else None
    race = settings.race
    pruner = instantiate(search["pruner"]) if search.get("pruner") else \
        PairedPruner(race.margin, race.alpha) if race is not None else \
        optuna.pruners.NopPruner()
    ignore = ("hardware",) if settings.phase == "work" and settings.baseline == "per_trial" \
        else ()
    return open_study(storage, settings.name, list(settings.directions), sampler, pruner,
                      settings.fingerprint, settings.searched(settings.default),
                      settings.resume == "force", say, ignore=ignore,
                      metric_names=list(settings.objectives))


def replay(cfg: DictConfig, timer: Timer = time_generation) -> dict[str, Any]:
    """``+best=<study>``: a fresh paired measurement of exactly that configuration vs vanilla."""
    settings = StudySettings.from_config(cfg)        # validated; no study storage is touched
    if not settings.held_out:
        raise ConfigError("replay (+best=...) measures on held-out prompts: task.n_held_out=0 "
                          "leaves none; allowed is an integer >= 1")
    origin = plain(cfg.replay)
    recorded = origin.get("held_out_speedup")
    recorded = f"{recorded:.3f}x" if isinstance(recorded, (int, float)) else "none"
    say(f"replay of study {origin['study']} trial {origin['trial']} (recorded held-out speedup "
        f"{recorded}): {settings.default}")
    say(replay_budget_line(settings, origin.get("budget")))
    evaluator = settings.engine_object.evaluator(settings.measuring, timer, say)
    runs = start_replay(settings, origin)      # the MLflow run starts now (real duration)
    try:
        evaluator.open()
        confirmed = confirm(settings, evaluator, settings.default, say)
    except BaseException:
        end_replay(runs, {}, "replay failed", "FAILED")
        raise
    finally:
        evaluator.close()
    end_replay(runs, confirmed, f"Replay of {origin['study']} trial {origin['trial']}: "
                      f"held-out speedup {confirmed['held_out_speedup']:.3f}x")
    say(f"replay: held-out speedup {confirmed['held_out_speedup']:.3f}x (min "
        f"{confirmed['held_out_speedup_min']:.3f}, max {confirmed['held_out_speedup_max']:.3f});"
        f" recorded {recorded}")
    if "held_out_decode_speedup" in confirmed:
        was = origin.get("held_out_decode_speedup")
        was = f"{was:.3f}x" if isinstance(was, (int, float)) else "none"
        say(f"replay: held-out decode-phase speedup {confirmed['held_out_decode_speedup']:.3f}x "
            f"(prefill left out); recorded {was}")
    if not settings.lossless:
        say(f"replay: held-out quality vs vanilla: "
            f"{quality_line(held_out(confirmed))}")
    return {"params": settings.default, **confirmed}


def measure_held_out(cfg: DictConfig, params: dict[str, Any] | None = None,
                     timer: Timer = time_generation) -> dict[str, float]:
    """``params`` (default: the config's own defaults) against the engine's own baseline on the
    config's held-out prompts, at every concurrency level: a fresh paired measurement that
    touches no study storage and no tracker (benchmarks compare settings with it)."""
    settings = StudySettings.from_config(cfg)
    evaluator = settings.engine_object.evaluator(settings.measuring, timer, lambda line: None)
    evaluator.open()
    try:
        return held_out_record(settings, measure(settings, evaluator,
                                                 settings.default if params is None else params,
                                                 settings.held_out))
    finally:
        evaluator.close()


@contextmanager
def ranking_of(cfg: DictConfig, timer: Timer = time_generation
               ) -> Iterator[tuple[int, Callable[[int], tuple[list[float], list[int | None]]]]]:
    """``search=predict``'s ranking of ``cfg``'s grid (``search.ranges``) on its models, loaded
    once: (the number of points, ``rank(untimed_workers)`` -> every point's prediction and cut,
    a fresh ranking each call, nothing stored). Benchmarks time one ranking against another
    with it (``bench/untimed_workers.py``); the evaluator is closed on the way out."""
    from tuner.search.plans import GridPlan
    settings = StudySettings.from_config(cfg)
    evaluator = settings.engine_object.evaluator(settings.measuring, timer, lambda line: None)
    evaluator.open()
    try:
        points = GridPlan(settings.space, settings.default,
                          settings.search.get("ranges", "heuristic"),
                          settings.task.task_class).points

        def rank(untimed_workers: int) -> tuple[list[float], list[int | None]]:
            ranker = evaluator.ranker().for_method(
                settings.method, lambda p: evaluator.build(settings.method, p))
            ranker.settings = replace(ranker.settings, untimed_workers=untimed_workers)
            ranker.say = lambda line: None
            return ranker.rank_points(points, list(settings.tuning))
        yield len(points), rank
    finally:
        evaluator.close()


def default_params(cfg: DictConfig) -> dict[str, Any]:
    """Every parameter's default (trial 0) as the config's engine runs the method."""
    return StudySettings.from_config(cfg).default


def replay_budget_line(settings: StudySettings, recorded: dict | None) -> str:
    """Whether the replay measures with the study's own budget, and what differs if not."""
    now = {**{k: settings.budget[k] for k in ("n_prompts", "n_held_out", "max_new_tokens")},
           "concurrency": list(settings.concurrency)}
    if not recorded:
        return f"replay: budget {now} (the study did not record its own)"
    changed = {k: (recorded.get(k), v) for k, v in now.items() if recorded.get(k) != v}
    if not changed:
        return (f"replay: the study's own budget: {now['n_held_out']} held-out prompts x "
                f"{now['max_new_tokens']} new tokens")
    return ("replay: budget OVERRIDDEN, so the figures are not the study's: " +
            ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()))


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (Slurm preemption, ``kill``) is handled like Ctrl-C: the state is saved first."""
    def handler(signum, frame):
        raise Interrupted(f"signal {signum}")
    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:                 # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
