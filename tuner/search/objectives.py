"""What a search optimises: summary keys of a trial, each with its direction.

``decode_speedup`` is the paired speedup of the decode phase alone: time to the first token left
out (the server's own decode time in an engine; in process, the time after the first step), so that
long prompts do not pull it towards 1. Engine servers measured at several concurrency levels add
``speedup@c4``, ``decode_speedup@c4``, ``tokens_per_s@c4``,
``throughput_ratio@c4`` (any level of ``budget.concurrency``) and ``throughput_ratio`` (the
geometric mean over levels).

``search.objectives`` names one key (a single-objective study; ``speedup`` and ``decode_speedup``
are the ones a pruner can be fed per prompt) or several (a Pareto front: ``search=pareto`` is speed
against output perplexity, ``search=pareto_energy`` adds J/token on an NVIDIA GPU).

``auto`` (the shipped searches' default) stands for the engine's own paired speedup
(``resolve``): ``decode_speedup`` for engine servers, whose prompts' prefill would otherwise pull
every ratio towards 1 and whose own timings give the decode phase of both sides alike;
``speedup`` in process, where a drafting method's first step also verifies γ + 1 tokens, so leaving
the first step out would not leave out the same work on both sides.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from tuner.measure.figures import parse

OBJECTIVES: dict[str, str] = {
    "speedup": "maximize",              # paired geometric-mean speedup vs vanilla (tuner.measure.measurement)
    "decode_speedup": "maximize",       # ... of the decode phase alone (prefill left out)
    "tokens_per_s": "maximize",
    "mean_accepted_tokens": "maximize",
    "perplexity": "minimize",           # output perplexity under the target (tuner.measure.quality)
    "perplexity_ratio": "minimize",     # ... over vanilla's on the same prompts
    "quality_drop": "minimize",         # vanilla's task metric minus the method's
    "energy_j_per_token": "minimize",   # NVML energy (GPU only, tuner.measure.energy)
    "energy_ratio": "minimize",         # ... over vanilla's J/token
}
AUTO = "auto"      # the engine's own paired speedup (resolve)
# engine servers (tuner.measure.levels): per concurrency level (tuner.measure.figures.level_key),
# and over levels
LEVELLED = ("speedup", "decode_speedup", "throughput_ratio", "tokens_per_s")
ENGINE_ONLY = ("throughput_ratio",)
# request rates (tuner.measure.rates; tuner.measure.figures.rate_key), e.g. goodput@r4
RATED_UP = ("goodput", "goodput_ratio", "tpot_ratio", "throughput_ratio", "output_tokens_per_s",
            "request_throughput")
RATED_DOWN = tuple(f"{name}_ms_p{q}" for name in ("ttft", "tpot", "itl") for q in (50, 90, 99)) + \
    ("e2e_ms_p50", "e2e_ms_p90")
ENERGY = ("energy_j_per_token", "energy_ratio")
PERPLEXITY = ("perplexity", "perplexity_ratio")


def direction(name: str) -> str | None:
    """maximize / minimize for a known objective name, None for an unknown one."""
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    key = parse(name)
    if key is not None and key.rate is not None:
        return "maximize" if key.name in RATED_UP else \
            "minimize" if key.name in RATED_DOWN else None
    if key is not None and key.name in LEVELLED:
        return "maximize"
    return "maximize" if name in ENGINE_ONLY else None


def resolve(objectives: object, default: str) -> object:
    """``objectives`` with each ``auto`` replaced by ``default`` (the engine's
    ``default_objective``); anything that is not a list is returned as is, for the check to
    name."""
    if not isinstance(objectives, list):
        return objectives
    return [default if name == AUTO else name for name in objectives]


def directions(objectives: Sequence[str]) -> list[str]:
    return [direction(name) for name in objectives]


def objective_values(summary: Mapping[str, float], objectives: Sequence[str]) -> list[float]:
    """The trial's value of every objective; a missing one is named (ValueError)."""
    missing = [name for name in objectives if name not in summary]
    if missing:
        raise ValueError(f"objective(s) {missing} were not measured in this trial (energy needs "
                         "an NVIDIA GPU; quality_drop needs a task metric; decode_speedup needs "
                         "a decode phase: tokens after the first step, and an engine that "
                         "reports its decode time)")
    return [float(summary[name]) for name in objectives]


def better_first(direction: str) -> int:
    """+1 when larger is better, −1 when smaller is: ``sign * value`` is maximised."""
    return 1 if direction == "maximize" else -1
