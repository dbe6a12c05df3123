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
  * ``reap(study, job_alive=...)``: the one reaper, called by every worker before it claims a
    point: stale heartbeats (RDB), Slurm jobs that ended (user attr ``slurm_job_id``, ``1234_2``)
    and dead processes on this host (``host``, ``pid``, ``run_token``) are marked
    ``orphaned: ...``, failed, and their points re-queued by ``Requeue``.
  * ``orphans(study)``: the numbers of trials failed this way (not failed evaluations), so that
    they count neither as failed points nor against the trial budget.
  * ``worker_identity()``: who this worker is (host, GPU(s), Slurm job id), read from the
    environment; with the pid and ``RUN_TOKEN`` it is what ``gone`` judges a trial's worker by.

Worker liveness belongs to the study; the Slurm launcher (``tuner.cluster``) sits above it and is
never imported here. Whether a Slurm job is still alive is asked through a ``JobAlive`` callable
that the caller passes in (``tuner.run`` passes ``tuner.cluster.slurm.job_alive_or_none``);
without one, a trial stamped with a Slurm job id is judged by its heartbeat only.

``study.ask()`` on a heartbeat storage warns "Heartbeat of storage is supposed to be used with
Study.optimize"; that is expected here (``Heartbeat`` is the ask/tell replacement).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
import warnings
from typing import TYPE_CHECKING, Callable

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from tuner.study.holding import enqueue, held_point

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

log = logging.getLogger(__name__)
RUN_TOKEN = uuid.uuid4().hex          # this process's identity in trial attributes (pids repeat)
ORPHANED = "orphaned"   # prefix of the ``error`` user attr of a trial whose worker died
_IDENTITY = ("host", "pid", "gpu", "slurm_job_id", "error", "retry_of", "retries")   # not copied

JobAlive = Callable[[str], bool | None]
"""Is the scheduler job ``slurm_job_id`` (``1234`` / ``1234_2``) still alive? True or False, or
None when the scheduler does not answer ("no answer" is never "dead"); it does not raise then."""


def current_job_id() -> str | None:
    """This process's Slurm id: ``<array job>_<task>`` in an array, else ``SLURM_JOB_ID``."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def worker_identity() -> dict[str, str]:
    """User attrs to put on every trial: host, GPU(s) and Slurm job id (``slurm_job_id``)."""
    ident = {"host": socket.gethostname(),     # as the reaper compares it (``gone``)
             "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")
             or os.environ.get("SLURM_JOB_GPUS") or "none"}
    job = current_job_id()
    if job:
        ident["slurm_job_id"] = job
    return ident


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
        attrs = {k: v for k, v in trial.user_attrs.items() if k not in (*_IDENTITY, "point")}
        enqueue(study, held_point(trial), **{**attrs, "retry_of": trial.number,
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


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def gone(trial: FrozenTrial, job_alive: JobAlive | None = None) -> str | None:
    """Why ``trial``'s worker is gone (its Slurm job ended, or its process on this host), or None.

    A Slurm worker is judged by its job id (``job_alive``; None, "no answer" from Slurm, is not
    "dead"; without ``job_alive`` it is left to its heartbeat), a local one by its pid on this
    host; a pid equal to ours belongs to an earlier process (pids repeat across container
    restarts) unless the trial carries this process's run token. A trial not stamped yet (no pid:
    its worker writes the identity one attribute at a time) is not judged.
    """
    attrs = trial.user_attrs
    job = attrs.get("slurm_job_id")
    if job:
        alive = None if job_alive is None else job_alive(str(job))
        return None if alive is None or alive else f"Slurm job {job} is gone"
    if attrs.get("host") != socket.gethostname() or "pid" not in attrs:
        return None         # another host's, or its worker is still stamping it (host before pid)
    pid = int(attrs["pid"])
    if pid == os.getpid():
        return None if attrs.get("run_token") == RUN_TOKEN else \
            f"its worker (process {pid}, an earlier run) ended before it finished"
    return None if _alive(pid) else f"its worker (process {pid}) ended before it finished"


def reap(study: optuna.Study, say: Callable[[str], None] = log.info,
         job_alive: JobAlive | None = None, max_retry: int | None = 1) -> list[int]:
    """Fail every RUNNING trial whose worker is gone and queue its point again; their numbers.

    One reaper for every storage: a stale heartbeat (RDB storages, ``fail_stale``: their
    callback re-queues), a Slurm job that ended (asked through ``job_alive``, see ``JobAlive``),
    a process on this host that died. The reason is recorded as the study attribute
    ``trial_<n>_error`` ("orphaned: ..."), the point comes back as a WAITING trial (``Requeue``:
    ``retry_of``, ``retries``), at most ``max_retry`` times.
    """
    failed = fail_stale(study) if _heartbeat_interval(study._storage) is not None else []
    requeue = Requeue(max_retry) if max_retry != 0 else None
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        why = gone(trial, job_alive)
        if why is None:
            continue
        study.set_user_attr(f"trial_{trial.number}_error", f"{ORPHANED}: {why}")
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except (ValueError, RuntimeError):   # its owner finished or failed it meanwhile
            continue
        failed.append(trial.number)
        if requeue is not None:
            requeue(study, trial)
    for number in failed:
        say(f"trial {number}: its worker is gone; marked FAIL, its point will be evaluated again")
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
        reason = t.user_attrs.get("error") or study.user_attrs.get(f"trial_{t.number}_error", "")
        if t.state == TrialState.FAIL and str(reason).startswith(ORPHANED):
            found.add(t.number)
        origin = t.user_attrs.get("retry_of", t.system_attrs.get("failed_trial"))
        if origin is not None:
            found.add(int(origin))
    return found
