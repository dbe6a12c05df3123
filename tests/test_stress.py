"""Several workers on one study, under stress (bench/stress.py): every planned point is evaluated
exactly once, trial 0's default point included, none is lost — on a journal file and on
PostgreSQL. Evaluated: completed, or failed by its own measurement. Four workers on two cores
trip the impossible-measurement guard now and then (a decode-phase speedup of 4.6x at 1.5 tokens
per step, twice: the trial fails ``impossible``, rightly); that point was evaluated, not lost
(seen in CI on 2026-11-29 and in 1 of 9 repetitions here the same day, both on PostgreSQL).

Measured with bench/stress_workers.py on the code before the fix (0e521a8: a trial's point was
read from ``trial.params``, empty while an enqueued trial is WAITING and between ``ask`` and the
objective's suggestions): 4 workers duplicated a point in 8 of 12 repetitions (3 workers:
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


def test_a_point_failed_by_its_measurement_is_evaluated_a_lost_race_is_not(tmp_path):
    """The harness's rule on a study written by hand: a measurement's failure evaluated its point,
    a lost race or a dead worker did not (their point is claimed again)."""
    import optuna

    from bench.stress import summarize

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    dist = {"num_draft_tokens": optuna.distributions.IntDistribution(1, 5)}

    def add(point: int, state: optuna.trial.TrialState, **attrs: object) -> None:
        study.add_trial(optuna.trial.create_trial(
            params={"num_draft_tokens": point}, distributions=dist, state=state,
            values=[1.0] if state == optuna.trial.TrialState.COMPLETE else None,
            user_attrs={"point": f'{{"num_draft_tokens": {point}}}', **attrs}))

    add(1, optuna.trial.TrialState.COMPLETE)
    add(2, optuna.trial.TrialState.FAIL, error="impossible measurement, twice",
        error_kind="impossible")
    add(3, optuna.trial.TrialState.FAIL, error="duplicate: trial 0 holds this point")
    add(4, optuna.trial.TrialState.FAIL, error="orphaned: its worker ended")
    add(4, optuna.trial.TrialState.COMPLETE, retry_of=3)
    add(5, optuna.trial.TrialState.PRUNED)
    add(5, optuna.trial.TrialState.COMPLETE)
    rep = summarize(study, 1.0, ())
    assert rep.completed == (1, 2, 4, 5, 5) and rep.lost == (3,) and rep.duplicates == (5,)
    assert rep.default_runs == 1 and rep.failed_evaluations == ("2: impossible",)
