"""Experiment tracking: one MLflow parent run per study, one nested run per trial (started when the
trial starts, so durations are real) and one for the vanilla baseline.

Written with ``MlflowClient`` and explicit run ids (no "active run" global), so several workers of
one study can log into the same parent. The parent's run id is stored in the study
(``mlflow_parent_run_id``); a resumed study keeps logging into it. Statuses are honest: a failed
trial's run is FAILED, an interrupted one KILLED, the parent FINISHED only when the study finished.
``NullTracker`` has the same methods and does nothing (``tracking=none``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch
import transformers


class NullTracker:
    parent_id: str | None = None

    def start_study(self, study_name: str, parent_id: str | None, params: Mapping[str, Any],
                    tags: Mapping[str, str], config_yaml: str) -> str | None:
        return None

    def start_run(self, name: str, params: Mapping[str, Any], tags: Mapping[str, str]
                  ) -> str | None:
        return None

    def end_run(self, run_id: str | None, metrics: Mapping[str, float], tags: Mapping[str, str],
                status: str = "FINISHED", table: list[dict] | None = None) -> None: ...

    def mark_winner(self, run_id: str | None, trial_number: int) -> None: ...

    def finish_study(self, metrics: Mapping[str, float], tags: Mapping[str, str],
                     description: str, files: list[tuple[str, Path]], status: str = "FINISHED"
                     ) -> None: ...

    def end_study(self, status: str) -> None: ...


def environment_tags(device: torch.device) -> dict[str, str]:
    tags = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": str(device)}
    try:
        tags["git_commit"] = subprocess.run(   # of this code, wherever the study runs from
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        tags["git_commit"] = "unknown"
    if device.type == "cuda":
        tags["gpu"] = torch.cuda.get_device_name(device)
        try:
            import pynvml
            pynvml.nvmlInit()
            tags["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        except Exception:   # noqa: BLE001 - a missing driver version is not worth a failure
            tags["driver"] = "unknown"
    else:
        tags["cpu"] = platform.processor() or platform.machine()
    return tags


def flatten(prefix: str, value: Any) -> dict[str, str]:
    """``{"models": {"target": {"kind": "tiny"}}}`` → ``{"models.target.kind": "tiny"}``."""
    if isinstance(value, Mapping):
        out: dict[str, str] = {}
        for key, item in value.items():
            out.update(flatten(f"{prefix}.{key}" if prefix else str(key), item))
        return out
    return {prefix: json.dumps(value) if isinstance(value, (list, tuple)) else str(value)}


class MlflowTracker:
    def __init__(self, tracking_uri: str, artifact_root: str | None, experiment: str) -> None:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        logging.getLogger("mlflow").setLevel(logging.WARNING)    # schema set-up chatter

        if tracking_uri.startswith("sqlite:///"):   # absolute: MLflow caches stores by URI
            db = Path(tracking_uri[len("sqlite:///"):]).resolve()
            db.parent.mkdir(parents=True, exist_ok=True)
            tracking_uri = f"sqlite:///{db}"
        # one process at a time creates the SQLite schema and the experiment (two fresh runs in
        # one folder otherwise race in MLflow's database set-up)
        lock_dir = Path(tracking_uri[len("sqlite:///"):]).parent \
            if tracking_uri.startswith("sqlite:///") else Path(tempfile.gettempdir())
        with open(lock_dir / ".spectune-mlflow.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.client = MlflowClient(tracking_uri=tracking_uri)
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                location = (Path(artifact_root).resolve() / experiment).as_uri() \
                    if artifact_root else None
                try:   # a model-training experiment: the UI opens on the runs table
                    self.experiment_id = self.client.create_experiment(
                        experiment, artifact_location=location,
                        tags={"mlflow.experimentKind": "custom_model_development"})
                except MlflowException:
                    self.experiment_id = self.client.get_experiment_by_name(
                        experiment).experiment_id
            else:
                self.experiment_id = found.experiment_id
        self.parent_id: str | None = None

    # -- the study's parent run -----------------------------------------------------------------

    def start_study(self, study_name, parent_id, params, tags, config_yaml) -> str:
        if parent_id is not None:
            self.parent_id = parent_id
            self.client.update_run(parent_id, status="RUNNING")
            return parent_id
        run = self.client.create_run(self.experiment_id, run_name=study_name,
                                     tags={"study_name": study_name, "kind": "study", **tags})
        self.parent_id = run.info.run_id
        self._log(self.parent_id, params=params)
        self.client.log_text(self.parent_id, config_yaml, "config.yaml")
        return self.parent_id

    def finish_study(self, metrics, tags, description, files, status="FINISHED") -> None:
        self._log(self.parent_id, metrics=metrics,
                  tags={**tags, "mlflow.note.content": description})
        for folder, path in files:
            self.client.log_artifact(self.parent_id, str(path), folder)
        self.client.set_terminated(self.parent_id, status)

    def end_study(self, status: str) -> None:
        if self.parent_id is not None:
            self.client.set_terminated(self.parent_id, status)

    # -- trial and baseline runs -----------------------------------------------------------------

    def start_run(self, name, params, tags) -> str:
        run = self.client.create_run(self.experiment_id, run_name=name,
                                     tags={"mlflow.parentRunId": self.parent_id, **tags})
        self._log(run.info.run_id, params=params)
        return run.info.run_id

    def end_run(self, run_id, metrics, tags, status="FINISHED", table=None) -> None:
        if run_id is None:
            return
        self._log(run_id, metrics=metrics, tags=tags)
        if table:
            self.client.log_text(run_id, json.dumps(table, indent=1), "measurements.json")
        self.client.set_terminated(run_id, status)

    def mark_winner(self, run_id, trial_number) -> None:
        if run_id is None:
            return
        self.client.set_tag(run_id, "winner", "true")
        self.client.update_run(run_id, name=f"trial-{trial_number} (best)")
        self.client.set_tag(self.parent_id, "best_trial", str(trial_number))

    def _log(self, run_id: str, params: Mapping[str, Any] | None = None,
             metrics: Mapping[str, float] | None = None,
             tags: Mapping[str, str] | None = None) -> None:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.utils.time import get_current_time_millis
        now = get_current_time_millis()
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()],
            params=[Param(k, str(v)[:6000]) for k, v in (params or {}).items()],
            tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()])


def make_tracker(cfg: Mapping[str, Any]) -> NullTracker | MlflowTracker:
    if cfg.get("kind") in ("mlflow", "server"):
        return MlflowTracker(cfg["tracking_uri"], cfg.get("artifact_root"), cfg["experiment"])
    if cfg.get("kind") == "none":
        return NullTracker()
    raise ValueError(f"tracking.kind={cfg.get('kind')!r} is unknown: allowed are mlflow, none")
