"""The engine tests' process check (tests/helpers/services.py) sees exactly the processes a
study's servers started, children included, and only those: a server's child left behind after
its parent died is found (the leak the engine tests guard against), another process on the
machine is not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.helpers.services import alive, all_gone, server_groups

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
