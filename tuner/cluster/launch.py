"""``launcher=slurm``: fan one study out over a Slurm array instead of running it here.

    python -m tuner +task=gsm8k launcher=slurm launcher.workers=4

The config is validated and the study named here (nothing is loaded); then three jobs are
submitted, each the same command with ``launcher=local``, the pinned ``study_name`` and a phase:
prepare (create the study, trial 0, the MLflow parent), an ``sbatch --array`` of workers
(``afterok:prepare``; each measures its own paired vanilla timings), and finish
(``afterany:array``: best, held-out confirmation, best YAML, summary). The sbatch scripts and job
logs are written to ``<studies_dir>/<study>/slurm/``. With ``launcher.schedule`` a
self-resubmitting job runs the whole launch on a schedule instead, one study per run (its
``study_tag`` is the run date). ``tracking=server`` starts the MLflow server first when none
answers (it outlives this process).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from tuner.cluster import slurm
from tuner.config.validate import plain

PINNED = ("launcher", "phase", "study_name", "study_tag", "hydra")   # overrides we set ourselves


def _overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig
    try:
        given = list(HydraConfig.get().overrides.task)
    except ValueError:
        given = []
    return [o for o in given if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] not in PINNED]


def _tracking_server(cfg: DictConfig, say) -> None:
    tracking = plain(cfg.tracking)
    if tracking.get("kind") != "server" or not tracking.get("start", False):
        return
    from tuner.tracking.server import ServerSettings, ensure_server
    url, proc = ensure_server(ServerSettings.from_config(tracking))
    say(f"MLflow server at {url}" + (f" started (pid {proc.pid})" if proc else " answers"))


def launch(cfg: DictConfig, name: str, say) -> dict[str, Any]:
    """Submit the study's jobs (or its schedule); returns their ids."""
    settings = slurm.SlurmSettings.from_config(plain(cfg.launcher))
    if settings.workdir is None:
        from dataclasses import replace
        settings = replace(settings, workdir=str(Path.cwd()))
    base = [sys.executable, "-m", "tuner", *_overrides(), "launcher=local"]
    if settings.schedule:
        folder = Path(cfg.studies_dir) / f"{cfg.study_prefix}-scheduled"
        argv = [sys.executable, "-m", "tuner", *_overrides(), "launcher=slurm",
                "launcher.schedule=null", "study_tag=${oc.env:SPECTUNE_RUN_DATE}"]
        job, path = slurm.schedule_sweep(settings, folder, argv)
        say(f"scheduled: job {job} ({settings.schedule}) runs {path} and queues its successor; "
            f"see it with: squeue -j {job} -o '%i %S'   (stop the series: scancel {job})")
        return {"scheduled_job": job, "script": str(path)}
    _tracking_server(cfg, say)
    pinned = [*base, f"study_name={name}"]
    jobs = slurm.launch_sweep(settings, Path(cfg.studies_dir) / name, [*pinned, "phase=prepare"],
                              [*pinned, "phase=work"], [*pinned, "phase=finish"])
    folder = jobs.scripts["prepare"].parent
    say(f"study {name}: submitted prepare {jobs.prepare}, {settings.workers} workers "
        f"{jobs.workers}_[0-{settings.workers - 1}], finish {jobs.finish}; scripts and logs in "
        f"{folder}\n  watch: squeue -j {jobs.prepare},{jobs.workers},{jobs.finish}   summary: "
        f"{folder}/{settings.job_name}-finish_{jobs.finish}.out")
    say(f"jobs: prepare={jobs.prepare} workers={jobs.workers} finish={jobs.finish}")
    return {"study_name": name, "prepare": jobs.prepare, "workers": jobs.workers,
            "finish": jobs.finish, "scripts": {k: str(v) for k, v in jobs.scripts.items()}}
