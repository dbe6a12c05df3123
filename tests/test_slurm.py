"""tuner.cluster.slurm against the real single-node Slurm (scripts/services.sh), plus its pure parts.

Real-Slurm tests skip only when ``sbatch`` is absent (and fail under CI=true). Job outputs go to
tmp_path (Slurm runs as root here). Every test cancels what it leaves queued.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from datetime import datetime
from pathlib import Path

import optuna
import pytest

from tests.helpers.services import require_slurm, wait_for
from tuner.cluster import slurm
from tuner.study import liveness
from tuner.cluster.slurm import SlurmSettings

PY = sys.executable


def settings(**kw) -> SlurmSettings:
    """A unique job name per test, so ``--dependency=singleton`` never couples two tests."""
    return SlurmSettings(**{"job_name": f"t{uuid.uuid4().hex[:8]}", "time": "00:05:00", **kw})


@pytest.fixture
def cluster():
    require_slurm()
    submitted: list[str] = []
    yield submitted
    if submitted:
        subprocess.run(["scancel", *submitted], capture_output=True)


# ---------------------------------------------------------------- pure

def test_settings_from_config_and_errors():
    s = SlurmSettings.from_config({"kind": "slurm", "workers": 3, "partition": "gpu",
                                   "gpus_per_worker": 1, "extra_sbatch": ["--qos=high"]})
    assert (s.workers, s.partition, s.gpus_per_worker, s.extra_sbatch) == (3, "gpu", 1,
                                                                           ("--qos=high",))
    with pytest.raises(ValueError, match=r"launcher: unknown key\(s\) \['gpus'\]"):
        SlurmSettings.from_config({"gpus": 1})
    with pytest.raises(ValueError, match="launcher.workers=0 is invalid"):
        SlurmSettings.from_config({"workers": 0})
    with pytest.raises(ValueError, match="launcher.schedule='weekly' is invalid: allowed are"):
        SlurmSettings.from_config({"schedule": "weekly"})
    for bad in ("qos=high", "--comment=a b"):
        with pytest.raises(ValueError, match=f"launcher.extra_sbatch entry '{bad}' is invalid"):
            SlurmSettings.from_config({"extra_sbatch": [bad]})


def test_launcher_configs_compose_into_settings():
    """conf/launcher/*.yaml and conf/tracking/server.yaml compose with Hydra and are accepted."""
    from hydra import compose, initialize_config_dir

    from tuner.tracking.server import ServerSettings

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose("config", overrides=[
            "+task=gsm8k", "launcher=slurm", "tracking=server", "launcher.workers=8",
            "launcher.time=08:00:00", 'launcher.extra_sbatch=["--qos=high"]',
            "launcher.schedule=daily@02:00"])
        local = compose("config", overrides=["+task=gsm8k"])
    s = SlurmSettings.from_config(cfg.launcher)
    assert (s.workers, s.time, s.extra_sbatch, s.schedule) == (8, "08:00:00", ("--qos=high",),
                                                               "daily@02:00")
    assert ServerSettings.from_config(cfg.tracking).port == 5000
    assert cfg.tracking.tracking_uri == "http://127.0.0.1:5000"
    assert dict(local.launcher) == {"kind": "local", "workers": 1}


def test_render_headers_and_quoting(tmp_path):
    s = SlurmSettings(workers=4, partition="gpu", gpus_per_worker=2, cpus_per_worker=8,
                      mem_per_worker="32G", account="proj", extra_sbatch=("--qos=high",))
    text = slurm.render_workers(s, ["python", "-m", "tuner", "study_name=a-${oc.env:X}", "a b"],
                                tmp_path)
    for line in ("#SBATCH --array=0-3", "#SBATCH --partition=gpu", "#SBATCH --gres=gpu:2",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --mem=32G", "#SBATCH --account=proj",
                 "#SBATCH --qos=high", f"#SBATCH --output={tmp_path}/%x_%A_%a.out"):
        assert line in text.splitlines()
    assert "python -m tuner 'study_name=a-${oc.env:X}' 'a b'" in text
    fin = slurm.render_finish(s, ["true"], tmp_path, after="77")
    assert "#SBATCH --dependency=afterany:77" in fin


def test_next_begin():
    now = datetime(2026, 11, 22, 21, 30)
    assert slurm.next_begin("hourly", now) == "2026-11-22T22:00:00"
    assert slurm.next_begin("daily", now) == "2026-11-23T00:00:00"
    assert slurm.next_begin("daily@02:15", now) == "2026-11-23T02:15:00"
    assert slurm.next_begin("daily@23:05", now) == "2026-11-22T23:05:00"
    assert slurm.next_begin("daily@21:30", now) == "2026-11-23T21:30:00"   # strictly after
    assert slurm.next_begin("now+6hours", now) == "now+6hours"


@pytest.mark.parametrize("schedule", ["hourly", "daily", "daily@00:00", "daily@23:59",
                                      "now+90minutes"])
def test_job_computes_the_same_next_begin_as_python(schedule):
    """The scheduled job computes its successor's begin with GNU date at run time."""
    shell = subprocess.run(["bash", "-c", slurm._begin_shell(schedule)], capture_output=True,
                           text=True, check=True).stdout.strip()
    assert shell == slurm.next_begin(schedule)


# ---------------------------------------------------------------- real Slurm

def test_rendered_scripts_pass_sbatch_test_only(cluster, tmp_path):
    s = settings(workers=4, extra_sbatch=("--comment=spectune",))
    argv = [PY, "-c", "print('hi')"]
    for text in (slurm.render_prepare(s, argv, tmp_path), slurm.render_workers(s, argv, tmp_path),
                 slurm.render_finish(s, argv, tmp_path),
                 slurm.render_scheduled(settings(schedule="daily"), argv, tmp_path,
                                        tmp_path / "s.sbatch")):
        assert "to start at" in slurm.validate(text)
    bad = slurm.render_prepare(settings(extra_sbatch=("--no-such-option=1",)), argv, tmp_path)
    with pytest.raises(slurm.SlurmError, match="rejected"):
        slurm.validate(bad)


WORKER = """
import json, os, sys, time
out = sys.argv[1]
start = time.time(); time.sleep(3)
json.dump({"start": start, "end": time.time(), "argv": sys.argv[2:],
           "job": os.environ["SLURM_ARRAY_JOB_ID"]},
          open(f"{out}/w{os.environ['SLURM_ARRAY_TASK_ID']}.json", "w"))
"""
FINISH = """
import glob, json, sys, time
json.dump({"time": time.time(), "workers": len(glob.glob(sys.argv[1] + "/w*.json"))},
          open(sys.argv[1] + "/finish.json", "w"))
"""


def test_sweep_array_runs_concurrently_then_finish(cluster, tmp_path):
    s = settings(workers=4)
    odd = ["study_name=gsm8k-${oc.env:SPECTUNE_RUN_DATE,x}", "a b", "it's \"q\" $HOME"]
    jobs = slurm.launch_sweep(
        s, tmp_path,
        prepare=[PY, "-c", "import sys; open(sys.argv[1] + '/prep', 'w')", str(tmp_path)],
        work=[PY, "-c", WORKER, str(tmp_path), *odd],
        finish=[PY, "-c", FINISH, str(tmp_path)])
    cluster += [jobs.prepare, jobs.workers, jobs.finish]
    assert jobs.scripts["work"] == (tmp_path / "slurm" / "work.sbatch").resolve()
    assert f"afterany:{jobs.workers}" in jobs.scripts["finish"].read_text()
    wait_for(lambda: not slurm.job_alive(jobs.finish), timeout=75)

    runs = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(4)]
    assert all(r["argv"] == odd and r["job"] == jobs.workers for r in runs)
    assert (tmp_path / "prep").exists()
    starts, ends = sorted(r["start"] for r in runs), sorted(r["end"] for r in runs)
    assert starts[1] < ends[0], "array tasks ran one at a time: DefMemPerCPU missing?"
    finish = json.loads((tmp_path / "finish.json").read_text())
    assert finish["workers"] == 4 and finish["time"] >= ends[-1]
    assert len(list((tmp_path / "slurm").glob("*-work_*_*.out"))) == 4


def test_failed_prepare_cancels_workers_and_finish_still_runs(cluster, tmp_path):
    s = settings(workers=2)
    jobs = slurm.launch_sweep(s, tmp_path, prepare=["false"],
                              work=["touch", str(tmp_path / "worker-ran")],
                              finish=["touch", str(tmp_path / "finish-ran")])
    cluster += [jobs.prepare, jobs.workers, jobs.finish]
    wait_for(lambda: not slurm.job_alive(jobs.finish), timeout=60)
    assert slurm.job_state(jobs.prepare) == "FAILED"
    assert slurm.job_state(jobs.workers) == "CANCELLED"
    assert (tmp_path / "finish-ran").exists() and not (tmp_path / "worker-ran").exists()


def test_scheduled_run_resubmits_itself_with_begin_time(cluster, tmp_path):
    s = settings(schedule="daily@03:00")
    marker = tmp_path / "ran"
    first, path = slurm.schedule_sweep(
        s, tmp_path,
        [PY, "-c", "import os, sys; open(sys.argv[1], 'w').write(os.environ['SPECTUNE_RUN_DATE'])",
         str(marker)],
        begin="now")
    cluster.append(first)
    name = f"{s.job_name}-scheduled"

    def successor():
        out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i %S %T"],
                             capture_output=True, text=True).stdout.split("\n")
        rows = [line.split() for line in out if line.strip()]
        return [r for r in rows if r[0] != first]

    rows = wait_for(successor, timeout=45)
    cluster.append(rows[0][0])
    wait_for(lambda: marker.exists() and not slurm.job_alive(first), timeout=45)
    expected = slurm.next_begin("daily@03:00")   # the shell's answer must match Python's
    job, start, state = successor()[0]
    assert (start, state) == (expected, "PENDING")
    assert marker.read_text() == datetime.now().strftime("%Y-%m-%d")
    begin = subprocess.run(["squeue", "-h", "-j", job, "-o", "%S"], capture_output=True,
                           text=True).stdout.strip()
    assert begin == expected
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert f"Command={path}" in shown
    subprocess.run(["scancel", job], check=True)


def test_job_alive_running_then_cancelled(cluster, tmp_path):
    job = subprocess.run(["sbatch", "--parsable", "-o", str(tmp_path / "%j.out"), "--array=0-1",
                          "--wrap", "sleep 60"], capture_output=True, text=True,
                         check=True).stdout.strip()
    cluster.append(job)
    task = f"{job}_1"
    wait_for(lambda: slurm.job_state(task) == "RUNNING", timeout=30)
    assert slurm.job_alive(task) and slurm.job_alive(job)
    subprocess.run(["scancel", job], check=True)
    wait_for(lambda: not slurm.job_alive(task), timeout=30)
    assert slurm.job_state(task) == "CANCELLED"
    assert slurm.job_state("987654321") is None


def test_fail_dead_workers_on_journal_storage(cluster, tmp_path):
    """Journal storage has no heartbeat: a RUNNING trial of a cancelled Slurm job is failed and
    its point re-queued; the trial of a live job is left alone."""
    live = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 60"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dead = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 60"],
                          capture_output=True, text=True, check=True).stdout.strip()
    cluster += [live, dead]
    subprocess.run(["scancel", dead], check=True)
    wait_for(lambda: not slurm.job_alive(dead), timeout=30)

    path = str(tmp_path / "journal.log")
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        path, lock_obj=optuna.storages.journal.JournalFileOpenLock(path)))
    study = optuna.create_study(study_name="s", storage=storage)
    for job in (live, dead):
        trial = study.ask()
        trial.suggest_int("k", 1, 8)
        trial.set_user_attr("slurm_job_id", job)
    local = study.ask()   # no slurm_job_id: never touched
    assert liveness.reap(study, job_alive=slurm.job_alive_or_none) == [1]
    states = [t.state for t in study.get_trials()]
    assert states[:3] == [optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL,
                          optuna.trial.TrialState.RUNNING]
    retried = study.get_trials()[3]
    assert retried.state == optuna.trial.TrialState.WAITING
    k = study.get_trials()[1].params["k"]            # not the dead trial's slurm_job_id:
    assert retried.user_attrs == {"retry_of": 1, "retries": 1, "point": json.dumps({"k": k})}
    from tuner.study.trials import failure_reason
    assert failure_reason(study, study.get_trials()[1]).startswith("orphaned: Slurm job")
    assert liveness.orphans(study) == {1}
    again = study.ask()   # the re-queued point comes first, with the dead trial's value
    assert again.number == 3 and local.number == 2
    assert again.suggest_int("k", 1, 8) == study.get_trials()[1].params["k"]


def test_no_answer_from_slurm_is_not_death(tmp_path, monkeypatch):
    """With the controller unreachable, job_alive raises and no trial is failed (fake squeue)."""
    for tool in ("squeue", "scontrol"):
        fake = tmp_path / tool
        fake.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm "
                        "controller (connect failure)' >&2\nexit 1\n")
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(slurm.SlurmError, match="Unable to contact"):
        slurm.job_alive("12_3")
    study = optuna.create_study()
    trial = study.ask()
    trial.set_user_attr("slurm_job_id", "12_3")
    assert slurm.job_alive_or_none("12_3") is None
    assert liveness.reap(study, job_alive=slurm.job_alive_or_none) == []
    assert study.get_trials()[0].state == optuna.trial.TrialState.RUNNING


def test_worker_identity(monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "12")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    ident = liveness.worker_identity()
    assert ident["slurm_job_id"] == "12_3" and ident["gpu"] == "1" and ident["host"]


@pytest.mark.parametrize("backend", ["journal", "postgresql"])
def test_killed_array_task_trial_fails_and_its_point_is_rerun(cluster, tmp_path, backend):
    """The issue's promise, end to end, with the production worker (``python -m tuner
    phase=work``): 2 Slurm array workers on one study; task 0 is scancel'ed mid-trial; the
    survivor reaps the trial (heartbeat on PostgreSQL, job id on journal storage) to FAIL and
    evaluates the same point again."""
    from tests.conftest import ENV, SIDE_BY_SIDE
    from tests.helpers.services import PG_URL, require_postgres
    from tuner.study.storage import make_storage

    name = f"kill-{uuid.uuid4().hex[:8]}"
    storage_args = []
    if backend == "postgresql":
        require_postgres()
        storage_args = [f"storage={PG_URL}", "heartbeat.interval=1", "heartbeat.grace=2"]
    common = ["+task=gsm8k", "method=speculative", "models=tiny", "task.n_prompts=2",
              "task.n_held_out=1", "task.max_new_tokens=48", "warmup_prompts=0", "search=grid",
              "search.ranges=full", "method.space.num_draft_tokens.high=4",
              "method.params.num_draft_tokens=2", "tracking=none", *SIDE_BY_SIDE,
              f"study_name={name}", f"studies_dir={tmp_path / 'studies'}", *storage_args]
    prepared = subprocess.run([PY, "-m", "tuner", *common, "phase=prepare"], env=ENV,
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert prepared.returncode == 0, prepared.stdout[-2000:] + prepared.stderr[-2000:]
    storage = make_storage(PG_URL if storage_args else None,
                           tmp_path / "studies" / f"{name}.journal")
    s = settings(workers=2, workdir=str(Path(__file__).resolve().parents[1]))
    script = tmp_path / "work.sbatch"
    script.write_text(slurm.render_workers(s, [PY, "-m", "tuner", *common, "phase=work"],
                                           tmp_path))
    array = slurm.submit(script)
    cluster.append(array)

    def task0_running():
        study = optuna.load_study(study_name=name, storage=storage)
        return next((t for t in study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
                     if t.user_attrs.get("slurm_job_id") == f"{array}_0"
                     and "pid" in t.user_attrs), None)   # written after slurm_job_id

    victim = wait_for(task0_running, timeout=240)
    # a crash of task 0's worker (single node: same host): no handler runs, the trial stays
    # RUNNING, the batch script then ends and Slurm forgets the task
    os.kill(int(victim.user_attrs["pid"]), signal.SIGKILL)
    wait_for(lambda: not slurm.job_alive(array), timeout=300)

    study = optuna.load_study(study_name=name, storage=storage)
    trials = study.get_trials()
    dead = trials[victim.number]
    assert dead.state == optuna.trial.TrialState.FAIL
    assert dead.user_attrs["slurm_job_id"] == f"{array}_0" and dead.user_attrs["host"]
    rerun = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE
             and t.params == dead.params]
    assert len(rerun) == 1 and rerun[0].user_attrs["slurm_job_id"] == f"{array}_1"
    assert rerun[0].user_attrs["retry_of"] == dead.number
    assert liveness.orphans(study) == {dead.number}
    done = sorted(t.params["num_draft_tokens"] for t in trials
                  if t.state == optuna.trial.TrialState.COMPLETE)
    assert done == [1, 2, 3, 4]                      # every point once, none lost
    out = "".join(p.read_text() for p in tmp_path.glob(f"{s.job_name}-work_{array}_1.out"))
    assert "Traceback" not in out, out