"""Honest timing on shared machines: the thread count and other processes' load on our CPUs.

Two things make wall-clock speedups noise on a shared machine: more intra-op threads than the CPUs
this process may use (torch defaults to the machine's core count, not a Slurm/cgroup cpuset's),
and other processes busy on those CPUs while a prompt pair is timed.

  * ``allowed_cpus`` / ``configure_threads``: one intra-op thread per allowed CPU unless told
    otherwise; the count is returned so the tuner can record it.
  * ``sample_other_load``: over a short window, the busy time of the allowed CPUs
    (``/proc/stat``) minus this process's own CPU time (``getrusage``, all its threads), as a
    fraction of the allowance: one other busy process on a 2-CPU allowance reads ≈ 0.5. Child
    processes count as *other* load: they compete for the same CPUs. ``LoadMeter``: the same
    reading over a block of this process's own work (a profile's timed runs), without sleeping.
  * ``ContentionGuard``: the ``contention=wait|warn|fail`` policy asked before each measured
    prompt pair; it returns a ``Quiet`` record to store with the pair.

Without ``/proc/stat`` (macOS) the load is unknown (``other_busy=None``): nothing waits or fails.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CONTENTION_MODES = ("wait", "warn", "fail")
DEFAULT_CONTENTION = "wait"     # re-sample until quiet (bounded), then measure anyway, flagged
DEFAULT_THRESHOLD = 0.25        # other processes' share of the allowance above which it is busy:
                                # half a core of 2, a full core of 4; below it timings move ~<10 %
DEFAULT_MAX_WAIT_S = 120.0      # longest re-sampling before measuring anyway (per prompt pair)
DEFAULT_WINDOW_S = 0.3          # one sample: 30 ticks of /proc/stat per CPU at USER_HZ=100
MIN_WINDOW_S = 0.05             # shortest sample worth taking (5 ticks per CPU)
PROC_STAT = "/proc/stat"

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)   # user nice system irq softirq steal (guest is inside user)
_IDLE_FIELDS = (3, 4)               # idle iowait


class MachineBusy(RuntimeError):
    """Other processes use the CPUs given to the tuner (``contention=fail``)."""


@dataclass(frozen=True)
class LoadSample:
    """CPU use of the allowed CPUs over one window, as fractions of their capacity.

    ``other_busy`` 1.0 means every allowed CPU was busy with other processes the whole window.
    ``None`` means unknown (no ``/proc/stat``).
    """

    other_busy: float | None    # other processes' share of the allowance, in [0, 1]
    own_busy: float | None      # this process's share (all its threads), in [0, 1]
    window_s: float             # wall time the sample covered
    cpus: tuple[int, ...]       # the CPUs sampled

    @property
    def known(self) -> bool:
        return self.other_busy is not None


@dataclass(frozen=True)
class Quiet:
    """The contention check before one measured prompt pair (stored with the pair)."""

    contended: bool             # others' load was above the threshold when measuring began
    other_busy: float | None    # the last sample's ``other_busy`` (None: unknown)
    waited_s: float             # re-sampling time spent waiting for quiet (0 if quiet at once)
    samples: int                # samples taken


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (respects taskset, Slurm and cgroup cpusets)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):     # macOS, Windows
        return tuple(range(os.cpu_count() or 1))


def check_threads(value: object, cpus: Sequence[int] | None = None) -> int | None:
    """Validate a ``threads=`` setting without loading anything.

    Args:
        value: the setting.
        cpus: the CPUs the study will run on (``allowed_cpus()`` where it runs); more threads
            than these is refused (they would only contend: timings meaningless, and some
            libraries refuse to start). None: no upper bound (checked where it runs).

    Returns:
        The thread count, or None for one per allowed CPU (``None`` / ``"auto"``).

    Raises:
        ValueError: naming ``threads=<value>`` and what is allowed.
    """
    if value is None or value == "auto":
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        if cpus is not None and value > len(cpus):
            raise ValueError(f"threads={value} is more than the {len(cpus)} CPU(s) this process "
                             f"may use (its affinity mask: {_cpu_list(cpus)}): allowed is 'auto' "
                             f"or an integer from 1 to {len(cpus)}")
        return value
    raise ValueError(f"threads={value!r}: expected 'auto' (one per allowed CPU) or an "
                     f"integer >= 1")


def _cpu_list(cpus: Sequence[int]) -> str:
    """0-3,8 style."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def thread_count(requested: int | str | None) -> int:
    """The thread count ``requested`` gives (``None`` / ``"auto"``: one per allowed CPU);
    ValueError for a bad value (``check_threads``)."""
    return check_threads(requested) or len(allowed_cpus())


def configure_threads(requested: int | str | None) -> int:
    """Set torch's intra-op thread count and return it.

    Args:
        requested: ``None`` / ``"auto"``: one thread per allowed CPU; an int >= 1: that many.

    Raises:
        ValueError: a bad value (see ``check_threads``).
    """
    n = thread_count(requested)
    import torch  # here, so that validation needs no torch
    torch.set_num_threads(n)
    return n


def check_contention_mode(value: object) -> str:
    """Validate a ``contention=`` setting; returns it.

    Raises:
        ValueError: naming ``contention=<value>`` and the allowed modes.
    """
    if value in CONTENTION_MODES:
        return str(value)
    raise ValueError(f"contention={value!r}: expected one of {', '.join(CONTENTION_MODES)}")


def _cpu_ticks(cpus: Sequence[int]) -> tuple[int, int] | None:
    """(busy, total) clock ticks of ``cpus`` since boot from /proc/stat; None if unreadable."""
    try:
        with open(PROC_STAT) as f:
            lines = f.readlines()
    except OSError:
        return None
    wanted = {f"cpu{c}" for c in cpus}
    busy = total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in wanted:
            ticks = [int(x) for x in rest.split()]
            busy += sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks))
            total += sum(ticks[i] for i in _BUSY_FIELDS + _IDLE_FIELDS if i < len(ticks))
    return (busy, total) if total else None


def _own_cpu_s() -> float:
    """CPU seconds used by this process so far (all threads, not children)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def group_cpu_s(groups: Collection[int]) -> float:
    """CPU seconds used so far by every process in the process groups ``groups`` (an engine's
    servers: each runs in a session of its own, its workers in its group), children they
    reaped included; 0.0 without /proc."""
    total = 0
    wanted = set(groups)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:                     # exited while we looked
            continue
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[2]) in wanted:        # pgrp; utime stime cutime cstime: fields 11-14
            total += sum(int(x) for x in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def sample_other_load(cpus: Sequence[int] | None = None,
                      window_s: float = DEFAULT_WINDOW_S) -> LoadSample:
    """Measure other processes' load on ``cpus`` over ``window_s`` seconds (this call sleeps).

    Args:
        cpus: CPU ids to watch; None: ``allowed_cpus()``.
        window_s: the sampling window, > 0.

    Returns:
        A ``LoadSample``; ``other_busy`` None when ``/proc/stat`` is unavailable (no waiting then).
    """
    if not window_s > 0:
        raise ValueError(f"window_s={window_s!r}: expected a positive number of seconds")
    with LoadMeter(cpus) as meter:
        if not meter.readable:               # no /proc/stat: unknown, and nothing to wait for
            return LoadSample(None, None, 0.0, meter.cpus)
        time.sleep(window_s)
    return meter.sample


class LoadMeter:
    """Other processes' load on ``cpus`` while a block of this process's own work ran, without
    sleeping: ``with LoadMeter() as meter: work()``, then ``meter.sample`` (a ``LoadSample``
    over the block's wall time; the same arithmetic as ``sample_other_load``). A profile's
    timed runs are checked with it: the machine's load during the run, not before it."""

    def __init__(self, cpus: Sequence[int] | None = None, groups: Collection[int] = ()) -> None:
        """``groups``: process groups whose CPU counts as this work's own besides this
        process's (an engine profile's servers, ``group_cpu_s``)."""
        self.cpus = tuple(cpus) if cpus is not None else allowed_cpus()
        self.groups = tuple(groups)
        self.sample = LoadSample(None, None, 0.0, self.cpus)

    def own(self) -> float:
        """CPU seconds this work has used so far: this process's and its groups'."""
        return _own_cpu_s() + (group_cpu_s(self.groups) if self.groups else 0.0)

    def __enter__(self) -> LoadMeter:
        self._before = _cpu_ticks(self.cpus)
        self._own_before, self._began = self.own(), time.monotonic()
        return self

    @property
    def readable(self) -> bool:
        """Whether the CPUs' ticks could be read when the block began."""
        return self._before is not None

    def __exit__(self, *exc: object) -> None:
        self.sample = self.peek()

    def peek(self) -> LoadSample:
        """The sample from the block's start until now (the block goes on)."""
        after, own_after, ended = _cpu_ticks(self.cpus), self.own(), time.monotonic()
        before = self._before
        if before is None or after is None or after[1] <= before[1]:
            return LoadSample(None, None, ended - self._began, self.cpus)
        tick = os.sysconf("SC_CLK_TCK")
        capacity = after[1] - before[1]                     # ticks the CPUs existed (all states)
        busy = after[0] - before[0]
        own = (own_after - self._own_before) * tick
        return LoadSample(_fraction(busy - own, capacity), _fraction(own, capacity),
                          ended - self._began, self.cpus)


def _fraction(part: float, whole: float) -> float:
    """part / whole clipped to [0, 1] (tick-sampled /proc/stat vs exact getrusage overshoot)."""
    return min(1.0, max(0.0, part / whole))


@dataclass(frozen=True)
class ContentionGuard:
    """The ``contention=`` policy, applied before each measured prompt pair.

    ``wait``: re-sample until others' load is under ``threshold`` or ``max_wait_s`` of re-sampling
    has passed, then measure anyway (flagged contended if still busy). ``warn``: sample once and
    report. ``fail``: sample once and raise ``MachineBusy`` if busy. The sampling windows are the
    wait, so the number of samples is bounded by ``max_wait_s / MIN_WINDOW_S + 1``.
    """

    mode: str = DEFAULT_CONTENTION
    threshold: float = DEFAULT_THRESHOLD
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    window_s: float = DEFAULT_WINDOW_S
    cpus: tuple[int, ...] = field(default_factory=allowed_cpus)
    # how the load is read and time is told: the machine's by default; a test of the policy
    # (not of the timing) passes its own, so a loaded machine cannot change what it checks
    sampler: Callable[[Sequence[int], float], LoadSample] = field(default=sample_other_load,
                                                                   repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def __post_init__(self) -> None:
        check_contention_mode(self.mode)
        if not 0 < self.threshold <= 1:
            raise ValueError(f"contention threshold={self.threshold!r}: expected a fraction of "
                             f"the allowed CPUs in (0, 1]")
        if not self.max_wait_s >= 0:
            raise ValueError(f"contention max_wait_s={self.max_wait_s!r}: expected seconds >= 0")
        if not self.window_s >= MIN_WINDOW_S:
            raise ValueError(f"contention window_s={self.window_s!r}: expected seconds >= "
                             f"{MIN_WINDOW_S}")

    def busy(self, sample: LoadSample) -> bool:
        return sample.known and sample.other_busy > self.threshold

    def check(self) -> Quiet:
        """Sample (and in ``wait`` mode re-sample) others' load; see the class docstring.

        Raises:
            MachineBusy: ``fail`` mode and others' load above the threshold.
        """
        sample, samples = self.sampler(self.cpus, self.window_s), 1
        began = self.clock()
        deadline = began + self.max_wait_s
        while self.mode == "wait" and self.busy(sample):
            left = deadline - self.clock()
            if left < MIN_WINDOW_S:
                break
            sample, samples = self.sampler(self.cpus, min(self.window_s, left)), samples + 1
        waited = self.clock() - began if samples > 1 else 0.0
        if self.mode == "fail" and self.busy(sample):
            raise MachineBusy(self.describe(sample))
        return Quiet(self.busy(sample), sample.other_busy, waited, samples)

    def describe(self, sample: LoadSample) -> str:
        """One line: the measured load, the CPUs, the threshold and what to do."""
        return (f"machine busy: other processes used {sample.other_busy:.0%} of CPUs "
                f"{list(sample.cpus)} over {sample.window_s:.2f} s (threshold "
                f"{self.threshold:.0%}); stop them, give the tuner other CPUs (taskset -c, "
                f"Slurm --cpus-per-task / --exclusive), or set contention=wait or contention=warn")
