"""Shared storage for many workers, against the real PostgreSQL (scripts/services.sh):
Optuna on ``postgresql+psycopg://``, heartbeats for ask/tell trials with stale-trial reaping, and
an MLflow tracking server written to by two processes at once.

Skips only when PostgreSQL refuses the connection (fails under CI=true).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import optuna
import pytest

from tests.helpers.services import PG_URL, require_postgres
from tests.helpers.services import wait_for as poll
from tuner.study import liveness
from tuner.tracking import server as mlflow_server

PY = sys.executable
from tests.conftest import ROOT

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def pg():
    require_postgres()
    return PG_URL


def spawn(code: str, *args: str, **kw) -> subprocess.Popen:
    """A Python child running ``code`` from the repo root (so it imports this checkout)."""
    return subprocess.Popen([PY, "-c", textwrap.dedent(code), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


ASK_TELL_WORKER = """
import sys, optuna
optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.load_study(study_name=sys.argv[2], storage=sys.argv[1])
for _ in range(3):
    trial = study.ask()
    study.tell(trial, trial.suggest_float("x", -1, 1) ** 2)
"""


def test_two_workers_share_a_study_on_postgresql_psycopg(pg):
    name = f"pg-{uuid.uuid4().hex[:8]}"
    assert pg.startswith("postgresql+psycopg://")
    optuna.create_study(study_name=name, storage=pg)   # once, before the fan-out
    workers = [spawn(ASK_TELL_WORKER, pg, name) for _ in range(2)]
    for w in workers:
        assert w.wait(60) == 0, w.stderr.read()
    trials = optuna.load_study(study_name=name, storage=pg).get_trials()
    assert sorted(t.number for t in trials) == list(range(6))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)


HEARTBEAT_WORKER = """
import sys, time, warnings, optuna
from tuner.study import liveness
warnings.simplefilter("ignore")
storage = liveness.heartbeat_storage(sys.argv[1], interval=1, grace=2)
study = optuna.load_study(study_name=sys.argv[2], storage=storage)
trial = study.ask()
trial.suggest_int("k", 1, 1000)
with liveness.Heartbeat.for_trial(study, trial):
    print(trial.number, flush=True)
    time.sleep(120)
"""


def test_killed_worker_trial_becomes_fail_and_is_requeued(pg):
    """A worker SIGKILLed mid-trial stops beating: after the grace period ``reap`` fails its trial
    and re-queues the point, while a trial that keeps beating stays RUNNING."""
    name = f"hb-{uuid.uuid4().hex[:8]}"
    storage = liveness.heartbeat_storage(pg, interval=1, grace=2)
    study = optuna.create_study(study_name=name, storage=storage)
    worker = spawn(HEARTBEAT_WORKER, pg, name)
    number = int(worker.stdout.readline())
    with pytest.warns(UserWarning, match="Heartbeat"):
        mine = study.ask()
    with liveness.Heartbeat.for_trial(study, mine) as beat:
        assert liveness.reap(study) == []             # both beating
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        killed_at = time.monotonic()
        assert poll(lambda: liveness.reap(study), timeout=15) == [number]
        assert time.monotonic() - killed_at >= 1.0    # not before the grace period
        assert beat.beats >= 2
    trials = {t.number: t for t in study.get_trials()}
    assert trials[number].state == optuna.trial.TrialState.FAIL
    assert trials[mine.number].state == optuna.trial.TrialState.RUNNING
    retry = [t for t in trials.values() if t.state == optuna.trial.TrialState.WAITING]
    k = trials[number].params["k"]               # the retry holds the dead trial's point
    assert len(retry) == 1 and retry[0].user_attrs == {"retry_of": number, "retries": 1,
                                                       "point": json.dumps({"k": k})}
    assert liveness.orphans(study) == {number}
    again = study.ask()   # the re-queued point is next, with the dead trial's value
    assert again.number == retry[0].number
    assert again.suggest_int("k", 1, 1000) == trials[number].params["k"]
    study.tell(again, 1.0)
    study.tell(mine, 0.0)


def test_heartbeat_is_a_noop_without_heartbeat_storage(tmp_path):
    path = str(tmp_path / "journal.log")
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    study = optuna.create_study(storage=storage)
    trial = study.ask()
    with liveness.Heartbeat.for_trial(study, trial) as beat:
        assert not beat.enabled
    assert beat.beats == 0 and liveness.fail_stale(study) == []


# ---------------------------------------------------------------- MLflow server

@pytest.fixture
def server(mlflow_url):
    """The session's server URL; afterwards this process's MLflow tracking URI is unset again."""
    import mlflow

    yield mlflow_url
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(None)


MLFLOW_WRITER = """
import sys, mlflow
mlflow.set_tracking_uri(sys.argv[1])
mlflow.set_experiment(sys.argv[2])
with mlflow.start_run(run_name=sys.argv[3]):
    for step in range(5):
        mlflow.log_metric("speedup", float(step), step=step)
    mlflow.log_param("worker", sys.argv[3])
    mlflow.log_text("written by " + sys.argv[3], "note.txt")
"""


def test_two_processes_log_over_http(server):
    import mlflow

    experiment = f"two-writers-{uuid.uuid4().hex[:8]}"
    mlflow.set_tracking_uri(server)
    mlflow.create_experiment(experiment)   # once, as the launcher would
    writers = [spawn(MLFLOW_WRITER, server, experiment, f"w{i}") for i in range(2)]
    for w in writers:
        assert w.wait(120) == 0, w.stderr.read()
    runs = mlflow.search_runs(experiment_names=[experiment], output_format="list")
    assert sorted(r.data.params["worker"] for r in runs) == ["w0", "w1"]
    for run in runs:
        assert run.data.metrics["speedup"] == 4.0
        assert run.info.artifact_uri.startswith("mlflow-artifacts:/")
        text = mlflow.artifacts.load_text(f"{run.info.artifact_uri}/note.txt")
        assert text == f"written by {run.data.params['worker']}"
    assert mlflow_server.ensure_server(mlflow_server.ServerSettings(
        port=int(server.rsplit(":", 1)[1])))[1] is None   # answering: reused, not restarted


def test_tracker_logs_a_study_through_the_server(server, tmp_path):
    """``tracking=server``: the MLflow listener (parent run + nested trial run + files) over HTTP,
    artifacts stored by the server (no local artifact_location)."""
    import mlflow

    from tests.conftest import compose_cfg
    from tuner.measure.evaluator import Evaluation
    from tuner.study.settings import StudySettings
    from tuner.study.callbacks import StudyResult, TrialOutcome
    from tuner.tracking.trackers import make_tracker

    experiment = f"tracker-{uuid.uuid4().hex[:8]}"
    settings = StudySettings.from_config(compose_cfg(
        tmp_path, "tracking=server", f"tracking.tracking_uri={server}", "tracking.start=false",
        f"tracking.experiment={experiment}", f"studies_dir={tmp_path}"))
    tracker = make_tracker(settings.tracking)
    study = optuna.create_study(direction="maximize")
    tracker.study_started(settings, study, True)
    assert study.user_attrs["mlflow_parent_run_id"] == tracker.parent_id
    trial = study.ask()
    tracker.trial_started(trial, {"k": 3}, "grid")
    run_id = trial.user_attrs["mlflow_run_id"]
    tracker.trial_ended(trial, TrialOutcome("COMPLETE", "FINISHED",
                                            Evaluation({"speedup": 1.5}, ())))
    study.tell(trial, 1.5)
    (tmp_path / "best.yaml").write_text("k: 3\n")
    tracker.study_finished(StudyResult([("study", "s1")], "use it", {"best_speedup": 1.5}, {},
                                       [("best", tmp_path / "best.yaml")], trial.number))
    mlflow.set_tracking_uri(server)
    logged = mlflow.get_run(run_id)
    assert logged.data.metrics["speedup"] == 1.5
    assert logged.info.status == "FINISHED" and logged.data.tags["winner"] == "true"
    parent = mlflow.get_run(logged.data.tags["mlflow.parentRunId"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["mlflow.note.content"].startswith("**Recommendation: use it**")
    assert parent.info.artifact_uri.startswith("mlflow-artifacts:/")
    assert mlflow.artifacts.load_text(f"{parent.info.artifact_uri}/best/best.yaml") == "k: 3\n"


def test_make_storage_journal_by_default_and_heartbeat_on_postgresql(pg, tmp_path):
    from tuner.study.storage import make_storage

    journal = make_storage(None, tmp_path / "studies" / "s.journal")
    assert isinstance(journal, optuna.storages.JournalStorage)
    optuna.create_study(study_name="s", storage=journal)
    assert (tmp_path / "studies" / "s.journal").stat().st_size > 0
    rdb = make_storage(pg, tmp_path / "unused.journal", heartbeat_interval=7, grace=20)
    assert isinstance(rdb, optuna.storages.RDBStorage)
    assert (rdb.get_heartbeat_interval(), rdb.grace_period) == (7, 20)
    assert isinstance(rdb.get_heartbeat_stale_trial_callback(), liveness.Requeue)
    assert make_storage(journal, "x") is journal
    assert not (tmp_path / "unused.journal").exists()
