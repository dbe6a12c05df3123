"""One tuner study fanned out over a real Slurm array (scripts/services.sh): journal and
PostgreSQL storage, a worker killed mid-trial, finish after the array, scheduled re-runs.

Tiny models, 6-token generations: the point is the bookkeeping, not the speed (on this 2-core
machine four workers share two cores)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid

import optuna
from optuna.trial import TrialState

from tests.conftest import ENV, SIDE_BY_SIDE
from tests.helpers.services import (PG_URL, alive, all_gone, require_postgres, require_slurm,
                                   wait_for)
from tuner.cluster import slurm
from tuner.engines.server import free_port
from tuner.study.storage import make_storage
from tuner.study.trials import failure_reason

GRID = ["+task=gsm8k", "method=speculative", "models=tiny", "task.n_prompts=2",
        "task.n_held_out=1", "task.max_new_tokens=6", "warmup_prompts=0", "search=grid",
        "search.ranges=full", "method.space.num_draft_tokens.high=6",
        "method.params.num_draft_tokens=2",
        *[o for o in SIDE_BY_SIDE if not o.startswith("bound_slack=")],
        "bound_slack=100"]   # four workers on two cores disturb 6-token timings past the physical
                             # bound (a trial failing 'impossible' is right there, not tested here)


def tuner(tmp_path, *overrides, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner", *overrides], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def queued(*jobs: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", ",".join(jobs), "-o", "%i"],
                         capture_output=True, text=True).stdout
    return bool(out.strip())


def run_sweep(tmp_path, name, storage_args, tracking_args, launched_check=None):
    """Launch 4 workers, SIGKILL the worker process of the first trial seen running (a crash: no
    handler runs, the trial stays RUNNING), wait until every job has ended. ``launched_check``
    looks at the launcher's output while the jobs are queued."""
    require_slurm()
    launched = tuner(tmp_path, *GRID, *storage_args, "launcher=slurm", "launcher.workers=4",
                     "launcher.time=00:15:00", f"study_name={name}", "tracking=server",
                     *tracking_args, f"tracking.experiment={name}")
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    if launched_check:
        launched_check(launched)
    jobs = dict(x.split("=", 1) for x in launched.stdout.split("jobs: ")[1].split()[:3])
    folder = tmp_path / "studies" / name / "slurm"
    for script in ("prepare.sbatch", "work.sbatch", "finish.sbatch"):   # as submitted
        slurm.validate(folder / script)
    storage = make_storage(storage_args[0].split("=", 1)[1] if storage_args else None,
                           tmp_path / "studies" / f"{name}.journal")

    def running_trial():
        try:
            study = optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            return None
        # the worker writes its identity one attribute at a time (slurm_job_id before pid)
        return next((t for t in study.get_trials(states=(TrialState.RUNNING,))
                     if t.user_attrs.get("slurm_job_id") and "pid" in t.user_attrs), None)

    victim = wait_for(running_trial, 240, what="a running trial")
    job = victim.user_attrs["slurm_job_id"]
    os.kill(int(victim.user_attrs["pid"]), signal.SIGKILL)     # single node: same host
    wait_for(lambda: not queued(jobs["prepare"], jobs["workers"], jobs["finish"]), 420,
             what="the sweep's jobs to end")
    study = optuna.load_study(study_name=name, storage=storage)
    return study, victim, job, folder, jobs


def check_sweep(study, victim, job, folder, mlflow_url, name):
    complete = [t.params["num_draft_tokens"] for t in study.get_trials(
        states=(TrialState.COMPLETE,))]
    assert sorted(complete) == [1, 2, 3, 4, 5, 6], complete       # each point exactly once
    dead = study.trials[victim.number]
    assert dead.state == TrialState.FAIL, dead.state
    retry = [t for t in study.trials if t.user_attrs.get("retry_of") == victim.number]
    assert retry and retry[0].state == TrialState.COMPLETE        # re-evaluated elsewhere
    assert retry[0].params == victim.params
    assert retry[0].user_attrs["slurm_job_id"] != job
    for t in study.get_trials(states=(TrialState.FAIL,)):
        assert t.number == victim.number or failure_reason(study, t).startswith("duplicate")
    logs = "".join(p.read_text() for p in folder.glob("*.out"))
    assert logs.count("best configuration written to") == 1       # finish ran once, after all
    assert (folder.parents[1] / "best" / f"{name}.yaml").is_file()
    import mlflow
    client = mlflow.MlflowClient(mlflow_url)
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("kind") == "study"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    finished = [r for r in runs if r.data.tags.get("kind") == "trial"
                and r.info.status == "FINISHED"]
    assert len(finished) == 6 and all(
        r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for r in finished)


def test_four_slurm_workers_on_a_journal_with_one_killed(tmp_path, mlflow_url):
    name = f"sweep-{uuid.uuid4().hex[:6]}"
    study, victim, job, folder, _ = run_sweep(
        tmp_path, name, [], [f"tracking.tracking_uri={mlflow_url}", "tracking.start=false"])
    assert failure_reason(study, study.trials[victim.number]).startswith(
        f"orphaned: Slurm job {job} is gone")
    check_sweep(study, victim, job, folder, mlflow_url, name)


def stop_started_server(pid_file) -> list[int]:
    """Stop the server whose process group ``start_server`` wrote to ``pid_file`` the way
    docs/slurm.md says (``kill -- -$(cat mlruns/mlflow-server.pid)``): the processes that SIGTERM
    left alive (killed now, so none outlives the test)."""
    if not pid_file.is_file():
        return []
    group = int(pid_file.read_text())
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        return []
    left = all_gone([group], 20)
    if left:
        os.killpg(group, signal.SIGKILL)
        all_gone([group], 10)
    return left


def test_four_slurm_workers_on_postgresql_with_one_killed_log_to_a_server_the_launcher_starts(
        tmp_path):
    """The README's ``launcher=slurm tracking=server``: with ``tracking.start=true`` (as
    conf/tracking/server.yaml) the launcher itself starts the MLflow server, here on a free port
    and in the backend store the config names (the PostgreSQL database ``mlflow``: this test's
    experiment is its own), before it submits the jobs; the server outlives the launch, every
    job logs to it, and the test stops it by the process group the launcher recorded."""
    from tuner.tracking.server import answers
    require_postgres()
    name = f"sweep-{uuid.uuid4().hex[:6]}"
    url = f"http://127.0.0.1:{free_port()}"
    assert not answers(url)               # nothing there: what answers later, the launcher started
    pid_file, log = (tmp_path / "mlruns" / f"mlflow-server.{x}" for x in ("pid", "log"))

    def started_the_server(launched):
        said = re.search(rf"MLflow server at {re.escape(url)} started \(pid (\d+)\)",
                         launched.stdout)
        assert said, launched.stdout[-2000:]
        group = int(said[1])
        assert int(pid_file.read_text()) == group and os.getpgid(group) == group
        assert alive([group])                           # the launcher has exited; it has not
        assert answers(url)                             # while the jobs are queued and run
        assert f"Uvicorn running on {url}" in log.read_text(errors="replace")

    try:
        study, victim, job, folder, _ = run_sweep(
            tmp_path, name, [f"storage={PG_URL}", "heartbeat.interval=1", "heartbeat.grace=4"],
            ["tracking.start=true", f"tracking.port={url.rsplit(':', 1)[1]}",
             f"tracking.tracking_uri={url}", "tracking.workers=1"],
            launched_check=started_the_server)
        assert answers(url)                             # it served the whole sweep
        check_sweep(study, victim, job, folder, url, name)   # prepare, workers, finish: there
        assert "/runs/create" in log.read_text(errors="replace")
    finally:
        left = stop_started_server(pid_file)
    assert left == [], f"SIGTERM to the server's process group left {left}"
    assert not answers(url)


def test_a_scheduled_sweep_queues_itself_with_its_begin_time(tmp_path):
    require_slurm()
    done = tuner(tmp_path, *GRID, "launcher=slurm", "launcher.schedule=now+2hours",
                 "tracking=none")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    job = done.stdout.split("scheduled: job ")[1].split()[0]
    try:
        begin = subprocess.run(["squeue", "-h", "-j", job, "-o", "%S"], capture_output=True,
                               text=True).stdout.strip()
        assert begin and begin != "N/A"
        from datetime import datetime, timedelta
        start = datetime.fromisoformat(begin)
        assert timedelta(hours=1, minutes=55) < start - datetime.now() < timedelta(hours=2,
                                                                                   minutes=5)
        script = next((tmp_path / "studies").glob("*-scheduled/slurm/scheduled.sbatch"))
        text = script.read_text()
        assert "launcher.schedule=null" in text and "study_tag=${oc.env:SPECTUNE_RUN_DATE}" in text
        slurm.validate(script)
    finally:
        subprocess.run(["scancel", job], capture_output=True)


def test_hydra_multirun_submits_one_study_per_combination(tmp_path):
    require_slurm()
    done = tuner(tmp_path, "-m", "+task=gsm8k", "method=speculative,block", "models=tiny",
                 "tracking=none", "launcher=slurm", "launcher.workers=2",
                 "launcher.job_name=multirun-test")
    jobs = [dict(x.split("=", 1) for x in line.split()[1:])
            for line in done.stdout.splitlines() if line.startswith("jobs: ")]
    try:
        assert done.returncode == 0 and len(jobs) == 2, done.stdout[-2000:] + done.stderr[-2000:]
        studies = sorted(p.name for p in (tmp_path / "studies").iterdir()
                         if p.is_dir() and not p.name.startswith("."))   # .hydra: Hydra's run dirs
        assert [s.split("-")[1] for s in studies] == ["block", "speculative"]
    finally:
        ids = [j[k] for j in jobs for k in ("prepare", "workers", "finish")]
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True)
