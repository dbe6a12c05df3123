"""Where a study lives: Optuna storage, creation with trial 0, resume checks.

* Storage: any Optuna RDB URL (``storage=postgresql+psycopg://...``), else a journal file
  ``<studies_dir>/<study>.journal`` locked with ``JournalFileOpenLock`` (O_EXCL: works on NFSv3+).
  The path is absolute: a stale lock left by a killed writer is then released after Optuna's 30 s
  grace period. A journal with a torn last line is refused before it is opened (``validate``).
* Creation is atomic across processes: ``create_study`` without ``load_if_exists`` succeeds for
  exactly one process (journal and RDB alike); that one enqueues trial 0 (the method's default)
  and then records the settings fingerprint, which marks the study ready for the others.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import optuna
from optuna.exceptions import DuplicatedStudyError

from tuner.config.errors import ConfigError
from tuner.config.identity import check_resume
from tuner.study.holding import enqueue
from tuner.study.liveness import heartbeat_storage

RDB_SCHEMES = ("postgresql", "mysql", "sqlite", "mariadb", "oracle", "mssql")


def journal_path(studies_dir: str, study_name: str) -> Path:
    return (Path(studies_dir) / f"{study_name}.journal").resolve()


JOURNAL_LOCK_GRACE_S = 30       # Optuna's default: a lock file unchanged this long is stale


def make_storage(url: Any, journal_path: str | Path, heartbeat_interval: int = 60,
                 grace: int | None = None, max_retry: int | None = 1,
                 lock_grace_s: float = JOURNAL_LOCK_GRACE_S) -> Any:
    """The storage for ``url`` (None: a journal file at ``journal_path``).

    Args:
        url: None, an SQLAlchemy URL (RDB storage with a heartbeat: a killed worker's trial
            becomes FAIL after ``grace`` seconds and its point is re-queued), or a storage object.
        journal_path: the journal file used when ``url`` is None (made absolute; parent created).
        heartbeat_interval: seconds between heartbeats of a RUNNING trial (RDB only).
        grace: seconds without a heartbeat before a trial is stale (None: 2 * interval).
        max_retry: how often a dead trial's point is re-queued (0: never, None: no limit).
        lock_grace_s: the journal's lock file, once seen unchanged this long, is taken as left
            by a killed writer and removed (Optuna's ``grace_period``; a writer holds it for
            milliseconds).
    """
    if url is None or url == "":
        path = Path(journal_path).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = optuna.storages.journal.JournalFileOpenLock(str(path), grace_period=lock_grace_s)
        return optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(path), lock_obj=lock))
    if isinstance(url, str) and url.split(":", 1)[0].split("+", 1)[0] in RDB_SCHEMES:
        return heartbeat_storage(url, interval=heartbeat_interval, grace=grace,
                                 max_retry=max_retry)
    return url


def open_study(storage: Any, study_name: str, directions: list[str], sampler: Any, pruner: Any,
               fingerprint: Mapping[str, str], default: Mapping[str, Any], force: bool,
               say: Callable[[str], None], wait_s: float = 60.0,
               ignore: tuple[str, ...] = (),
               metric_names: list[str] | None = None) -> tuple[optuna.Study, bool]:
    """Create the study (trial 0 enqueued once) or load it and check its fingerprint."""
    common = dict(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner)
    try:
        study = optuna.create_study(directions=directions, load_if_exists=False, **common)
    except DuplicatedStudyError:
        study = optuna.load_study(**common)
    else:
        enqueue(study, default, stage="default")
        if metric_names:            # optuna-dashboard and plots show them, not "Objective 0"
            with warnings.catch_warnings():         # experimental in Optuna 5
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names(list(metric_names))
        study.set_user_attr("fingerprint", dict(fingerprint))
        return study, True
    if [d.name.lower() for d in study.directions] != list(directions):
        found = [d.name.lower() for d in study.directions]
        raise ConfigError(f"study {study_name!r} optimises {found}, not {list(directions)} "
                          "(search.objectives): use another study_name")
    deadline = time.monotonic() + wait_s
    while "fingerprint" not in study.user_attrs and len(study.trials) <= 1 and \
            time.monotonic() < deadline:           # its creator is between enqueue and fingerprint
        time.sleep(0.2)
    diff = check_resume(study_name, study.user_attrs.get("fingerprint"), fingerprint, force,
                        ignore)
    if diff:
        say(f"resume=force: continuing study {study_name} although {diff} changed")
    return study, False
