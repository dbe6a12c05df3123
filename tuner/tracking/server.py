"""An MLflow tracking server for many writers (``tracking=server``): PostgreSQL + shared artifacts.

Many Slurm workers logging into one SQLite file lock each other out; instead one ``mlflow server``
keeps runs in PostgreSQL and proxies artifacts to a shared directory, and workers log over HTTP.
The command it runs (``server_command``):

    mlflow server \\
        --backend-store-uri postgresql+psycopg://spectune:spectune@127.0.0.1:5432/mlflow \\
        --artifacts-destination <shared dir> --host 127.0.0.1 --port 5000 --workers 2

(with ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``: MLflow's GenAI job runner is not needed and
doubles the start-up time).

Use it from Python (``ensure_server(settings)``: reuse a server that answers, else create the
database if missing, start one and wait for ``/health``), or from the shell:

    python -m tuner.tracking.server --artifacts-destination /shared/mlartifacts   # foreground

For other nodes to reach it, bind ``--host 0.0.0.0`` and pass ``--allowed-hosts`` (MLflow's
security middleware accepts localhost only by default).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

DEFAULT_BACKEND = "postgresql+psycopg://spectune:spectune@127.0.0.1:5432/mlflow"


@dataclass(frozen=True)
class ServerSettings:
    """Where the server keeps runs and artifacts, where it listens (conf/tracking/server.yaml)."""

    backend_store_uri: str = DEFAULT_BACKEND     # PostgreSQL database of runs (created if missing)
    artifacts_destination: str = "mlruns/server-artifacts"   # shared dir the server writes to
    host: str = "127.0.0.1"                      # 0.0.0.0 to serve other nodes
    port: int = 5000
    workers: int = 2                             # uvicorn workers (fewer start faster)
    allowed_hosts: str | None = None             # --allowed-hosts, needed for remote clients
    job_execution: bool = False                  # MLflow's GenAI job runner: unused here; it
                                                 # doubles the start-up (6 s vs 12 s, 1 worker)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ServerSettings:
        keys = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dict(cfg).items() if k in keys})

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


def server_command(s: ServerSettings) -> list[str]:
    """The ``mlflow server`` argv (run with this interpreter's mlflow)."""
    dest = Path(s.artifacts_destination).resolve()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", s.backend_store_uri,
           "--artifacts-destination", str(dest), "--host", s.host, "--port", str(s.port),
           "--workers", str(s.workers)]
    if s.allowed_hosts:
        cmd += ["--allowed-hosts", s.allowed_hosts]
    return cmd


def server_env(s: ServerSettings) -> dict[str, str]:
    """The environment for the server process (job execution on/off)."""
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": str(s.job_execution).lower()}


def ensure_database(uri: str) -> bool:
    """Create the PostgreSQL database named in ``uri`` if missing; True when it was created.

    Connects to the ``postgres`` maintenance database with the same credentials (the role needs
    CREATEDB, which scripts/services.sh grants to ``spectune``).
    """
    import sqlalchemy

    url = sqlalchemy.engine.make_url(uri)
    if not url.drivername.startswith("postgresql"):
        return False
    engine = sqlalchemy.create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            exists = conn.execute(sqlalchemy.text("SELECT 1 FROM pg_database WHERE datname = :n"),
                                  {"n": url.database}).first()
            if exists:
                return False
            conn.execute(sqlalchemy.text(f'CREATE DATABASE "{url.database}"'))
            return True
    finally:
        engine.dispose()


def answers(url: str, timeout: float = 2.0) -> bool:
    """True when ``<url>/health`` says OK."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_server(s: ServerSettings, log_path: str | Path | None = None,
                 timeout: float = 120.0) -> subprocess.Popen:
    """Create the database if missing, start ``mlflow server`` and wait until it answers.

    The server runs in its own session, so it outlives the caller (a launcher that submits Slurm
    jobs and exits); stop it with ``stop_server`` or ``kill -- -$(cat <pid file>)``. Output goes to
    ``log_path`` (default: ``<artifacts_destination>/../mlflow-server.log``), the process group id
    to ``mlflow-server.pid`` next to it.
    """
    ensure_database(s.backend_store_uri)
    dest = Path(s.artifacts_destination).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    log = Path(log_path) if log_path else dest.parent / "mlflow-server.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(server_command(s), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=server_env(s))
    log.with_name("mlflow-server.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + timeout
    while not answers(s.url):
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}; see {log}")
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"mlflow server did not answer at {s.url} within {timeout} s; "
                               f"see {log}")
        time.sleep(0.25)
    return proc


def ensure_server(s: ServerSettings, **kw: Any) -> tuple[str, subprocess.Popen | None]:
    """The server's URL; starts one (returned as the Popen) only when none answers there."""
    if answers(s.url):
        return s.url, None
    return s.url, start_server(s, **kw)


def stop_server(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Stop a server from ``start_server`` (its whole process group: uvicorn workers too)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, 15)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> None:
    """``python -m tuner.tracking.server [options]``: create the database, run the server."""
    d = ServerSettings()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend-store-uri", default=d.backend_store_uri)
    p.add_argument("--artifacts-destination", default=d.artifacts_destination)
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--allowed-hosts", default=None)
    p.add_argument("--job-execution", action="store_true", help="enable MLflow's job runner")
    a = p.parse_args(argv)
    s = ServerSettings(a.backend_store_uri, a.artifacts_destination, a.host, a.port, a.workers,
                       a.allowed_hosts, a.job_execution)
    ensure_database(s.backend_store_uri)
    Path(s.artifacts_destination).mkdir(parents=True, exist_ok=True)
    cmd = server_command(s)
    print("+", " ".join(cmd), flush=True)
    os.execve(cmd[0], cmd, server_env(s))


if __name__ == "__main__":
    main()
