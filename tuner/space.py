"""Search spaces from method YAMLs: ``{name: {type, low, high, step?, choices?, log?, heuristic?}}``.

Names are the method's keyword arguments, so ``trial.params`` feeds straight back into the method.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping

from optuna.distributions import (BaseDistribution, CategoricalDistribution, FloatDistribution,
                                  IntDistribution)

TYPES = ("int", "float", "categorical")


def distributions(space: Mapping[str, Mapping[str, Any]]) -> dict[str, BaseDistribution]:
    """Optuna distributions for a space; bad ranges raise ValueError naming the parameter."""
    out: dict[str, BaseDistribution] = {}
    for name, spec in space.items():
        kind = spec.get("type")
        if kind not in TYPES:
            raise ValueError(f"search space of {name!r}: type={kind!r} is unknown: allowed are "
                             f"{list(TYPES)}")
        if kind == "categorical":
            out[name] = CategoricalDistribution(list(spec["choices"]))
            continue
        low, high = spec.get("low"), spec.get("high")
        if low is None or high is None or low > high:
            raise ValueError(f"search space of {name!r}: low={low!r}, high={high!r} is not a "
                             "valid range (need low <= high)")
        if kind == "int":
            out[name] = IntDistribution(int(low), int(high), step=int(spec.get("step", 1)),
                                        log=bool(spec.get("log", False)))
        else:
            out[name] = FloatDistribution(float(low), float(high), step=spec.get("step"),
                                          log=bool(spec.get("log", False)))
    return out


def validate_params(params: Mapping[str, Any], space: Mapping[str, Mapping[str, Any]]) -> None:
    """Reject values outside the declared space (e.g. γ = 0) with a clear message."""
    for name, dist in distributions(space).items():
        if name in params and not dist._contains(dist.to_internal_repr(params[name])):
            raise ValueError(f"{name}={params[name]!r} is outside its search space {dist}")


def grid(space: Mapping[str, Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Every value of every parameter (ints by step, categoricals; floats need a step)."""
    values: dict[str, list[Any]] = {}
    for name, dist in distributions(space).items():
        if isinstance(dist, CategoricalDistribution):
            values[name] = list(dist.choices)
        elif isinstance(dist, IntDistribution):
            values[name] = list(range(dist.low, dist.high + 1, dist.step))
        elif dist.step is not None:
            count = int(round((dist.high - dist.low) / dist.step))
            values[name] = [dist.low + i * dist.step for i in range(count + 1)]
        else:
            raise ValueError(f"grid search needs a step for float parameter {name!r}")
    return values


def search_values(space: Mapping[str, Mapping[str, Any]], task_class: str | None = None
                  ) -> dict[str, list[Any]]:
    """Values per parameter: its heuristic range for ``task_class`` (Ouroboros Table 10) when it
    declares one, else the full grid. An int heuristic is a range [low, high]; a categorical or
    float heuristic is the list of values itself."""
    full = grid(space)
    values = {}
    for name, spec in space.items():
        heuristic = (spec.get("heuristic") or {}).get(task_class) if task_class else None
        if heuristic and spec.get("type") == "int":
            values[name] = list(range(int(heuristic[0]), int(heuristic[1]) + 1))
        else:
            values[name] = list(heuristic) if heuristic else full[name]
    return values


def grid_size(space: Mapping[str, Mapping[str, Any]], task_class: str | None = None) -> int:
    values = search_values(space, task_class)
    return len(list(itertools.product(*values.values()))) if space else 1
