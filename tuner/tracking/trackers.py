"""MLflow as a study listener: one parent run per study, one nested run per trial (started when
the trial starts, so durations are real) and one for the vanilla baseline.

Written with ``MlflowClient`` and explicit run ids (no "active run" global), so several workers of
one study log into the same parent: its run id is kept in the study (``mlflow_parent_run_id``)
and a resumed study keeps logging into it. Statuses are honest: a failed trial's run is FAILED,
an interrupted one KILLED, a pruned one FINISHED with ``state=PRUNED``, the parent FINISHED only
when the study finished. ``tracking=none`` uses the no-op ``Callback``.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import platform
import re
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

import torch
import transformers

from tuner.config.identity import short_hash
from tuner.study.callbacks import Callback, StudyResult, TrialOutcome
from tuner.tracking.report import markdown

PARENT_ATTR = "mlflow_parent_run_id"          # study attribute: the parent run
BASELINE_ATTR = "mlflow_baseline_run_id"      # study attribute: the baseline run (once per study)


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


SHARED_VIEW = "mlflow.sharedViewState."     # the UI's saved views: experiment tags, JSON
# the columns a study's view shows first: trial runs carry the first five, the study's parent
# run its held-out confirmation (best_*); then the searched parameters
VIEW_METRICS = ("speedup", "best_held_out_speedup", "decode_speedup", "tokens_per_s",
                "mean_accepted_tokens", "contended_prompts")


def view_state(study_name: str, param_names: list[str], objective: str = "speedup",
               direction: str = "maximize") -> dict[str, Any]:
    """The MLflow UI's view of one study (its search facets and table columns: the keys the
    UI reads from a shared view; column ids are ``metrics.`name``` / ``params.`name```): its
    runs, best first by the study's first ``objective`` (its column first)."""
    first = f"metrics.`{mlflow_name(objective)}`"
    columns = [first] + [c for c in (f"metrics.`{m}`" for m in VIEW_METRICS) if c != first] + \
        [f"params.`{mlflow_name(p)}`" for p in param_names]
    return {"searchFilter": f'tags.study_name = "{study_name}"', "orderByKey": first,
            "orderByAsc": direction == "minimize", "selectedColumns": columns,
            "columnOrder": columns}


class MlflowRuns:
    """Runs of one MLflow experiment, by explicit run id."""

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
        self.tracking_uri = tracking_uri
        self.parent_id: str | None = None

    def start(self, name: str, params: Mapping[str, Any], tags: Mapping[str, str],
              parent_id: str | None = None, start_ms: int | None = None) -> str:
        """A new RUNNING run (nested under ``parent_id`` when given); its id."""
        tags = {**tags, **({"mlflow.parentRunId": parent_id} if parent_id else {})}
        run = self.client.create_run(self.experiment_id, run_name=name, tags=dict(tags),
                                     start_time=start_ms)
        self._log(run.info.run_id, params=params)
        return run.info.run_id

    def end(self, run_id: str, metrics: Mapping[str, float], tags: Mapping[str, str],
            status: str = "FINISHED", table: list[dict] | None = None,
            files: list[tuple[str, Path]] = ()) -> None:
        """Log what the run measured, attach ``table``/``files``, and terminate it."""
        self._log(run_id, metrics=metrics, tags=tags)
        if table:
            self.client.log_text(run_id, json.dumps(table, indent=1), "measurements.json")
        for folder, path in files:
            self.client.log_artifact(run_id, str(path), folder)
        self.client.set_terminated(run_id, status)

    def _log(self, run_id: str, params: Mapping[str, Any] | None = None,
             metrics: Mapping[str, float] | None = None,
             tags: Mapping[str, str] | None = None) -> None:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.utils.time import get_current_time_millis
        now = get_current_time_millis()
        self.client.log_batch(
            run_id,
            metrics=[Metric(mlflow_name(k), float(v), now, 0)
                     for k, v in (metrics or {}).items()],
            params=[Param(mlflow_name(k), str(v)[:6000]) for k, v in (params or {}).items()],
            tags=[RunTag(mlflow_name(k), str(v)) for k, v in (tags or {}).items()])


def mlflow_name(key: str) -> str:
    """A metric/param/tag name MLflow accepts, the same way everywhere: ``@`` reads ``_at_``
    (``quality_pass@1`` -> ``quality_pass_at_1``, ``tokens_per_s@c4`` -> ``tokens_per_s_at_c4``),
    any other character outside MLflow's set (letters, digits, ``_ - . : /`` and space) is ``_``."""
    key = str(key).replace("@", "_at_")
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key)




class MlflowCallback(Callback):
    """The study's MLflow runs (see the module docstring)."""

    def __init__(self, runs: MlflowRuns, say=print) -> None:
        self.runs, self.say = runs, say
        self.study = self.settings = None
        self.parent_id: str | None = None
        self.trial_runs: dict[int, str] = {}       # trial number -> its run id
        self.started_ms: dict[int, int] = {}       # trial number -> when it started

    def study_started(self, settings, study, created) -> None:
        self.settings, self.study = settings, study
        self.parent_id = study.user_attrs.get(PARENT_ATTR)
        deadline = time.monotonic() + 30
        while self.parent_id is None and not created and time.monotonic() < deadline:
            time.sleep(0.5)                # the study's creator is about to record its parent
            self.parent_id = study.user_attrs.get(PARENT_ATTR)
        if self.parent_id is not None:
            self.runs.client.update_run(self.parent_id, status="RUNNING")
            return
        self.parent_id = self.runs.start(settings.name, study_params(settings),
                                         study_tags(settings))
        self.runs.client.log_text(self.parent_id, settings.config_yaml, "config.yaml")
        study.set_user_attr(PARENT_ATTR, self.parent_id)

    def trial_started(self, trial, params, stage) -> None:
        self.started_ms[trial.number] = int(time.time() * 1000)
        run_id = self.runs.start(f"trial-{trial.number}",
                                 {**params, **flatten("sampling", self.settings.sampling)},
                                 {"kind": "trial", "stage": stage, "trial": str(trial.number),
                                  "study_name": self.settings.name,
                                  # a study across methods: each child run tagged by its method
                                  **({"method": str(params["method"])} if "method" in params
                                     else {})}, self.parent_id)
        trial.set_user_attr("mlflow_run_id", run_id)
        self.trial_runs[trial.number] = run_id

    def trial_ended(self, trial, outcome: TrialOutcome) -> None:
        run_id = self.trial_runs.pop(trial.number, None)
        if run_id is None:
            return
        evaluation = outcome.evaluation
        tags = {"state": outcome.state, **outcome.tags}
        if outcome.error:
            tags["error"] = outcome.error[:500]
        if evaluation is None:
            self.runs.end(run_id, {}, tags, outcome.status)
            return
        table = [asdict(m) for m in evaluation.measurements] + \
            [{"vanilla": True, **asdict(r)} for r in evaluation.baselines]
        self.runs.end(run_id, evaluation.summary, tags, outcome.status, table)
        if evaluation.baselines and BASELINE_ATTR not in self.study.user_attrs:
            self._baseline(evaluation, self.started_ms.get(trial.number))

    def _baseline(self, evaluation, start_ms: int | None) -> None:
        """One 'baseline (vanilla)' run per study, speedup 1.0: the reference row, spanning the
        trial whose paired vanilla runs it holds."""
        run_id = self.runs.start("baseline (vanilla)", {"method": "vanilla"},
                                 {"kind": "baseline", "study_name": self.settings.name},
                                 self.parent_id, start_ms)
        self.runs.end(run_id, evaluation.baseline_summary, {"state": "COMPLETE"}, "FINISHED",
                      [asdict(r) for r in evaluation.baselines])
        self.study.set_user_attr(BASELINE_ATTR, run_id)

    def study_finished(self, result: StudyResult) -> None:
        if result.winner is not None:
            winner = next((t for t in self.study.get_trials(deepcopy=False)
                           if t.number == result.winner), None)
            run_id = winner.user_attrs.get("mlflow_run_id") if winner else None
            if run_id:              # "best" first: readable in the narrowest name column
                self.runs.client.set_tag(run_id, "winner", "true")
                self.runs.client.update_run(run_id, name=f"best: trial-{result.winner}")
            self.runs.client.set_tag(self.parent_id, "best_trial", str(result.winner))
        note = markdown(result.rows, result.advice) + "\n\n" + trials_markdown(result.table)
        self.runs.end(self.parent_id, result.metrics,
                      {**result.tags, "mlflow.note.content": note}, "FINISHED",
                      files=result.files)
        if result.table:
            self.runs.client.log_text(self.parent_id, trials_csv(result.table), "trials.csv")
        self.say(f"MLflow: experiment {self.settings.tracking['experiment']!r}, study run "
                 f"{self.parent_id} in {self.runs.tracking_uri}; its runs, best first: "
                 f"{self.link()}")

    def link(self) -> str:
        """The experiment's runs table for this study: its runs only, best first by the first
        objective, with the columns that matter shown (``view_state``). The view is saved the
        way the UI's own Share button saves one, as the experiment tag
        ``mlflow.sharedViewState.<key>``, and the address names its key (MLflow 3 opens the
        GenAI view unless ``workflowType=machine_learning`` is in the address); a tag refused
        gives the filtered, sorted address without the columns."""
        from mlflow.exceptions import MlflowException
        s = self.settings
        view = view_state(s.name, list(s.space), s.objectives[0], s.directions[0])
        state = json.dumps(view, sort_keys=True)
        key = hashlib.sha256(state.encode()).hexdigest()[:32]
        base = self.runs.tracking_uri if self.runs.tracking_uri.startswith("http") else \
            "http://127.0.0.1:5000"
        runs = f"{base}/#/experiments/{self.runs.experiment_id}/runs?workflowType=machine_learning"
        try:
            self.runs.client.set_experiment_tag(self.runs.experiment_id, f"{SHARED_VIEW}{key}",
                                                state)
        except (MlflowException, OSError) as error:     # the study's end must not fail here
            self.say(f"MLflow: the study's view was not saved ({error}); the link filters and "
                     "sorts only")
            from urllib.parse import quote
            return (f"{runs}&searchFilter={quote(view['searchFilter'])}"
                    f"&orderByKey={quote(view['orderByKey'])}"
                    f"&orderByAsc={str(view['orderByAsc']).lower()}")
        return f"{runs}&viewStateShareKey={key}"

    def study_ended(self, status: str) -> None:
        if self.parent_id is not None and status != "FINISHED":
            self.runs.client.set_terminated(self.parent_id, status)


def study_params(settings) -> dict[str, str]:
    """The parent run's params: what the study measured and how."""
    return {"task": settings.task.name, "method": settings.method["_target_"],
            "search": settings.search["kind"], "baseline": settings.baseline,
            "fingerprint": short_hash(settings.fingerprint),
            **flatten("budget", settings.budget), **flatten("sampling", settings.sampling),
            **flatten("models", settings.models), **flatten("params", settings.default),
            "lossless": settings.lossless, "search.objectives": json.dumps(list(
                settings.objectives)),
            **flatten("search", {k: settings.search.get(k) for k in
                                 ("max_quality_drop", "max_perplexity_ratio")})}


def study_tags(settings) -> dict[str, str]:
    from tuner.config.identity import hardware
    from tuner.measure.energy import EnergyMeter
    return {"study_name": settings.name, "kind": "study", "hardware": hardware(settings.device),
            "energy": EnergyMeter(settings.device).reason or "nvml",
            **environment_tags(settings.device)}


def trials_markdown(table: list[dict], top: int = 15) -> str:
    """The trials, best first, as a compact markdown table (the parent run's description)."""
    if not table:
        return ""
    keys = _columns(table)
    lines = [f"**Trials (best {min(top, len(table))} of {len(table)}; all in trials.csv)**", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in table[:top]]
    return "\n".join(lines)


def _columns(table: list[dict]) -> list[str]:
    """Every row's keys in first-seen order (conditional parameters appear in some rows only)."""
    return list(dict.fromkeys(key for row in table for key in row))


def trials_csv(table: list[dict]) -> str:
    import csv
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=_columns(table))
    writer.writeheader()
    writer.writerows(table)
    return out.getvalue()


def make_tracker(cfg: Mapping[str, Any], say=print) -> Callback:
    """``tracking.kind``: mlflow / server (an MLflow listener) or none (the no-op listener)."""
    if cfg.get("kind") in ("mlflow", "server"):
        return MlflowCallback(MlflowRuns(cfg["tracking_uri"], cfg.get("artifact_root"),
                                         cfg["experiment"]), say)
    if cfg.get("kind") == "none":
        return Callback()
    raise ValueError(f"tracking.kind={cfg.get('kind')!r} is unknown: allowed are mlflow, none")


def start_replay(settings, origin: Mapping[str, Any]) -> tuple[MlflowRuns, str] | None:
    """``+best=``: a top-level MLflow run for the replay, started now so its duration is real."""
    listener = make_tracker(settings.tracking)
    if not isinstance(listener, MlflowCallback):
        return None
    runs = listener.runs
    run_id = runs.start(f"replay-{origin['study']}",
                        {"replay_of": origin["study"], "trial": origin["trial"],
                         **flatten("params", settings.default),
                         **flatten("budget", settings.budget)},
                        {"kind": "replay", **environment_tags(settings.device)})
    runs.client.log_text(run_id, settings.config_yaml, "config.yaml")
    return runs, run_id


def end_replay(handle: tuple[MlflowRuns, str] | None, metrics: Mapping[str, float],
               description: str, status: str = "FINISHED") -> None:
    if handle is not None:
        runs, run_id = handle
        runs.end(run_id, metrics, {"mlflow.note.content": description}, status)
