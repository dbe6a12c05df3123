"""Several workers on one study, under stress (bench/stress.py): every planned point is completed
exactly once, trial 0's default point included, none is lost — on a journal file and on
PostgreSQL. Measured with bench/stress_workers.py on the code before the fix (0e521a8: a trial's
point was read from ``trial.params``, empty while an enqueued trial is WAITING and between ``ask``
and the objective's suggestions): 4 workers duplicated a point in 8 of 12 repetitions (3 workers:
6 of 18); after the fix 0 of 24 (journal and PostgreSQL, 12 each). The bug was in code both
backends share, so 2 repetitions of 4 workers on each catch it with probability 1 - (4/12)^4 ~ 0.99
if its rate is the same on both (~0.89 on either backend alone; with the rate's 95 % interval from
12 repetitions, 0.35-0.90, as low as ~0.82), at 2/3 of the cost of 3 each (~27 s of both CPUs a
repetition). Races found by this harness that one backend alone has (the PostgreSQL reaper) get
2 repetitions there, not 3.
"""

from __future__ import annotations

import pytest

from bench.stress import PLANNED, repetition
from tests.helpers.services import PG_URL, require_postgres

REPETITIONS, WORKERS = 2, 4


@pytest.mark.parametrize("backend", ["journal", "postgresql"])
def test_workers_started_together_never_duplicate_or_lose_a_point(tmp_path, backend):
    storage = None
    if backend == "postgresql":
        require_postgres()
        storage = PG_URL
    for i in range(REPETITIONS):
        rep = repetition(tmp_path / f"rep{i}", WORKERS, storage=storage)
        assert rep.failed_workers == 0, rep
        assert rep.completed == tuple(PLANNED), rep
        assert rep.duplicates == () and rep.lost == () and rep.default_runs == 1, rep
