"""What happens in a study, told to whoever listens: MLflow, the console, a test.

The optimize loop and the finish step call a ``Callbacks`` fan-out at fixed points; each
listener subclasses ``Callback`` and overrides the events it cares about (the others are no-ops):

    study_started(settings, study, created)      the study is open (created now or resumed)
    trial_started(trial, params, stage)          a trial holds its point; the timed work begins
    prompt_measured(trial, done, total, pair)    one prompt pair measured (progress)
    trial_ended(trial, outcome)                  COMPLETE / PRUNED / FAIL, with its evaluation
    study_finished(result)                       the winner, its confirmation, the summary
    study_ended(status)                          FINISHED / FAILED / KILLED (always called)

Listeners only record; they never change the study's course.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    import optuna

    from tuner.measure.evaluator import Evaluation, Paired
    from tuner.study.settings import StudySettings


@dataclass(frozen=True)
class TrialOutcome:
    """How a trial ended."""

    state: str                          # COMPLETE | PRUNED | FAIL
    status: str                         # MLflow run status: FINISHED | FAILED | KILLED
    evaluation: Evaluation | None = None
    error: str | None = None            # FAIL: "<Exception>: message"
    kind: str = ""                      # FAIL: config | error | interrupted | lossless
    tags: Mapping[str, str] = field(default_factory=dict)   # feasible, vanilla_drift, ...


@dataclass(frozen=True)
class StudyResult:
    """What the finish step concluded (written to the terminal, MLflow and the best YAML)."""

    rows: list[tuple[str, str]]         # the summary table
    advice: str                         # the recommendation
    metrics: dict[str, float]           # best_* and study-level numbers
    tags: dict[str, str]
    files: list[tuple[str, Path]] = field(default_factory=list)   # (artifact folder, file)
    winner: int | None = None           # the winning trial's number
    table: list[dict] = field(default_factory=list)   # one row per trial, best first


class Callback:
    """A listener; every event is a no-op unless overridden."""

    def study_started(self, settings: StudySettings, study: optuna.Study, created: bool) -> None:
        """The study is open."""

    def trial_started(self, trial: optuna.Trial, params: Mapping[str, Any], stage: str) -> None:
        """A trial holds its point."""

    def prompt_measured(self, trial: optuna.Trial, done: int, total: int, pair: Paired) -> None:
        """One prompt pair is measured."""

    def trial_ended(self, trial: optuna.Trial, outcome: TrialOutcome) -> None:
        """The trial was told to Optuna."""

    def study_finished(self, result: StudyResult) -> None:
        """The finish step concluded."""

    def study_ended(self, status: str) -> None:
        """The process leaves the study (FINISHED, FAILED or KILLED)."""


class Callbacks(Callback):
    """Fans every event out to several listeners, in order."""

    def __init__(self, listeners: Sequence[Callback]) -> None:
        self.listeners = list(listeners)

    def study_started(self, settings, study, created) -> None:
        for c in self.listeners:
            c.study_started(settings, study, created)

    def trial_started(self, trial, params, stage) -> None:
        for c in self.listeners:
            c.trial_started(trial, params, stage)

    def prompt_measured(self, trial, done, total, pair) -> None:
        for c in self.listeners:
            c.prompt_measured(trial, done, total, pair)

    def trial_ended(self, trial, outcome) -> None:
        for c in self.listeners:
            c.trial_ended(trial, outcome)

    def study_finished(self, result) -> None:
        for c in self.listeners:
            c.study_finished(result)

    def study_ended(self, status) -> None:
        for c in self.listeners:
            c.study_ended(status)
