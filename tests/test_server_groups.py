"""The engine tests' process check (tests/helpers/services.py) sees exactly the processes a
study's servers started, children included, and only those: a server's child left behind after
its parent died is found (the leak the engine tests guard against), another process on the
machine is not. Their concurrency check reads a llama-server log's slot lines on the server's own
clock: four requests served side by side are 4 in flight, the same four served one after another
(a one-slot server) are 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers.services import alive, all_gone, server_groups, slot_timeline

PARENT = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
          "'import time; time.sleep(60)']); print('child started', flush=True); time.sleep(60)")


def test_a_servers_orphaned_child_is_found_and_other_processes_are_not(tmp_path):
    server = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True,
                              stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert server.stdout.readline().strip() == "child started"
        (tmp_path / "engine").mkdir()
        (tmp_path / "engine" / "method.log").write_text(
            f"$ python -c ...\n# pid {server.pid} (process group {server.pid})\nserver output\n")
        groups = server_groups(tmp_path)
        assert groups == [server.pid]
        assert len(alive(groups)) == 2 and other.pid not in alive(groups)
        server.kill()                                  # the parent dies, its child stays
        server.wait()
        left = alive(groups)
        assert len(left) == 1 and left[0] != server.pid
        assert all_gone(groups, timeout_s=0.5) == left
        os.killpg(server.pid, signal.SIGKILL)
        assert all_gone(groups) == []
    finally:
        for proc in (server, other):
            proc.kill()
        other.wait()
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# llama-server's own lines (the cached build, -np 4, four requests sent at once), cut down
FOUR_SLOTS = """\
$ llama-server -m model.gguf --host 127.0.0.1 --port 40123 -np 4 -c 8192
# pid 4242 (process group 4242)
0.00.526.987 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 2048
0.00.699.554 I slot get_availabl: id  3 | task -1 | selected slot by LRU, t_last = -1
0.00.699.598 I slot launch_slot_: id  3 | task 0 | processing task, is_child = 0
0.00.908.887 I slot launch_slot_: id  2 | task 2 | processing task, is_child = 0
0.00.908.986 I slot launch_slot_: id  1 | task 3 | processing task, is_child = 0
0.00.909.046 I slot launch_slot_: id  0 | task 4 | processing task, is_child = 0
0.03.036.830 I slot print_timing: id  3 | task 0 |       total time =    2337.12 ms /    28 tokens
0.03.036.928 I slot      release: id  3 | task 0 | stop processing: n_tokens = 27, truncated = 0
0.03.063.454 I slot      release: id  0 | task 4 | stop processing: n_tokens = 27, truncated = 0
0.03.063.565 I slot      release: id  1 | task 3 | stop processing: n_tokens = 27, truncated = 0
0.03.063.676 I slot      release: id  2 | task 2 | stop processing: n_tokens = 27, truncated = 0
"""
# the same four requests at -np 1: each waits for the one before (task 3 starts the instant task
# 2 is released: touching, not overlapping); the clock passes a minute
ONE_SLOT = """\
$ llama-server -m model.gguf --host 127.0.0.1 --port 40124 -np 4 -c 8192 -np 1
0.00.526.987 I srv    load_model: initializing, n_slots = 1, n_ctx_slot = 8192
0.59.000.000 I slot launch_slot_: id  0 | task 0 | processing task, is_child = 0
0.59.700.000 I slot      release: id  0 | task 0 | stop processing: n_tokens = 27, truncated = 0
0.59.700.100 I slot launch_slot_: id  0 | task 2 | processing task, is_child = 0
1.00.400.000 I slot      release: id  0 | task 2 | stop processing: n_tokens = 27, truncated = 0
1.00.400.000 I slot launch_slot_: id  0 | task 3 | processing task, is_child = 0
1.01.100.000 I slot      release: id  0 | task 3 | stop processing: n_tokens = 27, truncated = 0
1.01.100.050 I slot launch_slot_: id  0 | task 4 | processing task, is_child = 0
1.01.800.000 I slot      release: id  0 | task 4 | stop processing: n_tokens = 27, truncated = 0
"""


def test_four_slots_serving_at_once_are_four_in_flight_on_the_servers_clock():
    timeline = slot_timeline(FOUR_SLOTS)
    assert timeline.tasks == {0: (0.699598, 3.036928), 2: (0.908887, 3.063676),
                              3: (0.908986, 3.063565), 4: (0.909046, 3.063454)}
    assert timeline.most_in_flight == 4


def test_one_slot_serving_the_same_four_in_turn_is_one_in_flight():
    timeline = slot_timeline(ONE_SLOT)
    assert sorted(timeline.tasks) == [0, 2, 3, 4]
    assert timeline.tasks[3] == (60.4, 61.1)                     # minutes.seconds.ms.us
    assert timeline.most_in_flight == 1


def test_only_the_last_server_started_with_a_log_counts():
    """A restarted server appends to the same log, with a new clock and new task ids."""
    assert slot_timeline(FOUR_SLOTS + ONE_SLOT).most_in_flight == 1
    assert slot_timeline(ONE_SLOT + FOUR_SLOTS).most_in_flight == 4
    assert slot_timeline(FOUR_SLOTS + "$ llama-server -np 4\n").tasks == {}
    assert slot_timeline(FOUR_SLOTS + "$ llama-server -np 4\n").most_in_flight == 0


def test_an_unreleased_task_is_in_flight_to_the_logs_end_and_untimed_lines_are_refused():
    cut = FOUR_SLOTS.split("0.03.063.454")[0]           # three tasks not yet released
    timeline = slot_timeline(cut)
    assert timeline.tasks[4] == (0.909046, 3.036928) and timeline.most_in_flight == 4
    untimed = "srv  load_model: ok\nslot launch_slot_: id  0 | task 0 | processing task\n"
    with pytest.raises(ValueError, match="--log-timestamps"):
        slot_timeline(untimed)
