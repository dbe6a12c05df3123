"""The parallel pass's work units hold under the installed pytest and pytest-xdist: a small
pytest session of its own, on two workers with `make test`'s flags and the rule of
tests/helpers/work_units.py, builds a module-scoped fixture once (its users stay on one worker)
while the other tests spread over both workers. With pytest 9.2 and pytest-xdist 3.8 the group
is silently ignored (pytest-dev/pytest-xdist#1386) and the fixture is built on both."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

from tests.conftest import ENV, ROOT

CONFTEST = '''
import pytest
from tests.helpers.work_units import group_by_shared_fixtures, slow_units_first

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group_by_shared_fixtures(item)
    slow_units_first(items, ("test_slow",), "first")
'''
SHARED = '''
import os
import pytest

def note(log, what):
    with open(log, "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {what}\\n")

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    note(os.environ["UNITS_LOG"], "setup")

@pytest.mark.parametrize("k", range(12))
def test_uses_the_shared_fixture(shared, k):
    note(os.environ["UNITS_LOG"], "shared")

@pytest.mark.parametrize("k", range(24))
def test_alone(k):
    note(os.environ["UNITS_LOG"], "alone")
'''


def test_a_module_fixture_is_built_once_and_other_tests_spread_over_both_workers(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_shared.py").write_text(SHARED)
    log = tmp_path / "units.log"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder",
                           "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**ENV, "UNITS_LOG": str(log), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = Counter(tuple(line.split()) for line in log.read_text().splitlines())
    setups = {worker for (worker, what) in runs if what == "setup"}
    assert sum(n for (_, what), n in runs.items() if what == "setup") == 1, runs
    assert {w for (w, what) in runs if what == "shared"} == setups          # on that worker
    assert {w for (w, what) in runs if what == "alone"} == {"gw0", "gw1"}   # both work
