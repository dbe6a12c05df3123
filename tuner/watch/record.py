"""The watch's record: a JSON Lines log (one object per window and per event) and an MLflow run
under the study's experiment (time series per window: acceptance per position, live batch, time
per output token, the predicted speedup of each k, the change test and its alarms)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tuner.tracking.trackers import MlflowRuns


class JsonLog:
    """One JSON object per line, flushed as written (a killed watch keeps what it saw)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.out = path.open("a")

    def write(self, kind: str, body: Mapping[str, Any]) -> None:
        self.out.write(json.dumps({"kind": kind, **body}, default=str) + "\n")
        self.out.flush()

    def close(self) -> None:
        self.out.close()


def experiment_of(tracking_uri: str, run_id: str | None, fallback: str) -> str:
    """The experiment of the study's MLflow run (``run_id``) where this store has it, else
    ``fallback`` (the study's task: the tracker's default experiment)."""
    if not run_id:
        return fallback
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    try:
        client = MlflowClient(tracking_uri=tracking_uri)
        return client.get_experiment(client.get_run(run_id).info.experiment_id).name
    except MlflowException:
        return fallback


class WatchRun:
    """The MLflow run of one watch (``tracking_uri`` like ``tracking.tracking_uri``)."""

    def __init__(self, tracking_uri: str, experiment: str, name: str,
                 params: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        self.runs = MlflowRuns(tracking_uri, None, experiment)
        self.run_id = self.runs.start(name, params, {"kind": "watch", **tags})
        self.experiment = experiment

    def window(self, step: int, at: float, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric
        millis = int(at * 1000)
        self.runs.client.log_batch(self.run_id, metrics=[
            Metric(k, float(v), millis, step) for k, v in metrics.items()])

    def end(self, summary: Mapping[str, float], note: str, files: list[Path],
            status: str = "FINISHED") -> None:
        self.runs.end(self.run_id, summary, {"mlflow.note.content": note}, status,
                      files=[("watch", p) for p in files if p.is_file()])
