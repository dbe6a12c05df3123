"""Run untrusted generated code in a contained subprocess (HumanEval / MBPP pass@1).

Containment, in layers (the human-eval execution harness's approach, made stricter):
  * a fresh interpreter (``python -I -S``) in its own temporary directory and process session,
    with an empty environment;
  * resource limits set before exec: address space (memory), CPU seconds, file size, no core dumps;
  * a wall-clock time limit; on expiry the whole process group is killed;
  * a CPython audit hook installed before the candidate code runs (it cannot be removed): it refuses
    process creation (fork, exec, spawn, subprocess, system), signals to other processes, sockets,
    ctypes/dlopen, and any file write, rename or delete outside the temporary directory;
  * where the kernel allows it, a private network namespace (no interfaces but loopback).
The calling process only waits for the child; nothing runs in it.
"""

from __future__ import annotations

import ctypes
import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_GUARD = r'''
import os, sys
_ROOT = os.path.realpath(os.getcwd())
_BLOCKED = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
            "os.startfile", "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn",
            "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
            "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "os.setuid", "os.chroot",
            "_posixsubprocess.fork_exec")
_WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                 "os.link", "os.symlink", "os.truncate", "shutil.rmtree", "os.utime")

def _inside(path):
    try:
        path = os.fsdecode(path)
    except TypeError:
        return False
    real = os.path.realpath(path)
    return real == _ROOT or real.startswith(_ROOT + os.sep)

def _hook(event, args):
    if event in _BLOCKED or event.startswith("os.exec") or event.startswith("os.spawn"):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args and args[0] is not None and not isinstance(args[0], int):
        mode, flags = args[1] or "r", args[2] or 0
        writes = any(c in str(mode) for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if writes and not _inside(args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the sandbox")
    elif event in _WRITE_EVENTS and args and not all(_inside(a) for a in args[:2]
                                                      if isinstance(a, (str, bytes, os.PathLike))):
        raise PermissionError(f"sandbox: {event} outside the sandbox")

sys.addaudithook(_hook)
del _hook
_done = sys.argv[1]
del sys.argv[1:]
_code = open("candidate.py", encoding="utf-8").read()
try:
    exec(compile(_code, "candidate.py", "exec"), {"__name__": "__main__"})
except SystemExit as _exit:
    sys.stderr.write(f"sandbox: the program called sys.exit({_exit.code!r}) before its tests "
                     "finished\n")
    sys.stderr.flush()
    os._exit(3)
sys.stdout.flush()
os.write(1, (_done + "\n").encode())
'''

_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Limits:
    """Resource limits for one run."""

    timeout_s: float = 10.0        # wall clock
    memory_bytes: int = 1 << 30    # address space
    file_bytes: int = 16 << 20     # largest file it may write


@dataclass(frozen=True)
class Outcome:
    passed: bool
    reason: str        # "passed", "failed", "timeout", "error: ..." (first stderr line)


def _limit_child(limits: Limits) -> None:    # runs in the child between fork and exec
    cpu = int(limits.timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:   # private network namespace when permitted (root / CAP_SYS_ADMIN); else the hook alone
        ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWNET)
    except OSError:
        pass


def run_program(program: str, limits: Limits = Limits()) -> Outcome:
    """Execute ``program`` (Python source) contained; passed iff it runs to its end and exits 0.

    An early ``sys.exit(0)`` (or ``os._exit(0)``) before the asserts is a failure: the guard prints
    a per-run token only after the whole program ran, and the token must be the last output line.
    """
    done = f"spectune-done-{secrets.token_hex(16)}"
    with tempfile.TemporaryDirectory(prefix="spectune-sandbox-") as folder:
        Path(folder, "candidate.py").write_text(program, encoding="utf-8")
        Path(folder, "guard.py").write_text(_GUARD, encoding="utf-8")
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "guard.py", done], cwd=folder,
            env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=lambda: _limit_child(limits))
        try:
            stdout, stderr = child.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(child)
            return Outcome(False, "timeout")
        finally:
            _kill_group(child)
    if child.returncode == 0:
        if stdout.rstrip(b"\n").rsplit(b"\n", 1)[-1] == done.encode():
            return Outcome(True, "passed")
        return Outcome(False, "exited 0 before the program's end (os._exit?)")
    lines = [ln for ln in stderr.decode(errors="replace").splitlines() if ln.strip()]
    if child.returncode < 0:
        return Outcome(False, f"killed by signal {-child.returncode}")
    return Outcome(False, f"error: {lines[-1][:200]}" if lines else "failed")


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()
