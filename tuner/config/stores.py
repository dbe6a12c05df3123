"""Where results go: the Optuna storage, ``studies_dir``, study journals and MLflow tracking.

Checked before anything is opened: a database URL and its driver, folders that can be written, a
journal whose lines parse, and the tracking settings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from tuner.config.errors import ConfigError

TRACKING = ("mlflow", "none", "server")


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


def check_folder(name: str, value: Any) -> None:
    path = Path(str(value))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{name}={value!r} cannot be used as a folder: {err.strerror}") \
            from None
    probe = path / ".spectune-write-probe"
    try:
        probe.write_text("")
        probe.unlink()
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
                          f"Path('{path}'); b=p.read_bytes(); p.write_bytes(b[:b.rfind(b'\\n')+1])\"")
    for number, line in enumerate(lines[:-1], 1):
        try:
            json.loads(line)
        except ValueError:
            raise ConfigError(f"study journal {path} line {number} is not valid JSON (a torn or "
                              "edited line); nothing was changed. Repair: restore it from a copy "
                              "or remove that line and the ones after it") from None


def check_tracking(tracking: Mapping[str, Any]) -> None:
    kind = tracking.get("kind")
    if kind not in TRACKING:
        raise ConfigError(f"tracking.kind={kind!r} is unknown: allowed are {list(TRACKING)}")
    if kind == "server":
        uri = str(tracking.get("tracking_uri", ""))
        if not uri.startswith(("http://", "https://")):
            raise ConfigError(f"tracking.tracking_uri={uri!r} is invalid for tracking=server: "
                              "allowed is an http(s):// URL of an MLflow server")
    if kind == "mlflow":
        uri = str(tracking.get("tracking_uri", ""))
        if uri.startswith("sqlite:///"):
            check_folder("tracking.tracking_uri", Path(uri[len("sqlite:///"):]).parent or ".")
        check_folder("tracking.artifact_root", tracking.get("artifact_root", "mlruns"))
