"""Experiment tracking: one MLflow parent run per study, one nested run per trial and one for the
vanilla baseline. ``NullTracker`` has the same methods and does nothing (``tracking=none``).

The parent run is found again by its ``study_name`` tag, so a resumed study keeps logging into it.
"""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any, Mapping

import torch
import transformers


class NullTracker:
    def start_study(self, study_name: str, params: Mapping[str, Any], config_yaml: str,
                    device: torch.device) -> None: ...
    def log_run(self, name: str, params: Mapping[str, Any], metrics: Mapping[str, float],
                tags: Mapping[str, str], table: list[dict] | None = None) -> str | None: ...
    def log_best(self, metrics: Mapping[str, float], params: Mapping[str, Any],
                 figures: Mapping[str, Any], files: Mapping[str, Path]) -> None: ...
    def close(self) -> None: ...


def environment_tags(device: torch.device) -> dict[str, str]:
    tags = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": str(device)}
    try:
        tags["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                            text=True, check=True).stdout.strip()
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


class MlflowTracker:
    def __init__(self, tracking_uri: str, artifact_root: str | None, experiment: str) -> None:
        import mlflow

        self.mlflow = mlflow
        Path("mlruns").mkdir(exist_ok=True)
        mlflow.set_tracking_uri(tracking_uri)
        found = mlflow.get_experiment_by_name(experiment)
        if found is None and artifact_root is None:   # a tracking server stores artifacts itself
            mlflow.create_experiment(experiment)
        elif found is None:
            location = Path(artifact_root).resolve() / experiment
            mlflow.create_experiment(experiment, artifact_location=location.as_uri())
        mlflow.set_experiment(experiment)
        self.parent = None

    def start_study(self, study_name, params, config_yaml, device) -> None:
        mlflow = self.mlflow
        previous = mlflow.search_runs(filter_string=f"tags.study_name = '{study_name}' and "
                                                    "tags.kind = 'study'", output_format="list")
        if previous:
            self.parent = mlflow.start_run(run_id=previous[0].info.run_id)
        else:
            self.parent = mlflow.start_run(run_name=study_name)
            mlflow.log_params(params)
            mlflow.set_tags({"study_name": study_name, "kind": "study",
                             **environment_tags(device)})
            mlflow.log_text(config_yaml, "config.yaml")

    def log_run(self, name, params, metrics, tags, table=None) -> str | None:
        with self.mlflow.start_run(run_name=name, nested=True) as run:
            self.mlflow.log_params(dict(params))
            self.mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
            self.mlflow.set_tags(dict(tags))
            if table:
                self.mlflow.log_text(json.dumps(table, indent=1), "measurements.json")
            return run.info.run_id

    def log_best(self, metrics, params, figures, files) -> None:
        self.mlflow.log_metrics({f"best_{k}": float(v) for k, v in metrics.items()})
        self.mlflow.log_params({f"best_{k}": v for k, v in params.items()})
        for name, figure in figures.items():
            self.mlflow.log_figure(figure, f"plots/{name}.html")
        for name, path in files.items():
            self.mlflow.log_artifact(str(path), name)

    def close(self) -> None:
        if self.mlflow.active_run() is not None:
            self.mlflow.end_run()


def make_tracker(cfg: Mapping[str, Any]) -> NullTracker | MlflowTracker:
    if cfg.get("kind") == "mlflow":
        return MlflowTracker(cfg["tracking_uri"], cfg["artifact_root"], cfg["experiment"])
    if cfg.get("kind") == "server":   # started (if needed) by the launcher: tuner/mlflow_server.py
        return MlflowTracker(cfg["tracking_uri"], None, cfg["experiment"])
    if cfg.get("kind") == "none":
        return NullTracker()
    raise ValueError(f"tracking kind={cfg.get('kind')!r} is unknown: "
                     "allowed are mlflow, server, none")
