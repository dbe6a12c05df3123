"""Slurm fan-out: render sbatch scripts, submit them, ask whether a job is still alive.

One sweep on Slurm is three jobs on the same study (``conf/launcher/slurm.yaml``):

  prepare ──afterok──▶ workers (``--array=0-{N-1}``, one Optuna worker each) ──afterany──▶ finish

The commands are argv lists supplied by the caller (the tuner's ``phase=prepare|work|finish``);
they are shell-quoted here, so ``${oc.env:SPECTUNE_RUN_DATE}`` reaches Hydra untouched. Each worker
sees its index as ``$SLURM_ARRAY_TASK_ID``. The scripts are written next to the study
(``write_sweep``) so they can be inspected and re-submitted by hand.

Scheduled sweeps (``launcher.schedule``): Debian 12's Slurm 22.05 ships no ``scrontab``, so a
scheduled script first submits its own successor with ``sbatch --begin=<next time>
--dependency=singleton`` and then runs the sweep. Each run exports ``SPECTUNE_RUN_DATE``
(``YYYY-MM-DD``, plus ``-HHMM`` for sub-daily schedules) so every run can be a new study.

Liveness: ``job_state`` asks ``squeue`` then ``scontrol show job`` (``sacct`` needs accounting,
which a single-node install does not run). It raises ``SlurmError`` when the controller cannot be
reached, so a caller never mistakes "no answer" for "dead". ``job_alive_or_none`` is the check the
study's reaper is given (``tuner.study.liveness.JobAlive``: None for "no answer"); the study never
imports this module, and what a worker records about itself (host, GPU, Slurm job id from the
environment) is ``tuner.study.liveness.worker_identity``.
"""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Mapping, Sequence

log = logging.getLogger(__name__)
ALIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
    "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "STOPPED",
})
_SCHEDULES = "daily, daily@HH:MM, hourly, now+<N>[seconds|minutes|hours|days|weeks]"
_RELATIVE = re.compile(r"^now\+(\d+)(seconds|minutes|hours|days|weeks)?$")
_DAILY_AT = re.compile(r"^daily@([01]\d|2[0-3]):([0-5]\d)$")
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")   # Slurm --time forms


class SlurmError(RuntimeError):
    """A Slurm command failed or its answer could not be read."""


@dataclass(frozen=True)
class SlurmSettings:
    """The ``launcher`` config group for ``launcher=slurm`` (see conf/launcher/slurm.yaml)."""

    workers: int = 4                      # array tasks, each one Optuna worker on the same study
    partition: str | None = None          # None: the cluster's default partition
    gpus_per_worker: int = 0              # --gres=gpu:N (0: no GPU line)
    cpus_per_worker: int = 1              # --cpus-per-task
    mem_per_worker: str | None = None     # --mem (e.g. 16G); None: the cluster's DefMemPerCPU
    time: str = "04:00:00"                # --time of each job
    account: str | None = None            # --account
    extra_sbatch: tuple[str, ...] = ()    # more "#SBATCH" options, e.g. ("--qos=high",)
    schedule: str | None = None           # None | daily | daily@HH:MM | hourly | now+<N><unit>
    output_dir: str = "slurm"             # scripts + logs (relative: under the study dir)
    job_name: str = "spectune"            # --job-name prefix (-prepare, -work, -finish)
    workdir: str | None = None            # --chdir; None: the directory sbatch is called from

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> SlurmSettings:
        """Build from a launcher config mapping; ``kind`` is ignored, unknown keys are errors."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in dict(cfg).items() if k != "kind"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"launcher: unknown key(s) {unknown}: allowed are {sorted(known)}")
        if values.get("extra_sbatch") is not None:
            values["extra_sbatch"] = tuple(str(x) for x in values["extra_sbatch"])
        else:
            values.pop("extra_sbatch", None)
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        """Raise ValueError naming the first bad setting."""
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"launcher.workers={self.workers!r} is invalid: "
                             "allowed is an int >= 1")
        if not isinstance(self.gpus_per_worker, int) or self.gpus_per_worker < 0:
            raise ValueError(f"launcher.gpus_per_worker={self.gpus_per_worker!r} is invalid: "
                             "allowed is an int >= 0")
        if not isinstance(self.cpus_per_worker, int) or self.cpus_per_worker < 1:
            raise ValueError(f"launcher.cpus_per_worker={self.cpus_per_worker!r} is invalid: "
                             "allowed is an int >= 1")
        if not _TIME.match(str(self.time)):
            raise ValueError(f"launcher.time={self.time!r} is invalid: allowed are Slurm --time "
                             "forms (MM, HH:MM:SS, D-HH:MM:SS)")
        for line in self.extra_sbatch:
            if not line.startswith("-") or any(c.isspace() for c in line):
                raise ValueError(f"launcher.extra_sbatch entry {line!r} is invalid: allowed is "
                                 "one sbatch option without spaces per entry, e.g. --qos=high")
        if self.schedule is not None:
            next_begin(self.schedule)   # validates


# ---------------------------------------------------------------- rendering

def _header(s: SlurmSettings, name: str, output: str, extra: Sequence[str] = ()) -> list[str]:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --output={output}",
             f"#SBATCH --time={s.time}", f"#SBATCH --cpus-per-task={s.cpus_per_worker}"]
    if s.partition:
        lines.append(f"#SBATCH --partition={s.partition}")
    if s.account:
        lines.append(f"#SBATCH --account={s.account}")
    if s.mem_per_worker:
        lines.append(f"#SBATCH --mem={s.mem_per_worker}")
    if s.gpus_per_worker:
        lines.append(f"#SBATCH --gres=gpu:{s.gpus_per_worker}")
    if s.workdir:
        lines.append(f"#SBATCH --chdir={s.workdir}")
    lines += [f"#SBATCH {opt}" for opt in (*extra, *s.extra_sbatch)]
    return lines


def _body(argv: Sequence[str]) -> list[str]:
    if not argv:
        raise ValueError("slurm: the command argv is empty: allowed is a non-empty list of "
                         "strings")
    return ["set -euo pipefail",
            'echo "spectune: job ${SLURM_JOB_ID:-?} task ${SLURM_ARRAY_TASK_ID:-none} on '
            '$(hostname -s) GPUs ${CUDA_VISIBLE_DEVICES:-none}"',
            shlex.join(str(a) for a in argv)]


def render_prepare(s: SlurmSettings, argv: Sequence[str], log_dir: str | Path) -> str:
    """The prepare job: one task that runs ``argv`` (creates the study, baseline, ...)."""
    out = f"{Path(log_dir)}/%x_%j.out"
    return "\n".join(_header(s, f"{s.job_name}-prepare", out) + _body(argv)) + "\n"


def render_workers(s: SlurmSettings, argv: Sequence[str], log_dir: str | Path,
                   n: int | None = None) -> str:
    """The worker array: ``n`` (default ``s.workers``) tasks, each runs ``argv``.

    ``--kill-on-invalid-dep=yes``: when prepare fails, the array is cancelled instead of pending
    forever, so finish (afterany) still runs and reports.
    """
    n = s.workers if n is None else n
    out = f"{Path(log_dir)}/%x_%A_%a.out"
    head = _header(s, f"{s.job_name}-work", out, [f"--array=0-{n - 1}",
                                                   "--kill-on-invalid-dep=yes"])
    return "\n".join(head + _body(argv)) + "\n"


def render_finish(s: SlurmSettings, argv: Sequence[str], log_dir: str | Path,
                  after: str | None = None) -> str:
    """The finish job; ``after`` (the array's job id) adds ``--dependency=afterany:<after>``."""
    out = f"{Path(log_dir)}/%x_%j.out"
    extra = [f"--dependency=afterany:{after}"] if after else []
    return "\n".join(_header(s, f"{s.job_name}-finish", out, extra) + _body(argv)) + "\n"


def render_scheduled(s: SlurmSettings, argv: Sequence[str], log_dir: str | Path,
                     script_path: str | Path) -> str:
    """A job that first submits its successor (``--begin`` from ``s.schedule``), then runs argv.

    ``script_path`` is where this text will be written: the successor re-submits that file (a
    batch job's ``$0`` is Slurm's spooled copy, not the original).
    """
    if s.schedule is None:
        raise ValueError("launcher.schedule=None is invalid for a scheduled job: allowed are "
                         + _SCHEDULES)
    out = f"{Path(log_dir)}/%x_%j.out"
    name = f"{s.job_name}-scheduled"
    path = shlex.quote(str(Path(script_path).resolve()))
    stamp = "%Y-%m-%d" if s.schedule.startswith("daily") else "%Y-%m-%d-%H%M"
    lines = _header(s, name, out) + [
        "set -euo pipefail",
        f"# schedule: {s.schedule} (no scrontab on Debian 12: this job queues its successor)",
        f"next=$({_begin_shell(s.schedule)})",
        # A failed resubmission must not cost today's run: warn, and run the sweep anyway.
        f'if successor=$(sbatch --parsable --begin="$next" --dependency=singleton {path}); then',
        '  echo "spectune: queued the next run as job ${successor%%;*} to begin at $next"',
        "else",
        '  echo "spectune: could not queue the next run: the schedule stops after this one" >&2',
        "fi",
        f"export SPECTUNE_RUN_DATE=$(date +{stamp})",
    ] + _body(argv)[1:]
    return "\n".join(lines) + "\n"


def next_begin(schedule: str, now: datetime | None = None) -> str:
    """The ``sbatch --begin`` value of the next run after ``now`` (ISO time, or now+N as is)."""
    now = now or datetime.now()
    if schedule == "hourly":
        return (now + timedelta(hours=1)).strftime("%Y-%m-%dT%H:00:00")
    if schedule == "daily":
        return (now + timedelta(days=1)).strftime("%Y-%m-%dT00:00:00")
    at = _DAILY_AT.match(schedule)
    if at:   # the next HH:MM strictly after now: today's, or else tomorrow's
        slot = now.replace(hour=int(at[1]), minute=int(at[2]), second=0, microsecond=0)
        return (slot if slot > now else slot + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S")
    if _RELATIVE.match(schedule):
        return schedule
    raise ValueError(f"launcher.schedule={schedule!r} is invalid: allowed are {_SCHEDULES}")


def _begin_shell(schedule: str) -> str:
    """A shell expression (GNU date) printing ``next_begin(schedule)`` at the job's run time."""
    next_begin(schedule)   # validates
    if schedule == "hourly":
        return "date -d '+1 hour' +%Y-%m-%dT%H:00:00"
    if schedule == "daily":
        return "date -d tomorrow +%Y-%m-%dT00:00:00"
    at = _DAILY_AT.match(schedule)
    if at:
        hm, fmt = f"{at[1]}:{at[2]}", "+%Y-%m-%dT%H:%M:%S"
        return (f"s=$(date -d 'today {hm}' +%s); if [ \"$s\" -gt \"$(date +%s)\" ]; "
                f"then date -d @$s {fmt}; else date -d 'tomorrow {hm}' {fmt}; fi")
    return f"echo {schedule}"


# ---------------------------------------------------------------- submitting

def _run(cmd: Sequence[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(cmd), input=stdin, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as e:
        raise SlurmError(f"slurm: {cmd[0]} not found: is Slurm installed (scripts/services.sh)?") \
            from e
    except subprocess.TimeoutExpired as e:
        raise SlurmError(f"slurm: {shlex.join(cmd)} timed out after 60 s") from e


def submit(script_path: str | Path, dependency: str | None = None, begin: str | None = None,
           test_only: bool = False) -> str:
    """``sbatch --parsable`` the script; returns the job id (``test_only``: sbatch's message).

    ``dependency`` is a job id (meaning ``afterany:<id>``) or a full spec such as ``afterok:12``.
    """
    cmd = ["sbatch", "--parsable"]
    if dependency:
        dep = f"afterany:{dependency}" if re.fullmatch(r"[\d_:]+", dependency) else dependency
        cmd.append(f"--dependency={dep}")
    if begin:
        cmd.append(f"--begin={begin}")
    if test_only:
        cmd.append("--test-only")
    cmd.append(str(script_path))
    done = _run(cmd)
    if done.returncode != 0:
        raise SlurmError(f"slurm: {shlex.join(cmd)} failed: {done.stderr.strip()}")
    if test_only:
        return done.stderr.strip()
    return done.stdout.strip().split(";")[0]


def validate(script: str | Path) -> str:
    """``sbatch --test-only`` a script (a ``Path``, or the script text as ``str``).

    Returns Slurm's estimate ("Job N to start at ..."); raises SlurmError when it is rejected.
    """
    if isinstance(script, Path):
        return submit(script, test_only=True)
    done = _run(["sbatch", "--test-only"], stdin=script)
    if done.returncode != 0:
        raise SlurmError(f"slurm: sbatch --test-only rejected the script: {done.stderr.strip()}")
    return done.stderr.strip()


@dataclass(frozen=True)
class SweepJobs:
    """What ``launch_sweep`` submitted: job ids and the scripts written next to the study."""

    prepare: str
    workers: str                          # the array's job id; tasks are <workers>_<i>
    finish: str
    scripts: dict[str, Path] = field(default_factory=dict)


def write_sweep(s: SlurmSettings, study_dir: str | Path, prepare: Sequence[str],
                work: Sequence[str], finish: Sequence[str]) -> dict[str, Path]:
    """Write prepare.sbatch and work.sbatch (finish is written at submit time: it needs the
    array's job id)."""
    out = _out_dir(s, study_dir)
    paths = {"prepare": out / "prepare.sbatch", "work": out / "work.sbatch"}
    paths["prepare"].write_text(render_prepare(s, prepare, out))
    paths["work"].write_text(render_workers(s, work, out))
    return paths


def launch_sweep(s: SlurmSettings, study_dir: str | Path, prepare: Sequence[str],
                 work: Sequence[str], finish: Sequence[str]) -> SweepJobs:
    """Submit prepare, the worker array (afterok:prepare) and finish (afterany:array)."""
    paths = write_sweep(s, study_dir, prepare, work, finish)
    prep = submit(paths["prepare"])
    array = submit(paths["work"], dependency=f"afterok:{prep}")
    out = _out_dir(s, study_dir)
    paths["finish"] = out / "finish.sbatch"
    paths["finish"].write_text(render_finish(s, finish, out, after=array))
    fin = submit(paths["finish"])
    return SweepJobs(prep, array, fin, paths)


def schedule_sweep(s: SlurmSettings, study_dir: str | Path, argv: Sequence[str],
                   begin: str | None = None) -> tuple[str, Path]:
    """Write scheduled.sbatch and submit its first run at ``begin`` (default: the next slot)."""
    out = _out_dir(s, study_dir)
    path = out / "scheduled.sbatch"
    path.write_text(render_scheduled(s, argv, out, path))
    first = begin or next_begin(s.schedule or "")
    return submit(path, begin=first), path


def _out_dir(s: SlurmSettings, study_dir: str | Path) -> Path:
    out = Path(s.output_dir)
    out = (out if out.is_absolute() else Path(study_dir) / out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out


# ---------------------------------------------------------------- liveness

def job_state(job_id: str) -> str | None:
    """The state of a job or array task (``1234`` / ``1234_2``), or None when Slurm forgot it.

    An array parent with several tasks reports the most alive one (RUNNING before PENDING ...).
    """
    done = _run(["squeue", "-h", "-j", str(job_id), "-o", "%T"])
    if done.returncode == 0 and done.stdout.strip():
        states = done.stdout.split()
        alive = [st for st in states if st in ALIVE_STATES]
        return "RUNNING" if "RUNNING" in alive else (alive or states)[0]
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        raise SlurmError(f"slurm: squeue -j {job_id} failed: {done.stderr.strip()}")
    # Gone from the queue: scontrol still knows finished jobs for MinJobAge seconds.
    shown = _run(["scontrol", "show", "job", str(job_id)])
    if shown.returncode != 0:
        if "Invalid job id" in shown.stderr:
            return None
        raise SlurmError(f"slurm: scontrol show job {job_id} failed: {shown.stderr.strip()}")
    found = re.search(r"JobState=(\S+)", shown.stdout)
    return found[1] if found else None


def job_alive(job_id: str) -> bool:
    """True while the job is pending or running; raises SlurmError if Slurm does not answer."""
    return job_state(job_id) in ALIVE_STATES


def job_alive_or_none(job_id: str) -> bool | None:
    """``job_alive``, or None (logged) when Slurm does not answer: the check the study's reaper is
    given (``tuner.study.liveness.JobAlive``), which must never take "no answer" for "dead"."""
    try:
        return job_alive(job_id)
    except SlurmError as e:
        log.warning("cannot tell whether Slurm job %s is alive: %s", job_id, e)
        return None
