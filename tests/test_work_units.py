"""The parallel pass's work units hold under the installed pytest and pytest-xdist: a small
pytest session of its own, on two workers with the Makefile's flags and the rule of
tests/helpers/work_units.py, builds a module-scoped fixture once (its users stay on one worker)
while the other worker runs other tests. With pytest 9.2 and pytest-xdist 3.8 the group is
silently ignored (pytest-dev/pytest-xdist#1386) and the fixture is built on both."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections import Counter

from tests.conftest import ENV, ROOT

CONFTEST = '''
import pytest
from tests.helpers.work_units import group_by_shared_fixtures

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group_by_shared_fixtures(item)
'''
SHARED = '''
import os
import pytest

def note(what):
    with open(os.environ["UNITS_LOG"], "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {what}\\n")

@pytest.fixture(scope="module")
def shared():
    note("setup")

@pytest.mark.parametrize("k", range(12))
def test_uses_the_shared_fixture(shared, k):
    note("shared")

@pytest.mark.parametrize("k", range(24))
def test_alone(k):
    note("alone")
'''


def parallel_pass_flags() -> list[str]:
    """The Makefile's flags for the parallel pass, from ``-n`` up to its ``-m``."""
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines()
                if '-m "parallel' in ln)
    return shlex.split(re.search(r"-m pytest (-n .*?) -m \"parallel", line).group(1))


def test_a_module_fixture_is_built_once_and_the_other_worker_runs_other_tests(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_shared.py").write_text(SHARED)
    log = tmp_path / "units.log"
    flags = parallel_pass_flags()
    assert flags[:2] == ["-n", "2"] and "loadgroup" in flags
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *flags, "--rootdir", str(tmp_path), "--basetemp",
                           str(tmp_path / "inner"), str(tmp_path / "test_shared.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**ENV, "UNITS_LOG": str(log), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = Counter(tuple(line.split()) for line in log.read_text().splitlines())
    setups = {worker for (worker, what) in runs if what == "setup"}
    assert sum(n for (_, what), n in runs.items() if what == "setup") == 1, runs
    assert {w for (w, what) in runs if what == "shared"} == setups          # on that worker
    assert {w for (w, what) in runs if what == "alone"} - setups, runs      # the other works
