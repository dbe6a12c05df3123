"""``TrialRecord``: what a measured trial tells the finish step, the report and other workers.

The objective writes it onto the Optuna trial (``write``: user attributes, so it lives in the
study's storage and every worker sees it); everything that later asks about a trial reads it back
here (``read``), never by string keys of its own. The keys are the ones every earlier study
recorded, so a study made before this module resumes unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from optuna.trial import FrozenTrial

from tuner.measure.figures import level_key, parse

# summary numbers kept on every trial (the summary table and best_* metrics read them); per-level
# and per-rate numbers (tuner.measure.figures: tuner.measure.levels, tuner.measure.rates) are kept
# too: the schedule and the per-level and per-rate decisions read them
FIGURES = ("speedup", "decode_speedup", "ttft_ms", "tokens_per_s", "mean_accepted_tokens",
           "decode_tokens_per_step", "speedup_lcb", "decode_speedup_lcb", "acceptance_rate",
           "vanilla_drift_ratio", "perplexity", "vanilla_perplexity", "perplexity_ratio",
           "quality_drop", "energy_j_per_token", "vanilla_energy_j_per_token", "energy_ratio",
           "contended_prompts", "other_load_max", "throughput_ratio", "engine_restart_s",
           "engine_varies", "predicted_speedup", "predicted_mean_accepted_tokens",
           "predicted_by_replay", "prediction_s", "predicted_speedup_for",
           "predicted_speedup_sd")


def kept(key: str) -> bool:
    """Whether a summary number is kept on the trial: FIGURES, and every figure at a level or a
    rate."""
    return key in FIGURES or parse(key) is not None


@dataclass(frozen=True)
class TrialRecord:
    """One trial's record (see the module docstring)."""

    figures: Mapping[str, float] = field(default_factory=dict)   # FIGURES, per level and rate
    feasible: bool | None = None           # within the quality bound (None: no bound)
    constraints: Mapping[str, float] | None = None   # Optuna's constraint values (<= 0: kept)
    vanilla_drift: bool = False            # vanilla's speed drifted beyond drift_threshold
    contended: bool = False                # measured while other processes used the CPUs
    compiled: str | None = None            # engine.compile: the compiled target's settings
    pruned_at: int | None = None           # pairs measured when the pruner stopped it

    @classmethod
    def from_summary(cls, summary: Mapping[str, float], **flags: Any) -> TrialRecord:
        """The record of a trial's summary (only the kept numbers) and its flags."""
        return cls({k: v for k, v in summary.items() if kept(k)}, **flags)

    def write(self, trial: Any) -> None:
        """Onto a running ``optuna.Trial`` (flags only when set: older studies lack them)."""
        for key, value in self.figures.items():
            trial.set_user_attr(key, value)
        if self.feasible is not None:
            trial.set_user_attr("feasible", self.feasible)
            trial.set_user_attr("constraints", dict(self.constraints or {}))
        for key in ("vanilla_drift", "contended"):
            if getattr(self, key):
                trial.set_user_attr(key, True)
        if self.compiled is not None:
            trial.set_user_attr("compiled", self.compiled)
        if self.pruned_at is not None:
            trial.set_user_attr("pruned_at", self.pruned_at)

    @classmethod
    def read(cls, trial: FrozenTrial) -> TrialRecord:
        attrs = trial.user_attrs
        return cls({k: v for k, v in attrs.items() if kept(k)}, attrs.get("feasible"),
                   attrs.get("constraints"), bool(attrs.get("vanilla_drift")),
                   bool(attrs.get("contended")), attrs.get("compiled"), attrs.get("pruned_at"))

    @property
    def infeasible(self) -> bool:
        """Broke the quality bound (a trial without a bound never does)."""
        return self.feasible is False

    @property
    def engine_varies(self) -> bool:
        return bool(self.figures.get("engine_varies"))

    def at_level(self, name: str, level: int) -> float | None:
        """``name`` measured at concurrency ``level`` (None: not measured there)."""
        return self.figures.get(level_key(name, level))
