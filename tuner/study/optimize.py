"""The optimize loop of one worker: reap → claim a point → heartbeat → objective → tell.

Modelled on Optuna's ``study/_optimize.py``, with ask/tell so that plans, duplicates across
workers and per-prompt pruning stay in our hands. A trial ends in one of Optuna's states:

  * COMPLETE with its objective values;
  * PRUNED when the pruner stopped it (``Pruned``; never the winner);
  * FAIL with its reason in the ``error`` user attribute and its kind in ``error_kind``:
    ``config`` (the method refused the parameters: costs no budget once the config is fixed),
    ``lossless`` (a lossless method diverged from vanilla: a bug), ``impossible`` (a batch read
    beyond its physical bound twice: ``tuner.measure.bounds``), ``interrupted`` (Ctrl-C /
    SIGTERM: the point is evaluated again on resume) or ``error`` (anything else, e.g. OOM).

A failing trial never stops the loop; an interrupt fails the running trial and propagates.
With other workers on the study, a worker that finds the remaining points held by them waits
(polling) instead of leaving: if one of them dies, its point comes back here.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
from optuna.trial import TrialState

from tuner.config.identity import hardware
from tuner.measure.bounds import ImpossibleMeasurement
from tuner.measure.evaluator import ParametersRefused
from tuner.measure.lossless import LosslessViolation
from tuner.study import liveness
from tuner.study.callbacks import Callback, TrialOutcome
from tuner.study.objective import Pruned
from tuner.search.points import Claim, NoClaim, Points
from tuner.study.trials import spent

if TYPE_CHECKING:
    import optuna

    from tuner.study.objective import Objective
    from tuner.study.settings import StudySettings

POLL_S = 2.0          # how often a worker waiting for other workers' results looks again


def optimize(settings: StudySettings, study: optuna.Study, points: Points, objective: Objective,
             callbacks: Callback, say: Callable[[str], None],
             job_alive: liveness.JobAlive | None = None,
             stop: Callable[[], str | None] = lambda: None) -> str | None:
    """Run trials until the plan is done, the trial budget is spent or the timeout passes.

    ``job_alive`` tells the reaper whether another worker's Slurm job is alive (``tuner.run``
    passes ``tuner.cluster.slurm.job_alive_or_none``; the study never imports the launcher).
    ``stop()``, asked after each trial, returns a line to stop the search with (the cost cap,
    ``tuner.search.cost``); that line is returned (None when the search ran its course).
    """
    began, timeout = time.monotonic(), settings.search.get("timeout")
    while True:
        liveness.reap(study, say, job_alive)
        running = len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
        used, limit = spent(study), points.limit()
        if used >= limit:
            return None
        if timeout and time.monotonic() - began > float(timeout):
            say(f"search.timeout={timeout}s reached: no new trials")
            return None
        if used + running >= limit:
            time.sleep(POLL_S)             # the rest is held by other workers
            continue
        claim = points.next_claim()
        if claim is NoClaim.DONE and not running:
            return None
        if isinstance(claim, NoClaim):
            if claim is not NoClaim.RETRY:  # WAIT, or DONE while other workers' trials run
                time.sleep(POLL_S)
            continue
        # beat from the moment the trial exists: a worker that dies before its first
        # heartbeat would leave a trial that never looks stale
        with liveness.Heartbeat.for_trial(study, claim.trial):
            run_trial(settings, study, claim, objective, callbacks)
        reason = stop()
        if reason is not None:
            return reason


def run_trial(settings: StudySettings, study: optuna.Study, claim: Claim, objective: Objective,
              callbacks: Callback) -> None:
    """Stamp the trial, evaluate it, tell Optuna how it ended, tell the listeners."""
    trial = claim.trial
    params = settings.params_at(claim.values)     # every parameter: searched + fixed
    for key, value in stamp(settings, params).items():
        trial.set_user_attr(key, value)
    callbacks.trial_started(trial, params, claim.stage)
    try:
        result = objective(trial, params)
    except Pruned as pruned:
        study.tell(trial, state=TrialState.PRUNED)
        callbacks.trial_ended(trial, TrialOutcome("PRUNED", "FINISHED", pruned.result.evaluation,
                                                  tags=pruned.result.tags))
    except KeyboardInterrupt:
        fail(study, trial, callbacks, "interrupted: the study was stopped during this trial",
             "interrupted", "KILLED")
        raise
    except ParametersRefused as err:
        fail(study, trial, callbacks, str(err), "config")
    except LosslessViolation as err:
        fail(study, trial, callbacks, f"{type(err).__name__}: {err}", "lossless")
    except ImpossibleMeasurement as err:
        fail(study, trial, callbacks, str(err), "impossible")
    except (Exception, torch.OutOfMemoryError) as err:   # noqa: BLE001 - never kill the study
        fail(study, trial, callbacks, f"{type(err).__name__}: {err}", "error")
    else:
        study.tell(trial, result.values)
        callbacks.trial_ended(trial, TrialOutcome("COMPLETE", "FINISHED", result.evaluation,
                                                  tags=result.tags))


def fail(study: optuna.Study, trial: optuna.Trial, callbacks: Callback, message: str,
         kind: str, status: str = "FAILED") -> None:
    trial.set_user_attr("error", message)
    trial.set_user_attr("error_kind", kind)
    study.tell(trial, state=TrialState.FAIL)
    callbacks.trial_ended(trial, TrialOutcome("FAIL", status, error=message, kind=kind))


def stamp(settings: StudySettings, params: dict[str, Any]) -> dict[str, Any]:
    """Who measures this trial, where, with what: enough to reproduce it or to reap it."""
    identity = {**liveness.worker_identity(), "pid": os.getpid(), "run_token": liveness.RUN_TOKEN,
                "params": json.dumps(params), "sampling": json.dumps(settings.sampling),
                "hardware": hardware(settings.device), "threads": torch.get_num_threads()}
    return {k: v for k, v in identity.items() if v is not None}
