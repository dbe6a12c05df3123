"""Where results go: the Optuna storage, ``studies_dir``, study journals and MLflow tracking.

Checked before anything is opened: a database URL and its driver, an SQLite file that can be
created, folders that can be written, a journal whose lines parse, and a tracking server that
answers (one short HTTP GET; skipped when the Slurm launcher starts the server itself).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tuner.config.errors import ConfigError

TRACKING = ("mlflow", "none", "server")
SQLITE_HEADER = b"SQLite format 3\x00"
PROBE_S = 3.0            # how long a tracking server may take to answer /health


def check_storage(storage: Any) -> None:
    if storage in (None, ""):
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError
    try:
        url = make_url(str(storage))
    except ArgumentError:
        raise ConfigError(f"storage={storage!r} is not a database URL: allowed are e.g. "
                          "postgresql+psycopg://user:pw@host/db, sqlite:///path.db, or null for "
                          "a journal file in studies_dir") from None
    if url.get_backend_name() not in ("postgresql", "sqlite", "mysql"):
        raise ConfigError(f"storage={storage!r}: backend {url.get_backend_name()!r} is not "
                          "supported: allowed are postgresql, sqlite, mysql")
    try:
        url.get_dialect().import_dbapi()
    except NoSuchModuleError:
        raise ConfigError(f"storage={storage!r}: SQLAlchemy knows no driver "
                          f"{url.drivername!r}: allowed are e.g. postgresql+psycopg, "
                          "postgresql+psycopg2, sqlite") from None
    except ImportError as err:
        raise ConfigError(f"storage={storage!r}: its database driver is not installed "
                          f"({err}); e.g. pip install 'psycopg[binary]'") from None
    if url.get_backend_name() == "sqlite":
        check_sqlite_file("storage", storage, url.database, create_folder=False,
                          allowed="an SQLite file in an existing, writable folder (e.g. "
                                  "sqlite:///studies/optuna.db), or null for a journal file in "
                                  "studies_dir")


def check_sqlite_file(name: str, value: Any, database: str | None, create_folder: bool,
                      allowed: str) -> None:
    """An SQLite database file that exists, or that can be created (its folder too, if asked).

    ``database`` is the URL's path (None or ':memory:' for an in-memory database: nothing to
    check). Nothing is written but a probe file, removed at once.
    """
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    path = Path(database).expanduser()
    folder = path.parent
    where = f"{name}={value!r}"
    if not folder.exists() and create_folder:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"{where}: its folder {folder} cannot be created "
                              f"({err.strerror}): allowed is {allowed}") from None
    if not folder.exists():
        raise ConfigError(f"{where}: folder {folder} does not exist: allowed is {allowed} "
                          f"(create it: mkdir -p {folder})")
    if not folder.is_dir():
        raise ConfigError(f"{where}: {folder} is not a folder: allowed is {allowed}")
    if path.is_dir():
        raise ConfigError(f"{where}: {path} is a folder, not an SQLite file: allowed is "
                          f"{allowed}")
    try:
        if path.exists():
            with path.open("rb") as f:
                header = f.read(len(SQLITE_HEADER))
            if header and header != SQLITE_HEADER:
                raise ConfigError(f"{where}: {path} exists and is not an SQLite database: "
                                  f"allowed is {allowed}")
            path.open("ab").close()              # writable? (appends nothing)
        else:                # a probe of its own: workers started together check the same file
            fd, probe = tempfile.mkstemp(prefix=f".{path.name}.spectune-write-probe-",
                                         dir=folder)
            os.close(fd)
            os.unlink(probe)
    except OSError as err:
        raise ConfigError(f"{where}: {path} cannot be written ({err.strerror}): allowed is "
                          f"{allowed}") from None


def check_folder(name: str, value: Any, allowed: str = "a folder path") -> None:
    """A folder that exists or can be created, and can be written; an empty value is refused
    (it would silently mean the current folder)."""
    if value is None or not str(value).strip():
        raise ConfigError(f"{name}={value!r} is empty: allowed is {allowed}")
    path = Path(str(value))
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name}={value!r} is a file, not a folder: allowed is {allowed}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{name}={value!r} cannot be used as a folder: {err.strerror}") \
            from None
    try:        # a file of its own: workers started together probe the same folder at once
        fd, probe = tempfile.mkstemp(prefix=".spectune-write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(f"{name}={value!r} is not writable: {err.strerror}") from None


def check_journal(path: Path) -> None:
    """Refuse a journal whose lines do not all parse (a crash mid-write leaves a torn last line).

    The file is only read, never modified: the message says how to repair it.
    """
    if not path.is_file():
        return
    data = path.read_bytes()
    lines = data.split(b"\n")
    if data and not data.endswith(b"\n"):
        raise ConfigError(f"study journal {path} ends in an incomplete line ({len(lines[-1])} "
                          "bytes, a crash mid-write?); nothing was changed. Repair: keep a copy, "
                          f"then drop the last line: python -c \"import pathlib; p=pathlib."
                          f"Path('{path}'); b=p.read_bytes(); "
                          "p.write_bytes(b[:b.rfind(b'\\n')+1])\"")
    for number, line in enumerate(lines[:-1], 1):
        try:
            json.loads(line)
        except ValueError:
            raise ConfigError(f"study journal {path} line {number} is not valid JSON (a torn or "
                              "edited line); nothing was changed. Repair: restore it from a copy "
                              "or remove that line and the ones after it") from None


def check_tracking(tracking: Mapping[str, Any], launcher_starts_server: bool = False) -> None:
    """``launcher_starts_server``: the Slurm launcher will start the server (tracking.start=true,
    launcher=slurm, phase=all), so it is not probed; any other run needs it answering now."""
    kind = tracking.get("kind")
    if kind not in TRACKING:
        raise ConfigError(f"tracking.kind={kind!r} is unknown: allowed are {list(TRACKING)}")
    if kind == "server":
        uri = str(tracking.get("tracking_uri", ""))
        if not uri.startswith(("http://", "https://")):
            raise ConfigError(f"tracking.tracking_uri={uri!r} is invalid for tracking=server: "
                              "allowed is an http(s):// URL of an MLflow server")
        if launcher_starts_server:
            check_started_port(tracking, uri)
        else:
            check_server_answers(tracking, uri)
    if kind == "mlflow":
        uri = str(tracking.get("tracking_uri", ""))
        if uri.startswith("sqlite:"):
            from sqlalchemy.engine import make_url
            check_sqlite_file("tracking.tracking_uri", uri, make_url(uri).database,
                              create_folder=True, allowed="an SQLite file in a folder that "
                              "exists or can be created (e.g. sqlite:///mlruns/mlflow.db)")
        if tracking.get("artifact_root"):      # empty / null: MLflow's default location
            check_folder("tracking.artifact_root", tracking["artifact_root"])


def check_started_port(tracking: Mapping[str, Any], uri: str) -> None:
    """The server ``tracking.start`` starts listens on tracking.port: the URI must point there."""
    from tuner.tracking.server import ServerSettings
    port = ServerSettings.from_config(tracking).port
    parts = urlsplit(uri)
    try:
        given = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        given = None
    if given != port:
        raise ConfigError(f"tracking.tracking_uri={uri!r} does not point at the server "
                          f"tracking.start=true starts (tracking.port={port}): allowed is "
                          f"http://<server host>:{port}, or tracking.start=false for a server "
                          "you run yourself")


def check_server_answers(tracking: Mapping[str, Any], uri: str) -> None:
    problem = probe_server(uri)
    if problem is None:
        return
    parts = urlsplit(uri)
    started = (" (tracking.start=true starts one only with launcher=slurm)"
               if tracking.get("start") else "")
    raise ConfigError(
        f"tracking.tracking_uri={uri!r}: no MLflow server answers there ({problem}){started}: "
        f"allowed is the URL of a running one; start it with: python -m tuner.tracking.server "
        f"--host {parts.hostname} --port {parts.port or 5000} (PostgreSQL first: "
        "scripts/services.sh start), or use tracking=mlflow (a local SQLite store)")


def probe_server(uri: str, timeout: float = PROBE_S) -> str | None:
    """None when ``<uri>/health`` answers within ``timeout`` seconds, else what went wrong.

    The GET runs in a daemon thread, so a slow name lookup cannot hold validation either.
    """
    outcome: list[str | None] = []
    worker = threading.Thread(target=lambda: outcome.append(_health(uri, timeout)), daemon=True)
    worker.start()
    worker.join(timeout + 1.0)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


def _health(uri: str, timeout: float) -> str | None:
    url = f"{uri.rstrip('/')}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return None if response.status == 200 else f"GET {url}: HTTP {response.status}"
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):             # an MLflow server behind authentication
            return None
        return f"GET {url}: HTTP {err.code}, not an MLflow server"
    except urllib.error.URLError as err:
        import ssl
        if isinstance(err.reason, ssl.SSLCertVerificationError):
            return None                        # TLS answers; MLflow's own settings judge the cert
        reason = err.reason
        return f"GET {url}: {getattr(reason, 'strerror', None) or reason}"
    except (OSError, ValueError) as err:        # timeouts, resets, malformed URLs
        return f"GET {url}: {getattr(err, 'strerror', None) or err or type(err).__name__}"
