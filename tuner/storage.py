"""Which Optuna storage a study lives in, for one process or many Slurm workers.

  * no URL (``storage: null``): a journal file, ``<studies_dir>/<study_name>.journal``, with
    ``JournalFileOpenLock`` (O_EXCL lock files: safe for several processes on one node, and on
    NFSv3+ across nodes; a lock left by a killed process is released after its 30 s grace).
    Journal storage has no heartbeat: dead Slurm workers are found by job id
    (``tuner.liveness.fail_dead_workers``).
  * an RDB URL (``postgresql+psycopg://...``, the choice for several nodes): ``RDBStorage`` with a
    heartbeat (``tuner.liveness.heartbeat_storage``), so a killed worker's trial becomes FAIL after
    the grace period and its point is re-queued.
  * anything else Optuna accepts is passed through as given (e.g. an already built storage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna

from tuner.liveness import heartbeat_storage

RDB_SCHEMES = ("postgresql", "mysql", "sqlite", "mariadb", "oracle", "mssql")


def make_storage(url: Any, journal_path: str | Path, heartbeat_interval: int = 60,
                 grace: int | None = None, max_retry: int | None = 1) -> Any:
    """The storage for ``url`` (None: a journal file at ``journal_path``).

    Args:
        url: None, an SQLAlchemy URL, or a storage object (returned unchanged).
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
