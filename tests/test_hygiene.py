"""Thread count and contention detection with real processes, and the sampler's arithmetic with
scripted /proc readings.

The machine these run on is shared (2 cores, other test suites running): a real-timing test
asserts only what holds whatever else runs (a spinner's own CPU share, read from its
/proc/<pid>/stat, is in the sampled "other" load); what needs a quiet machine to be seen in real
time (a spinner's end lowering the reading) is checked exactly with scripted readings instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.conftest import ROOT
from tuner.measure.hygiene import (
    CONTENTION_MODES,
    ContentionGuard,
    LoadSample,
    MachineBusy,
    Quiet,
    allowed_cpus,
    check_contention_mode,
    check_threads,
    configure_threads,
    sample_other_load,
)

CPUS = allowed_cpus()
N = len(CPUS)
ONE_SPINNER = 1 / N     # one process spinning on an allowance of N CPUs: 0.5 of 2 CPUs
SPIN_S = 20             # the spinner exits by itself after this, even if the test is killed

needs_proc = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")


def run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (no conftest thread setting) and parse its JSON line."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


THREADS_CODE = """
import json, os, torch
from tuner.measure.hygiene import allowed_cpus, configure_threads
mask = {mask}
if mask is not None:
    os.sched_setaffinity(0, set(mask))
n = configure_threads({requested!r})
print(json.dumps({{"n": n, "torch": torch.get_num_threads(), "allowed": list(allowed_cpus())}}))
"""


@pytest.mark.skipif(N < 2, reason="a mask narrower than the allowance needs 2+ CPUs")
def test_threads_follow_a_narrowed_affinity_mask():
    got = run_python(THREADS_CODE.format(mask=[CPUS[-1]], requested=None))
    assert got == {"n": 1, "torch": 1, "allowed": [CPUS[-1]]}


@pytest.mark.parametrize("requested", [None, "auto"])
def test_threads_default_to_one_per_allowed_cpu(requested):
    got = run_python(THREADS_CODE.format(mask=list(CPUS), requested=requested))
    assert got == {"n": N, "torch": N, "allowed": list(CPUS)}


def test_explicit_thread_count_is_applied():
    got = run_python(THREADS_CODE.format(mask=None, requested=N + 1))
    assert got["n"] == got["torch"] == N + 1


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", "many", True, [2]])
def test_bad_threads_name_the_value_and_what_is_allowed(bad):
    for validate in (check_threads, configure_threads):
        with pytest.raises(ValueError) as err:
            validate(bad)
        assert f"threads={bad!r}" in str(err.value)
        assert "'auto'" in str(err.value) and "integer >= 1" in str(err.value)


def test_good_threads_pass_validation():
    assert check_threads(None) is None and check_threads("auto") is None
    assert check_threads(3) == 3


@pytest.mark.parametrize("bad", ["Wait", "ignore", "", None, 1])
def test_bad_contention_names_the_value_and_the_modes(bad):
    with pytest.raises(ValueError) as err:
        check_contention_mode(bad)
    assert f"contention={bad!r}" in str(err.value)
    assert all(mode in str(err.value) for mode in CONTENTION_MODES)
    with pytest.raises(ValueError, match="contention="):
        ContentionGuard(mode=bad)


def test_good_contention_modes_pass_and_guard_bounds_are_checked():
    assert [check_contention_mode(m) for m in CONTENTION_MODES] == list(CONTENTION_MODES)
    for bad in ({"threshold": 0}, {"threshold": 1.5}, {"max_wait_s": -1}, {"window_s": 0}):
        with pytest.raises(ValueError):
            ContentionGuard(**bad)


def start_spinner() -> subprocess.Popen:
    """A CPU-bound process pinned to our allowed CPUs, returned once it says it spins (no sleep
    for its start-up); exits by itself after SPIN_S."""
    code = (f"import time\nend = time.monotonic() + {SPIN_S}\nprint('spinning', flush=True)\n"
            "while time.monotonic() < end: pass")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    os.sched_setaffinity(proc.pid, set(CPUS))
    assert proc.stdout.readline() == "spinning\n"
    return proc


def process_ticks(pid: int) -> int:
    """utime + stime of one process so far, in clock ticks (/proc/<pid>/stat fields 14, 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=5)
    if proc.stdout:
        proc.stdout.close()


@needs_proc
def test_a_spinning_process_is_seen():
    """Real timing, on purpose, and tolerant of whatever else runs: while a spinner runs, the
    sampled other load holds at least the CPU share the spinner itself used inside the window.
    Its ticks are read around the window, so the time between those reads and the window's own
    ends (this process preempted on a busy machine) may add the spinner's ticks of that time, and
    /proc/stat counts whole ticks: both are allowed for. A sampler blind to other processes
    (reading 0, or only this process's work) fails. The reading's drop at the spinner's end is
    checked exactly on scripted readings below (on a busy machine others take the freed core)."""
    tick = os.sysconf("SC_CLK_TCK")
    proc = start_spinner()
    try:
        began, before = time.monotonic(), process_ticks(proc.pid)
        sample = sample_other_load(CPUS, 0.4)
        after, ended = process_ticks(proc.pid), time.monotonic()
    finally:
        stop(proc)
    capacity = sample.window_s * tick * N                 # ticks of the allowed CPUs
    outside = (ended - began - sample.window_s) * tick + 2.5   # the spinner's ticks not inside
    spinner = (after - before) / capacity
    print(f"other_busy {sample.other_busy:.3f}, the spinner's own share {spinner:.3f}, "
          f"slack {outside:.1f} ticks")
    assert after - before >= 0.05 * (ended - began) * tick     # it ran, however loaded
    assert sample.other_busy >= (after - before - outside) / capacity


def test_other_load_is_the_cpus_busy_ticks_minus_this_process_s_own(monkeypatch):
    """The sampler's arithmetic on scripted readings (/proc/stat's busy and total ticks of the
    allowed CPUs, this process's CPU seconds, no real waiting): a spinner's ticks are other load,
    this process's own are not, and once the spinner has ended (the second pair of readings holds
    only this process's ticks) the reading is exactly 0."""
    import tuner.measure.hygiene as hygiene
    tick = os.sysconf("SC_CLK_TCK")
    window = 0.4                                         # 0.4 s on 2 CPUs: 0.8 s of capacity
    capacity = round(window * tick * 2)
    spinner, own = capacity // 2, capacity // 8          # a whole core; a quarter of a core
    readings = iter([(1000, 4000), (1000 + spinner + own, 4000 + capacity),     # spinner runs
                     (5000, 9000), (5000 + own, 9000 + capacity)])              # it has ended
    own_s = iter([1.0, 1.0 + own / tick, 2.0, 2.0 + own / tick])
    monkeypatch.setattr(hygiene, "_cpu_ticks", lambda cpus: next(readings))
    monkeypatch.setattr(hygiene, "_own_cpu_s", lambda: next(own_s))
    monkeypatch.setattr(hygiene.time, "sleep", lambda seconds: None)
    running = sample_other_load((0, 1), window)
    ended = sample_other_load((0, 1), window)
    assert running.other_busy == pytest.approx(0.5) and running.own_busy == pytest.approx(0.125)
    assert ended.other_busy == pytest.approx(0.0) and ended.own_busy == pytest.approx(0.125)


class Scripted:
    """A load reader and clock for the guard's policy: the loads it returns, one per sample,
    and time that moves by each sample's window (no real waiting, no machine load)."""

    def __init__(self, loads):
        self.loads, self.now, self.windows = list(loads), 100.0, []

    def sample(self, cpus, window_s):
        self.windows.append(window_s)
        self.now += window_s
        return LoadSample(self.loads.pop(0), 0.0, window_s, tuple(cpus))

    def clock(self):
        return self.now


def scripted_guard(mode, loads, **kw):
    script = Scripted(loads)
    guard = ContentionGuard(mode, 0.3, cpus=(0, 1), sampler=script.sample, clock=script.clock,
                            **kw)
    return guard, script


def test_wait_resamples_until_quiet_and_counts_the_time_it_waited():
    guard, script = scripted_guard("wait", [0.9, 0.8, 0.1, 0.9], max_wait_s=10, window_s=0.5)
    assert guard.check() == Quiet(False, 0.1, 1.0, 3)        # two re-samples of 0.5 s each
    assert script.windows == [0.5, 0.5, 0.5]


def test_wait_gives_up_after_max_wait_with_a_shorter_last_window_and_flags_it():
    guard, script = scripted_guard("wait", [0.9] * 10, max_wait_s=1.2, window_s=0.5)
    quiet = guard.check()
    assert quiet.contended and quiet.samples == 4 and quiet.waited_s == pytest.approx(1.2)
    assert script.windows == pytest.approx([0.5, 0.5, 0.5, 0.2])   # the bound, not more


def test_warn_and_fail_sample_once():
    warned, script = scripted_guard("warn", [0.9, 0.1])
    assert warned.check() == Quiet(True, 0.9, 0.0, 1) and len(script.windows) == 1
    failing, _ = scripted_guard("fail", [0.9])
    with pytest.raises(MachineBusy, match="other processes used 90% of CPUs"):
        failing.check()
    quiet, _ = scripted_guard("fail", [0.2])
    assert quiet.check() == Quiet(False, 0.2, 0.0, 1)


@needs_proc
def test_guard_modes_under_a_spinner():
    """Real timing, on purpose (the one test of the guard against a real busy process): its time
    bounds are wide, since a loaded machine stretches every window; the policy's exact counts
    are the scripted tests above."""
    threshold = 0.5 * ONE_SPINNER       # well under one spinner's share (0.25 of 2 CPUs)
    proc = start_spinner()
    try:
        warned = ContentionGuard("warn", threshold, window_s=0.3, cpus=CPUS).check()
        with pytest.raises(MachineBusy) as err:
            ContentionGuard("fail", threshold, window_s=0.3, cpus=CPUS).check()
        began = time.monotonic()
        waited = ContentionGuard("wait", threshold, max_wait_s=1.0, window_s=0.25,
                                 cpus=CPUS).check()
        took = time.monotonic() - began
    finally:
        stop(proc)
    print(f"warn {warned}, wait {waited} in {took:.2f} s, fail: {err.value}")
    assert warned.contended and warned.other_busy > threshold
    assert warned.samples == 1 and warned.waited_s == 0
    message = str(err.value)
    assert str(list(CPUS)) in message and f"{threshold:.0%}" in message
    assert "contention=warn" in message and "%" in message.split("used")[1]
    assert waited.contended and waited.other_busy > threshold
    assert 0.9 <= waited.waited_s <= 5.0 and waited.samples >= 2
    assert waited.waited_s < took <= 10.0       # first sample + the 1 s bound, stretched


@needs_proc
def test_wait_returns_at_once_when_quiet():
    # threshold 1.0: never busy, so no re-sampling however loaded the shared machine is
    quiet = ContentionGuard("wait", 1.0, max_wait_s=30, window_s=0.1, cpus=CPUS).check()
    assert quiet == Quiet(False, quiet.other_busy, 0.0, 1) and quiet.other_busy is not None


def spin_python(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


def spin_torch(stop_at: float) -> None:
    a = torch.randn(256, 256)
    while time.monotonic() < stop_at:
        a = torch.tanh(a @ a)


@needs_proc
@pytest.mark.parametrize("work", [spin_python, spin_torch])
def test_own_work_is_not_other_load(work):
    before = sample_other_load(CPUS, 0.3)
    started = threading.Event()
    stop_at = time.monotonic() + 0.9
    worker = threading.Thread(target=lambda: (started.set(), work(stop_at)))
    worker.start()
    try:
        assert started.wait(10)                  # the thread runs: sample its work, no sleep
        busy = sample_other_load(CPUS, 0.5)
    finally:
        worker.join(timeout=10)
    after = sample_other_load(CPUS, 0.3)
    background = max(before.other_busy, after.other_busy)     # other people's load, if any
    print(f"{work.__name__}: own {busy.own_busy:.3f}, other {busy.other_busy:.3f} "
          f"(background {before.other_busy:.3f} / {after.other_busy:.3f})")
    # Our thread(s) kept a good part of a core busy; had that been counted as other load,
    # other_busy would sit own_busy above the background instead of at it.
    assert busy.own_busy >= 0.3 * ONE_SPINNER
    assert busy.other_busy <= background + 0.5 * busy.own_busy
    assert busy.other_busy + busy.own_busy <= 1.0 + 1e-9


@needs_proc
def test_sample_record():
    sample = sample_other_load(CPUS, 0.1)
    assert isinstance(sample, LoadSample) and sample.known and sample.cpus == CPUS
    assert 0.09 <= sample.window_s <= 1.0 and 0 <= sample.other_busy <= 1
    with pytest.raises(ValueError, match="window_s=0"):
        sample_other_load(CPUS, 0)


def test_no_proc_stat_reads_unknown_and_never_waits_or_fails(monkeypatch):
    # Stands in for macOS: the path is made absent, the code under test is unchanged.
    import tuner.measure.hygiene as hygiene
    monkeypatch.setattr(hygiene, "PROC_STAT", "/nonexistent/stat")
    slept: list[float] = []
    monkeypatch.setattr(hygiene.time, "sleep", slept.append)   # recorded, not timed
    sample = sample_other_load(CPUS, 5.0)
    assert sample == LoadSample(None, None, 0.0, CPUS) and not sample.known
    for mode in CONTENTION_MODES:
        assert ContentionGuard(mode, 0.01, window_s=5.0).check() == Quiet(False, None, 0.0, 1)
    assert slept == []                           # no window was waited
