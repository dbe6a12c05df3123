"""Where a study lives: Optuna storage, creation with trial 0, resume checks, dead workers.

* Storage: any Optuna RDB URL (``storage=postgresql+psycopg://...``), else a journal file
  ``<studies_dir>/<study>.journal`` locked with ``JournalFileOpenLock`` (O_EXCL: works on NFSv3+).
  The path is absolute: a stale lock left by a killed writer is then released after Optuna's 30 s
  grace period. A journal with a torn last line is refused before it is opened (``validate``).
* Creation is atomic across processes: ``create_study`` without ``load_if_exists`` succeeds for
  exactly one process (journal and RDB alike); that one enqueues trial 0 (the method's default)
  and then records the settings fingerprint, which marks the study ready for the others.
* Failure reasons of trials this process does not own (orphans) are study attributes
  ``trial_<n>_error``; reasons of its own trials are trial attributes ``error``.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import optuna
from optuna.exceptions import DuplicatedStudyError
from optuna.trial import FrozenTrial, TrialState

from tuner.config.errors import ConfigError
from tuner.config.identity import check_resume
from tuner.cluster.liveness import heartbeat_storage

RUN_TOKEN = uuid.uuid4().hex          # this process's identity in trial attributes (pids repeat)
RETRIED = ("orphaned", "interrupted", "duplicate")   # failures whose point is evaluated again
RDB_SCHEMES = ("postgresql", "mysql", "sqlite", "mariadb", "oracle", "mssql")


def journal_path(studies_dir: str, study_name: str) -> Path:
    return (Path(studies_dir) / f"{study_name}.journal").resolve()


def make_storage(url: Any, journal_path: str | Path, heartbeat_interval: int = 60,
                 grace: int | None = None, max_retry: int | None = 1) -> Any:
    """The storage for ``url`` (None: a journal file at ``journal_path``).

    Args:
        url: None, an SQLAlchemy URL (RDB storage with a heartbeat: a killed worker's trial
            becomes FAIL after ``grace`` seconds and its point is re-queued), or a storage object.
        journal_path: the journal file used when ``url`` is None (made absolute; parent created).
        heartbeat_interval: seconds between heartbeats of a RUNNING trial (RDB only).
        grace: seconds without a heartbeat before a trial is stale (None: 2 * interval).
        max_retry: how often a dead trial's point is re-queued (0: never, None: no limit).
    """
    if url is None or url == "":
        path = Path(journal_path).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = optuna.storages.journal.JournalFileOpenLock(str(path))
        return optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(path), lock_obj=lock))
    if isinstance(url, str) and url.split(":", 1)[0].split("+", 1)[0] in RDB_SCHEMES:
        return heartbeat_storage(url, interval=heartbeat_interval, grace=grace,
                                 max_retry=max_retry)
    return url


def open_study(storage: Any, study_name: str, directions: list[str], sampler: Any, pruner: Any,
               fingerprint: Mapping[str, str], default: Mapping[str, Any], force: bool,
               say: Callable[[str], None], wait_s: float = 60.0,
               ignore: tuple[str, ...] = ()) -> tuple[optuna.Study, bool]:
    """Create the study (trial 0 enqueued once) or load it and check its fingerprint."""
    common = dict(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner)
    try:
        study = optuna.create_study(directions=directions, load_if_exists=False, **common)
    except DuplicatedStudyError:
        study = optuna.load_study(**common)
    else:
        study.enqueue_trial(dict(default), user_attrs={"stage": "default"})
        study.set_user_attr("fingerprint", dict(fingerprint))
        return study, True
    if [d.name.lower() for d in study.directions] != list(directions):
        raise ConfigError(f"study {study_name!r} optimises {[d.name.lower() for d in study.directions]}"
                          f", not {list(directions)} (search.objectives): use another study_name")
    deadline = time.monotonic() + wait_s
    while "fingerprint" not in study.user_attrs and len(study.trials) <= 1 and \
            time.monotonic() < deadline:           # its creator is between enqueue and fingerprint
        time.sleep(0.2)
    diff = check_resume(study_name, study.user_attrs.get("fingerprint"), fingerprint, force,
                        ignore)
    if diff:
        say(f"resume=force: continuing study {study_name} although {diff} changed")
    return study, False


def failure_reason(study: optuna.Study, trial: FrozenTrial) -> str:
    return str(trial.user_attrs.get("error") or
               study.user_attrs.get(f"trial_{trial.number}_error", ""))


def is_retried(study: optuna.Study, trial: FrozenTrial, dead: set[int] = frozenset()) -> bool:
    """A failure that says nothing about its point: the point is evaluated again.

    ``dead``: trials whose worker died (``tuner.cluster.liveness.orphans``: stale heartbeat, gone job).
    """
    if trial.state != TrialState.FAIL:
        return False
    reason = failure_reason(study, trial)
    if reason.startswith(RETRIED) or trial.number in dead:
        return True
    # a configuration error found by an earlier run does not burn budget once the config is fixed
    return trial.user_attrs.get("error_kind") == "config" and \
        trial.user_attrs.get("run_token") != RUN_TOKEN


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


def orphaned(trial: FrozenTrial, host: str | None = None,
             job_alive: Callable[[str], bool] | None = None) -> bool:
    """A RUNNING trial whose worker is gone: its Slurm job ended, or its process on this host.

    A pid equal to ours belongs to an earlier process (pids repeat across container restarts)
    unless the trial carries this process's run token.
    """
    attrs = trial.user_attrs
    job = attrs.get("slurm_job_id")
    if job:                       # a Slurm worker: judged by its job id (tuner.cluster.liveness)
        return job_alive is not None and not job_alive(str(job))
    if attrs.get("host") != (host or socket.gethostname()):
        return False
    pid = int(attrs.get("pid", -1))
    if pid == os.getpid():
        return attrs.get("run_token") != RUN_TOKEN
    return not _alive(pid)


def fail_orphans(study: optuna.Study, say: Callable[[str], None],
                 job_alive: Callable[[str], bool] | None = None) -> list[int]:
    """Mark FAIL the RUNNING trials left by dead workers; their points are evaluated again."""
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not orphaned(trial, job_alive=job_alive):
            continue
        who = trial.user_attrs.get("slurm_job_id") or f"process {trial.user_attrs.get('pid')}"
        study.set_user_attr(f"trial_{trial.number}_error",
                            f"orphaned: its worker ({who}) ended before it finished")
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except (ValueError, RuntimeError):   # finished meanwhile by its owner after all
            continue
        failed.append(trial.number)
        say(f"resume: trial {trial.number} was left RUNNING by {who}; marked FAIL, its point "
            "will be evaluated again")
    return failed
