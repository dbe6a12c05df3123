"""The objective: a trial's point → every parameter → the evaluator → the objective values.

Per trial the tuning prompts are shuffled (seeded by the study seed and the trial number), measured
pair by pair by the evaluator, and — when the pruner is fed (``objectives`` is ``[speedup]`` or
``[decode_speedup]``) — each pair's paired value is reported at the prompt's study index. When the
pruner says stop, the measured prompts are still assessed and recorded, and ``Pruned`` (an
``optuna.TrialPruned``) is raised: the trial ends PRUNED, with Optuna's last reported value, and
is never the winner.
The objective records on the trial what the report reads later (summary keys, constraints,
feasibility, drift, contention) and sets the quality constraints with ``Trial.set_constraint``.
``after_default(trial, pairs)`` runs once the default (stage ``default``, trial 0) is measured,
before its assessment (``tuner.search.ranking``: the profile's check, search=predict's ranking).
With a ranker (``tuner.predict.ranker``; the in-process engine's), each trial's prediction by the
profile (``search.profile``, ``search.predict_for``) is added to its summary after assessment.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import optuna

from tuner.config.identity import hardware, short_hash
from tuner.measure.quality import feasible
from tuner.search.objectives import objective_values
from tuner.study.record import TrialRecord

if TYPE_CHECKING:
    from tuner.measure.evaluator import Evaluation, Evaluator, Paired
    from tuner.predict.ranker import Ranker
    from tuner.study.settings import StudySettings
    from tuner.tasks.task import Prompt


@dataclass(frozen=True)
class TrialResult:
    """What a finished evaluation tells the optimizer and the listeners."""

    values: list[float]                # one per objective, in search.objectives' order
    evaluation: Evaluation
    tags: dict[str, str]               # for the trial's run: vanilla_drift, feasible, ...


class Pruned(optuna.TrialPruned):
    """The pruner stopped the trial; carries what was measured until then."""

    def __init__(self, result: TrialResult, after: int) -> None:
        super().__init__(f"pruned after {after} prompts")
        self.result = result


class StudyAttr:
    """A value kept as a study user attribute (the evaluator's ``BaselineStore``)."""

    def __init__(self, study: optuna.Study, key: str) -> None:
        self.study, self.key = study, key

    def get(self) -> Any:
        return self.study.user_attrs.get(self.key)

    def put(self, value: Any) -> None:
        self.study.set_user_attr(self.key, value)


def shared_order(settings: StudySettings) -> list[tuple[int, Prompt]]:
    """The tuning prompts with their study indices in one order seeded by the study seed alone:
    every trial of a method that may carry history across prompts measures them so, and
    ``search=predict``'s ranking runs every method in it (a trial then reuses its run)."""
    order = list(enumerate(settings.tuning))
    random.Random(f"{settings.seed}-shared").shuffle(order)
    return order


def prompt_order(settings: StudySettings, trial_number: int) -> list[tuple[int, Prompt]]:
    """A trial's order of the tuning prompts: shuffled per trial (seeded by the study seed and
    the trial number), or the shared order for a method whose history may carry across
    prompts (a ``keeps_history`` that is not plainly False: Ouroboros decides it per instance)."""
    if settings.engine_object.own_loops and settings.method_class.keeps_history is not False:
        return shared_order(settings)
    order = list(enumerate(settings.tuning))
    random.Random(f"{settings.seed}-{trial_number}").shuffle(order)
    return order


class Objective:
    """Measures one trial's point with the evaluator; see the module docstring."""

    def __init__(self, settings: StudySettings, evaluator: Evaluator, study: optuna.Study,
                 progress: Callable[[optuna.Trial, int, int, Paired], None],
                 after_default: Callable[[optuna.Trial, list[Paired]], None] | None = None,
                 ranker: Ranker | None = None) -> None:
        self.settings, self.evaluator, self.study = settings, evaluator, study
        self.progress, self.after_default, self.ranker = progress, after_default, ranker
        # one per-request speedup objective: each pair's value is reported to the pruner
        self.fed = settings.objectives[0] if list(settings.objectives) in (
            ["speedup"], ["decode_speedup"]) else None

    def __call__(self, trial: optuna.Trial, params: Mapping[str, Any]) -> TrialResult:
        s = self.settings
        order = prompt_order(s, trial.number)
        store = StudyAttr(self.study, "baseline") if s.baseline == "per_study" else None
        pairs, pruned, reported = [], False, set()
        total = sum(-(-len(order) // c) * c for c in s.concurrency)   # cycled batches
        for done, pair in enumerate(self.evaluator.measure(params, order, trial.number, store),
                                    1):
            pairs.append(pair)
            self.progress(trial, done, total, pair)
            value = getattr(pair.method, self.fed) if self.fed else None
            if value is not None and pair.index not in reported:   # a cycled prompt: once
                reported.add(pair.index)
                trial.report(value, step=pair.index)
                if done < total and trial.should_prune():
                    pruned = True
                    break
        if not pruned and self.after_default is not None and \
                trial.user_attrs.get("stage") == "default":
            self.after_default(trial, pairs)
        evaluation = self.evaluator.assess(pairs)
        if self.ranker is not None:     # search.profile / predict_for: the trial's prediction
            evaluation.summary.update(self.ranker.trial_prediction(params, pairs))
        result = self._record(trial, evaluation)
        if pruned:
            TrialRecord(pruned_at=len(pairs)).write(trial)
            raise Pruned(result, len(pairs))
        return result

    def _record(self, trial: optuna.Trial, evaluation: Evaluation) -> TrialResult:
        """Drift, constraints and the numbers the report reads, set on the trial as its
        ``TrialRecord``."""
        summary = evaluation.summary
        summary.update(self._drift(summary))
        described = self.evaluator.describe()
        tags = {"energy": described.get("energy", "nvml")}
        if "compiled" in described:       # engine=hf: eager, or the compiled target's settings
            tags["compiled"] = described["compiled"]
        constraints = self.settings.bound.constraints(summary, self.settings.lossless)
        for key, value in constraints.items():       # Optuna 5: read by TPE, NSGA-II, GP
            trial.set_constraint(key, value)
        ok = feasible(constraints) if constraints else None
        if ok is not None:
            summary["feasible"] = float(ok)
            tags["feasible"] = str(ok).lower()
        drifted = abs(summary.get("vanilla_drift_ratio", 1.0) - 1) > self.settings.drift_threshold
        tags["vanilla_drift"] = str(drifted).lower()
        contended = bool(summary.get("contended_prompts"))
        if contended:
            tags["contended"] = "true"
        TrialRecord.from_summary(summary, feasible=ok, constraints=constraints or None,
                                 vanilla_drift=drifted, contended=contended,
                                 compiled=described.get("compiled")).write(trial)
        values = objective_values(summary, self.settings.objectives)
        return TrialResult(values, evaluation, tags)

    def _drift(self, summary: Mapping[str, float]) -> dict[str, float]:
        """This trial's vanilla speed against the study's first on this hardware."""
        if self.settings.baseline != "per_trial" or "vanilla_tokens_per_s" not in summary:
            return {}
        s_per_token = 1.0 / summary["vanilla_tokens_per_s"]
        key = f"vanilla_reference_{short_hash({'hw': hardware(self.settings.device)})}"
        reference = self.study.user_attrs.get(key)
        if reference is None:
            self.study.set_user_attr(key, s_per_token)
            reference = s_per_token
        return {"vanilla_drift_ratio": s_per_token / reference}
