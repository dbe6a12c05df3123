"""``StudyOutcome``: what a finished study concluded, as one typed record.

The finish step (``tuner.answer.finish``) makes every decision once, from the study's data, and
returns this record; the summary table, the console, the MLflow parent run, the best YAML and
``outcome.json`` only *render* it (``tuner.tracking.render``). Nothing reads a decision back from
text.

``outcome.json`` (beside the best YAML, ``OUTCOME_VERSION``) is the contract for readers outside
the study, such as a watch over a running deployment: per level and per rate the decision and the
setting it deploys, the winner's acceptance per draft position with its draft counts, the engine
and its build, the profile used, each trial's state and stage (why it stopped), and the
search's estimated against spent seconds.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Mapping

OUTCOME_VERSION = 1


class State(str, enum.Enum):
    """A level's or rate's decision."""

    ON = "ON"                        # the tuning trial there and the held-out winner beat vanilla
    OFF = "OFF"                      # one of them did not
    NOT_CONFIRMED = "NOT_CONFIRMED"  # tuning favours a setting; no held-out figure there


@dataclass(frozen=True)
class Decision:
    """Speculation on or off at one concurrency level or request rate, and why."""

    kind: str                           # "level" | "rate"
    at: str                             # the level ("4") or the rate ("0.5"), as figures name it
    state: State
    params: Mapping[str, Any] | None    # the setting to run there (None: speculation off)
    trial: int                          # the tuning trial whose figures it rests on
    tuning: float                       # that trial's figure there (ratio, or gain over vanilla)
    held_out: float | None              # the held-out winner's figure there (None: not measured)
    reason: str                         # the summary's line, written once from the figures above

    @property
    def label(self) -> str:
        return f"concurrency {self.at}" if self.kind == "level" else f"request rate {self.at}/s"

    @property
    def deployed(self) -> Mapping[str, Any] | None:
        """The setting a deployment runs there: the chosen one where tuning favours it (ON, or
        NOT_CONFIRMED, labelled so), else None (speculation off)."""
        return None if self.state is State.OFF else self.params


@dataclass(frozen=True)
class Winner:
    """The best feasible trial."""

    trial: int
    value: float                        # its first objective on the tuning prompts
    trials: int                         # completed trials when it was chosen
    run_id: str | None                  # its MLflow run
    params: Mapping[str, Any]           # every parameter that built it
    shown: Mapping[str, Any]            # the active searched ones (what the summary shows)
    figures: Mapping[str, Any]          # its tuning summary (TrialRecord figures, feasible)


@dataclass(frozen=True)
class Prediction:
    """What prediction added to the study (each None where it did not run)."""

    calibration: Mapping[str, Any] | None = None     # predicted vs measured over trials
    calibration_line: str | None = None
    profile_check: str | None = None                  # the profile checked against trial 0
    profile: str | None = None                        # the profile used (search.profile)
    served: Mapping[str, Any] | None = None           # the per-level plan (tuner.study.level_plan)
    elsewhere: Mapping[str, Any] | None = None        # search.predict_for's answer


@dataclass(frozen=True)
class StudyOutcome:
    """What the finish step concluded (module docstring). ``winner`` None: no feasible trial."""

    study: str
    method: str
    task: str
    objective: str
    engine: Mapping[str, Any]                  # kind, build and what it ran with
    winner: Winner | None
    confirmed: Mapping[str, float]             # held_out_* figures ({}: no held-out prompts)
    levels: tuple[Decision, ...] = ()
    rates: tuple[Decision, ...] = ()
    deploy: Mapping[str, Any] = field(default_factory=dict)     # nested data, never JSON text
    prediction: Prediction = field(default_factory=Prediction)
    recommendation: str = ""
    notes: tuple[str, ...] = ()
    acceptance: Mapping[str, Any] = field(default_factory=dict)  # per draft position (held-out)
    summary: tuple[tuple[str, str], ...] = ()  # the table's head rows where no trial won
    budget: Mapping[str, Any] = field(default_factory=dict)      # the task sizes and trials
    energy_reason: str = ""                    # why no energy was measured ("" where it was)
    quality_bound: str | None = None           # the bound's description (lossy methods, bounds)
    time: str = ""                             # where the search's time went
    cost: Mapping[str, Any] = field(default_factory=dict)   # estimated and spent seconds
    trials: tuple[Mapping[str, Any], ...] = ()  # one row per trial, best first
    metrics: Mapping[str, float] = field(default_factory=dict)   # study-level numbers
    replay: Mapping[str, Any] = field(default_factory=dict)      # the best YAML's replay body
    replay_header: str = ""
    best_path: Path | None = None
    plots: tuple[Path, ...] = ()
    feasible: bool = True                      # False: every trial broke the quality bound
    methods: tuple[Mapping[str, Any], ...] = ()  # a cross-method study: per method, best first

    @property
    def confirmed_any(self) -> bool:
        """Held-out prompts measured the winner (without them nothing is a recommendation)."""
        return bool(self.confirmed)

    @property
    def decisions(self) -> tuple[Decision, ...]:
        return self.levels + self.rates

    @property
    def outcome_path(self) -> Path:
        """``<study>.outcome.json`` beside the best YAML."""
        assert self.best_path is not None
        return self.best_path.with_suffix(".outcome.json")

    def to_json(self) -> dict[str, Any]:
        """The versioned ``outcome.json`` body (plain JSON types only)."""
        winner = None if self.winner is None else {
            "trial": self.winner.trial, "value": self.winner.value, "params":
            dict(self.winner.params), "run_id": self.winner.run_id}
        return plain({
            "version": OUTCOME_VERSION, "study": self.study, "method": self.method,
            "task": self.task, "objective": self.objective, "engine": self.engine,
            "winner": winner, "confirmed": self.confirmed, "recommendation": self.recommendation,
            "decisions": [{"kind": d.kind, "at": d.at, "state": d.state.value,
                           "deployed": d.deployed, "params": d.params, "trial": d.trial,
                           "tuning": d.tuning,
                           "held_out": d.held_out, "reason": d.reason} for d in self.decisions],
            "deploy": self.deploy, "acceptance": self.acceptance,
            "prediction": {"profile": self.prediction.profile,
                           "calibration": self.prediction.calibration,
                           "profile_check": self.prediction.profile_check},
            "cost": self.cost, "trials": list(self.trials), "notes": list(self.notes),
            "feasible": self.feasible,
            **({"methods": list(self.methods)} if self.methods else {})})

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> StudyOutcome:
        """The record ``to_json`` wrote (``OUTCOME_VERSION``; ValueError for another version or
        a body that is not one): ``to_json(from_json(body)) == body``. A decision written
        before ``params`` was recorded carries its deployed setting (None where OFF)."""
        if not isinstance(body, Mapping):
            raise ValueError(f"not a JSON object (a {type(body).__name__})")
        if body.get("version") != OUTCOME_VERSION:
            raise ValueError(f"outcome version {body.get('version')!r} is not "
                             f"{OUTCOME_VERSION}, the one this tuner reads")
        try:
            won = body.get("winner")
            # trials, shown and figures are not in the file: 0 and empty (unknown)
            winner = None if won is None else Winner(
                trial=int(won["trial"]), value=float(won["value"]), trials=0,
                run_id=won.get("run_id"), params=dict(won.get("params") or {}), shown={},
                figures={})
            decisions = [Decision(
                kind=str(d["kind"]), at=str(d["at"]), state=State(d["state"]),
                params=d.get("params", d.get("deployed")), trial=int(d["trial"]),
                tuning=float(d["tuning"]),
                held_out=None if d.get("held_out") is None else float(d["held_out"]),
                reason=str(d.get("reason") or "")) for d in body.get("decisions") or []]
            prediction = body.get("prediction") or {}
            calibration = prediction.get("calibration")
            if calibration is not None and not isinstance(calibration, Mapping):
                raise TypeError(f"prediction.calibration is a {type(calibration).__name__}")
            return cls(
                study=str(body["study"]), method=str(body["method"]), task=str(body["task"]),
                objective=str(body["objective"]), engine=dict(body.get("engine") or {}),
                winner=winner, confirmed=dict(body.get("confirmed") or {}),
                levels=tuple(d for d in decisions if d.kind == "level"),
                rates=tuple(d for d in decisions if d.kind == "rate"),
                deploy=dict(body.get("deploy") or {}),
                prediction=Prediction(calibration=calibration,
                                      profile_check=prediction.get("profile_check"),
                                      profile=prediction.get("profile")),
                recommendation=str(body.get("recommendation") or ""),
                notes=tuple(body.get("notes") or ()),
                acceptance=dict(body.get("acceptance") or {}), cost=dict(body.get("cost") or {}),
                trials=tuple(body.get("trials") or ()), feasible=bool(body.get("feasible", True)),
                methods=tuple(dict(m) for m in body.get("methods") or ()))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"not a study outcome of version {OUTCOME_VERSION} "
                             f"({type(err).__name__}: {err})") from None

    @property
    def deployed_params(self) -> Mapping[str, Any] | None:
        """The setting the deployment runs: the winner's (the launch line's), None without one."""
        return None if self.winner is None else self.winner.params


def plain(value: Any) -> Any:
    """``value`` as JSON types: dataclasses and mappings as objects, tuples as lists, enums by
    value, paths as text; keys as text (JSON's own rule)."""
    if isinstance(value, enum.Enum):
        return value.value
    if is_dataclass(value) and not isinstance(value, type):
        return plain(asdict(value))
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and value != value:
        return None
    return value


def read_outcome(path: Path) -> StudyOutcome:
    """An ``outcome.json`` as its record (``StudyOutcome.from_json``); one clear ValueError for
    another version or a file that is not one."""
    try:
        body = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    try:
        return StudyOutcome.from_json(body)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
