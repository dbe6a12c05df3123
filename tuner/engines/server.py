"""An inference engine's server process, owned by the tuner: started on loopback, always stopped.

``EngineServer(argv, name, log_dir)`` picks a free port on 127.0.0.1, starts the command
(``{port}`` in ``argv`` is replaced), writes its output to ``<log_dir>/<name>.log``, and waits
until its health endpoint answers 200 (a process that exits while starting is reported with the
log's tail). It is stopped — SIGTERM to its process group, SIGKILL after a grace period — by
``stop()``, by leaving the ``with`` block, and, should the tuner itself be killed, by the kernel:
the server is started with ``PR_SET_PDEATHSIG`` (Linux), so it cannot outlive the process that
started it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

PR_SET_PDEATHSIG = 1            # linux/prctl.h
STOP_GRACE_S = 10.0             # SIGTERM, then SIGKILL after this long


class EngineError(RuntimeError):
    """The engine did not start or did not answer; the message ends with its log's tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _die_with_parent() -> None:     # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class EngineServer:
    """One server process (see the module docstring)."""

    def __init__(self, argv: Sequence[str], name: str, log_dir: Path, health: str = "/health",
                 startup_timeout_s: float = 120.0, env: dict[str, str] | None = None) -> None:
        self.name, self.health, self.timeout = name, health, startup_timeout_s
        self.port = free_port()
        self.argv = [str(a).replace("{port}", str(self.port)) for a in argv]
        self.log_path = Path(log_dir) / f"{name}.log"
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EngineServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent, env=self.env)
            # its own session: the pid is its process group's id, which stop() signals (a log
            # reader checks that no process of that group outlives the tuner)
            log.write(f"# pid {self.proc.pid} (process group {self.proc.pid})\n".encode())
            log.flush()
        try:
            self._wait_healthy(began + self.timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - began
        return self

    def _wait_healthy(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise EngineError(f"{self.name} exited with code {self.proc.returncode} while "
                                  f"starting ({self.log_path}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass                     # not listening yet, or 503 while the model loads
            if time.monotonic() > deadline:
                raise EngineError(f"{self.name} did not answer {self.health} within "
                                  f"{self.timeout:.0f} s ({self.log_path}):\n{self.log_tail()}")
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after ``STOP_GRACE_S``; idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
