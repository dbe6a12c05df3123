"""Skip-or-fail guards for tests that drive the real Slurm, PostgreSQL (scripts/services.sh) and
llama-server (scripts/engines.sh).

Locally a test skips only when the tool is truly absent (no ``sbatch`` on PATH, PostgreSQL refuses
the connection). Under ``CI=true`` a missing service is a failure: CI starts them (`make test`).

Below them, what the engine tests read back from the servers they started: their process groups
(``server_groups``, ``alive``) and, from a llama-server's log, its requests on its own clock
(``slot_timeline``: how many were really in flight at once).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

import pytest

from bench.services import PG_URL

IN_CI = os.environ.get("CI") == "true"


def _absent(reason: str, remedy: str = "start it with `make services`") -> None:
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: `make test` must have provided it)")
    pytest.skip(f"{reason}; {remedy}")


@functools.lru_cache(maxsize=1)
def _sinfo_error() -> str | None:
    """None when the controller answers, else sinfo's complaint (asked once per session: a
    missing controller makes sinfo retry for ~10 s)."""
    done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or not done.stdout.strip():
        return done.stderr.strip() or "no partitions"
    return None


def require_slurm() -> None:
    """Skip when sbatch is absent; fail when it is installed but the controller does not answer."""
    if shutil.which("sbatch") is None:
        _absent("sbatch not found")
    error = _sinfo_error()
    if error:
        pytest.fail(f"Slurm is installed but sinfo fails ({error}): run `make services`")


def require_postgres(url: str = PG_URL) -> None:
    """Skip when PostgreSQL refuses the connection (fail under CI); other errors fail."""
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(url)
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT 1"))
        engine.dispose()
    except sqlalchemy.exc.OperationalError as e:
        if "refused" in str(e) or "could not connect" in str(e).lower():
            _absent(f"PostgreSQL at {url} refused the connection")
        raise


def require_llama_server() -> str:
    """The cached llama-server (scripts/engines.sh); skip when not built (fail under CI)."""
    from tuner.engines.servers import cached_build
    found = cached_build("llamacpp")
    if found is None:
        _absent("llama-server is not built for this CPU", "build it with `make engines`")
    return str(found / "llama-server")


def wait_for(cond, timeout: float = 60.0, every: float = 0.3, what: str = ""):
    """Poll ``cond()`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout} s waiting for {what or cond}")


def require_vllm() -> str:
    """The cached vLLM install's ``vllm`` (scripts/engines.sh vllm); skip when not installed
    (fail under CI)."""
    from tuner.engines.servers import cached_build
    found = cached_build("vllm")
    if found is None:
        _absent("vLLM is not installed", "install it with `make engines-vllm`")
    return str(found / "vllm")


# -- the engine servers a test started (their process groups, from the servers' logs) -----------


def server_groups(study_dir) -> list[int]:
    """The process group of every server a study started (``tuner.engines.server`` writes
    ``# pid N (process group N)`` into the server's log when it starts it)."""
    import re
    from pathlib import Path
    groups = []
    for log in sorted((Path(study_dir) / "engine").glob("*.log")):
        groups += [int(n) for n in re.findall(r"^# pid (\d+) \(process group",
                                              log.read_text(errors="replace"), flags=re.M)]
    return groups


def alive(groups) -> list[int]:
    """The live (not zombie) processes in these process groups: the servers' own and every child
    they started (vLLM's engine core and workers), however they were reparented."""
    from pathlib import Path
    wanted, found = set(groups), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:                         # exited while we looked
            continue
        state, _, group = text[text.rindex(")") + 2:].split()[:3]
        if int(group) in wanted and state != "Z":
            found.append(int(stat.parent.name))
    return found


def all_gone(groups, timeout_s: float = 30.0) -> list[int]:
    """Wait (bounded) for the processes of ``groups`` to exit; returns those still alive."""
    deadline = time.monotonic() + timeout_s
    while (left := alive(groups)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def sigint_default() -> None:
    """``preexec_fn`` of a tuner that a test stops with SIGINT: Ctrl-C acts as in a terminal's
    foreground. A command that a non-interactive shell starts in the background (``cmd &``)
    inherits SIGINT (and SIGQUIT) ignored, and so does everything it starts: pytest, then the
    tuner, where Python then installs no KeyboardInterrupt handler and the study runs on to its
    end (seen: a vLLM study of 9 trials after the Ctrl-C tests' SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# -- what a llama-server did, on its own clock (its log) ----------------------------------------

# llama-server's log line prefix (common/log.cpp, on by default in the cached build):
# minutes.seconds.milliseconds.microseconds since the server started, then the level letter, e.g.
#   0.00.908.986 I slot launch_slot_: id  1 | task 3 | processing task, is_child = 0
#   0.03.063.565 I slot      release: id  1 | task 3 | stop processing: n_tokens = 27, ...
_STAMP = r"^(\d+)\.(\d\d)\.(\d{3})\.(\d{3}) \w "
_LAUNCH = r"slot launch_slot_: id +\d+ \| task (\d+) \| processing task"
_RELEASE = r"slot +release: id +\d+ \| task (\d+) \| stop processing"


@dataclass(frozen=True)
class SlotTimeline:
    """The tasks one llama-server processed: ``tasks[id] = (start_s, end_s)`` on the server's own
    clock (a slot taking the task, the slot releasing it), and the most of them in flight at
    once."""
    tasks: dict[int, tuple[float, float]]
    most_in_flight: int


def slot_timeline(log_text: str) -> SlotTimeline:
    """The slot timeline of the last server started with this log (``tuner.engines.server``
    appends each start to ``<name>.log`` after a ``$ <argv>`` line; every start has its own
    clock and task ids). A task still unreleased at the log's end counts as in flight until the
    log's last timestamp. Tasks that only touch (one released at the instant another starts) are
    not in flight together.

    Raises:
        ValueError: the log has slot lines without timestamps (start llama-server with
            ``--log-timestamps --log-prefix``).
    """
    run = re.split(r"^\$ .*$", log_text, flags=re.M)[-1]
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    last = 0.0
    for line in run.splitlines():
        stamp = re.match(_STAMP, line)
        event = re.search(_LAUNCH, line) or re.search(_RELEASE, line)
        if event and not stamp:
            raise ValueError(f"a slot line without a timestamp (start llama-server with "
                             f"--log-timestamps --log-prefix): {line!r}")
        if not stamp:
            continue
        minutes, secs, ms, us = (int(g) for g in stamp.groups())
        last = (((minutes * 60 + secs) * 1000 + ms) * 1000 + us) / 1e6
        if event:
            (starts if "launch_slot_" in event.group(0) else ends)[int(event.group(1))] = last
    tasks = {task: (start, ends.get(task, last)) for task, start in sorted(starts.items())}
    # the sweep: +1 where a task starts, -1 where one ends; at the same instant ends go first
    events = sorted([(s, 1) for s, _ in tasks.values()] + [(e, -1) for _, e in tasks.values()])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return SlotTimeline(tasks, most)
