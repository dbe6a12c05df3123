"""Is a RUNNING trial still being worked on? Heartbeats for ask/tell, and reaping dead workers.

Optuna's own heartbeat only runs inside ``study.optimize()``; the tuner drives trials with
ask/tell, so:

  * ``heartbeat_storage(url, interval, grace)`` builds an ``RDBStorage`` (PostgreSQL) with a
    heartbeat and the ``Requeue`` callback: a failed stale trial's point is enqueued again (a
    WAITING trial with the same parameters and user attr ``retry_of``), so it is re-evaluated.
  * ``with Heartbeat(storage, trial_id):`` records the trial's heartbeat every ``interval`` seconds
    while the trial runs (a no-op for storages without heartbeat support, e.g. journal files).
  * ``fail_stale(study)`` fails RUNNING trials whose heartbeat is older than the grace period
    (``optuna.storages.fail_stale_trials``, public but experimental) and returns their numbers.
  * ``fail_dead_workers(study)`` is the journal-storage equivalent: journal storage has no
    heartbeat, so a RUNNING trial whose user attr ``slurm_job_id`` (``1234_2``) is no longer alive
    in Slurm is marked ``error="orphaned: ..."``, failed, and its point re-queued by ``Requeue``.
  * ``reap(study)`` does whichever applies; call it in each worker before ``study.ask()``.
  * ``orphans(study)``: the numbers of trials failed this way (not failed evaluations), so that
    they count neither as failed points nor against the trial budget.

``study.ask()`` on a heartbeat storage warns "Heartbeat of storage is supposed to be used with
Study.optimize"; that is expected here (``Heartbeat`` is the ask/tell replacement).
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import TYPE_CHECKING, Callable

import optuna
from optuna.storages import RDBStorage
from optuna.trial import TrialState

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

log = logging.getLogger(__name__)
ORPHANED = "orphaned"   # prefix of the ``error`` user attr of a trial whose worker died
_IDENTITY = ("host", "pid", "gpu", "slurm_job_id", "error", "retry_of", "retries")   # not copied


class Requeue:
    """Stale-trial callback: enqueue the dead trial's point again, at most ``max_retry`` times.

    Unlike Optuna's ``RetryHeartbeatStaleTrialCallback`` (which copies every user attr), the
    retry does not inherit the dead worker's identity (host, pid, gpu, slurm_job_id), so a reaper
    never mistakes the retry for the dead trial before its new worker stamps it. User attrs:
    ``retry_of`` (the dead trial's number) and ``retries`` (how many times this point died).
    """

    def __init__(self, max_retry: int | None = 1) -> None:
        self.max_retry = max_retry

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        retries = int(trial.user_attrs.get("retries", 0)) + 1
        if self.max_retry is not None and retries > self.max_retry:
            return
        attrs = {k: v for k, v in trial.user_attrs.items() if k not in _IDENTITY}
        study.enqueue_trial(trial.params, user_attrs={**attrs, "retry_of": trial.number,
                                                      "retries": retries})


def heartbeat_storage(url: str, interval: int = 60, grace: int | None = None,
                      max_retry: int | None = 1) -> RDBStorage:
    """An RDB storage (e.g. ``postgresql+psycopg://...``) with heartbeat and retry of stale trials.

    Args:
        url: SQLAlchemy URL of the database.
        interval: seconds between heartbeats (a positive int, Optuna's rule).
        grace: seconds without a heartbeat after which a RUNNING trial is stale (None: 2*interval).
        max_retry: how often a stale trial's point is re-queued (None: without limit, 0: never).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        callback = None if max_retry == 0 else Requeue(max_retry)
        return RDBStorage(url, heartbeat_interval=interval, grace_period=grace,
                          heartbeat_stale_trial_callback=callback)


def _heartbeat_interval(storage: BaseStorage) -> int | None:
    get = getattr(storage, "get_heartbeat_interval", None)
    return get() if callable(get) and hasattr(storage, "record_heartbeat") else None


class Heartbeat:
    """Context manager: a daemon thread records ``trial_id``'s heartbeat while the block runs.

    ``interval`` defaults to the storage's heartbeat interval; storages without one (journal,
    in-memory, RDB without ``heartbeat_interval``) make this a no-op. A failed write is logged and
    retried at the next beat: a database blip must not kill the trial.
    """

    def __init__(self, storage: BaseStorage, trial_id: int, interval: float | None = None) -> None:
        self.storage = storage
        self.trial_id = trial_id
        self.interval = interval if interval is not None else _heartbeat_interval(storage)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 0                    # heartbeats written (for tests and logs)

    @classmethod
    def for_trial(cls, study: optuna.Study, trial: optuna.Trial) -> Heartbeat:
        """The heartbeat of a trial from ``study.ask()`` (Optuna's private ids are read here)."""
        return cls(study._storage, trial._trial_id)

    @property
    def enabled(self) -> bool:
        return self.interval is not None and hasattr(self.storage, "record_heartbeat")

    def __enter__(self) -> Heartbeat:
        if self.enabled:
            self._beat()                  # the first beat before the trial's work starts
            self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{self.trial_id}",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._beat()

    def _beat(self) -> None:
        try:
            self.storage.record_heartbeat(self.trial_id)
            self.beats += 1
        except Exception as e:   # noqa: BLE001 - logged; the next beat tries again
            log.warning("heartbeat of trial id %s failed: %s", self.trial_id, e)


def fail_stale(study: optuna.Study) -> list[int]:
    """Fail RUNNING trials whose heartbeat is older than the grace period; their numbers.

    Runs the storage's stale-trial callback (``heartbeat_storage`` re-queues the point). A no-op
    returning ``[]`` for storages without a heartbeat.
    """
    running = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    if not running:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    now = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    return sorted(n for n in running if now.get(n) == TrialState.FAIL)


def fail_dead_workers(study: optuna.Study, alive: Callable[[str], bool] | None = None,
                      max_retry: int | None = 1) -> list[int]:
    """Fail RUNNING trials whose ``slurm_job_id`` user attr names a job Slurm says is gone.

    Trials without that attr (local runs) are left alone, as are all trials when Slurm does not
    answer (``SlurmError``): "no answer" is not "dead". The failed trial's point is enqueued again
    by ``Requeue(max_retry)`` (0: never). Returns the numbers of the failed trials.
    """
    from tuner.cluster.slurm import SlurmError, job_alive

    alive = alive or job_alive
    requeue = Requeue(max_retry) if max_retry != 0 else None
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        job = t.user_attrs.get("slurm_job_id")
        if not job:
            continue
        try:
            if alive(str(job)):
                continue
        except SlurmError as e:
            log.warning("cannot tell whether Slurm job %s is alive: %s", job, e)
            return failed
        try:   # the same mark as the tuner's own orphan check (tuner/run.py), then FAIL
            study._storage.set_trial_user_attr(t._trial_id, "error",
                                               f"{ORPHANED}: Slurm job {job} is gone")
            study.tell(t.number, state=TrialState.FAIL)
        except (ValueError, RuntimeError):   # another worker failed or finished it first
            continue
        failed.append(t.number)
        if requeue is not None:
            requeue(study, t)
    return failed


def orphans(study: optuna.Study) -> set[int]:
    """Numbers of FAIL trials whose worker died (rather than whose evaluation failed).

    Their points are evaluated again, so they should count neither as failed points nor against
    the trial budget. Recognised: the ``error`` mark ``orphaned: ...`` (``fail_dead_workers``, the
    tuner's local check) and the trials named by a retry (``retry_of`` user attr from ``Requeue``,
    or the ``failed_trial`` system attr of Optuna's ``RetryHeartbeatStaleTrialCallback``).
    """
    found = set()
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.FAIL and str(t.user_attrs.get("error", "")).startswith(ORPHANED):
            found.add(t.number)
        origin = t.user_attrs.get("retry_of", t.system_attrs.get("failed_trial"))
        if origin is not None:
            found.add(int(origin))
    return found


def reap(study: optuna.Study) -> list[int]:
    """Fail (and re-queue) dead trials: by heartbeat on RDB storage, else by Slurm job id."""
    if _heartbeat_interval(study._storage) is not None:
        return fail_stale(study)
    return fail_dead_workers(study)
