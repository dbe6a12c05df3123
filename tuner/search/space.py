"""Search spaces from method YAMLs: ``space: {name: {type, low, high, step?, choices?, log?,
heuristic?, grids?}}``.

Names are the method's keyword arguments, so a trial's values feed straight back into the method.
``heuristic: {HH: [lo, hi], LH: [lo, hi]}`` gives Ouroboros Table 10's initial integer ranges per
task class, clipped to the space (a range reaching outside it is a YAML mistake, reported once);
``grids: {table9: [v, ...]}`` names fixed value lists (``search.ranges=table9``: Table 9's grid).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping

import optuna
from optuna.distributions import (BaseDistribution, CategoricalDistribution, FloatDistribution,
                                  IntDistribution)

TYPES = ("int", "float", "categorical")
RANGES = ("heuristic", "full")      # plus any grid name declared under a parameter's ``grids``


def distributions(space: Mapping[str, Mapping[str, Any]]) -> dict[str, BaseDistribution]:
    """Optuna distributions for a space; bad ranges raise ValueError naming the parameter."""
    out: dict[str, BaseDistribution] = {}
    for name, spec in space.items():
        kind = spec.get("type")
        if kind not in TYPES:
            raise ValueError(f"method.space.{name}.type={kind!r} is unknown: allowed are "
                             f"{list(TYPES)}")
        if kind == "categorical":
            choices = spec.get("choices")
            if not choices:
                raise ValueError(f"method.space.{name}.choices={choices!r} is invalid: allowed "
                                 "is a non-empty list")
            out[name] = CategoricalDistribution(list(choices))
            continue
        low, high = spec.get("low"), spec.get("high")
        if low is None or high is None or low > high:
            raise ValueError(f"method.space.{name}: low={low!r}, high={high!r} is not a "
                             "valid range (need low <= high)")
        if kind == "int":
            out[name] = IntDistribution(int(low), int(high), step=int(spec.get("step", 1)),
                                        log=bool(spec.get("log", False)))
        else:
            out[name] = FloatDistribution(float(low), float(high), step=spec.get("step"),
                                          log=bool(spec.get("log", False)))
    return out


def contains(dist: BaseDistribution, value: Any) -> bool:
    try:
        return bool(dist._contains(dist.to_internal_repr(value)))
    except (ValueError, TypeError):
        return False


def validate_params(params: Mapping[str, Any], space: Mapping[str, Mapping[str, Any]]) -> None:
    """Reject values outside the declared space (e.g. γ = 0) with a clear message."""
    for name, dist in distributions(space).items():
        if name in params and not contains(dist, params[name]):
            raise ValueError(f"method.params.{name}={params[name]!r} is outside its search "
                             f"space {_describe(dist)}")


def _describe(dist: BaseDistribution) -> str:
    if isinstance(dist, CategoricalDistribution):
        return f"(allowed: {list(dist.choices)})"
    return f"(allowed: {dist.low} to {dist.high})"


def suggest(trial: optuna.Trial, space: Mapping[str, Mapping[str, Any]],
            conditional: bool = False) -> dict[str, Any]:
    """Each parameter through Optuna's public ``suggest_*`` (enqueued values come back as given).

    ``conditional``: define-by-run, as Optuna intends for conditional spaces: a parameter whose
    ``active_when`` does not hold for the values drawn so far is not suggested at all (it stays at
    the method's default), so a sampler such as TPE never spends trials on values that build the
    same method. Plans (heuristic, grid) enqueue complete points and keep ``conditional`` off.
    """
    dists = distributions(space)
    order = [n for n in dists if not space[n].get("active_when")] + \
        [n for n in dists if space[n].get("active_when")]
    values: dict[str, Any] = {}
    for name in order:
        dist = dists[name]
        if conditional and not is_active(name, space[name], values):
            continue
        if isinstance(dist, CategoricalDistribution):
            values[name] = trial.suggest_categorical(name, dist.choices)
        elif isinstance(dist, IntDistribution):
            values[name] = trial.suggest_int(name, dist.low, dist.high, step=dist.step,
                                             log=dist.log)
        else:
            values[name] = trial.suggest_float(name, dist.low, dist.high, step=dist.step,
                                               log=dist.log)
    return values


def is_active(name: str, spec: Mapping[str, Any], point: Mapping[str, Any]) -> bool:
    """Whether parameter ``name`` acts at ``point``: its ``active_when`` (``{other: [values]}``,
    e.g. a dynamic tree's ``width`` only when ``shape: [dynamic]``) holds, or it declares none."""
    return all(point.get(other) in list(allowed)
               for other, allowed in (spec.get("active_when") or {}).items())


def active_params(point: Mapping[str, Any], space: Mapping[str, Mapping[str, Any]]
                  ) -> dict[str, Any]:
    """``point`` without the searched parameters that do not act there (what a summary shows:
    ``size_n`` of an ``ngram-simple`` draft, not ``mod_n_match`` of ``ngram-mod``)."""
    return {name: value for name, value in point.items()
            if name not in space or is_active(name, space[name], point)}


def canonical(point: Mapping[str, Any], space: Mapping[str, Mapping[str, Any]],
              default: Mapping[str, Any]) -> dict[str, Any]:
    """``point`` with every inactive parameter at its default: points that build the same method
    get the same key, so plans never measure one configuration twice."""
    return {name: value if name not in space or is_active(name, space[name], point)
            else default.get(name, value) for name, value in point.items()}


def check_active_when(space: Mapping[str, Mapping[str, Any]]) -> None:
    """``active_when`` must name other parameters of the space and values they can take."""
    dists = distributions(space)
    for name, spec in space.items():
        conditions = spec.get("active_when")
        if conditions is None:
            continue
        if not isinstance(conditions, Mapping) or not conditions:
            raise ValueError(f"method.space.{name}.active_when={conditions!r} is invalid: allowed "
                             "is a mapping {other_parameter: [values]}")
        for other, allowed in conditions.items():
            if other == name or other not in dists:
                raise ValueError(f"method.space.{name}.active_when names {other!r}: allowed are "
                                 f"the other parameters {[n for n in dists if n != name]}")
            if not isinstance(allowed, (list, tuple)) or not allowed or \
                    not all(contains(dists[other], v) for v in allowed):
                raise ValueError(f"method.space.{name}.active_when.{other}={allowed!r} is "
                                 f"invalid: allowed is a list of values of {other} "
                                 f"{_describe(dists[other])}")


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


def heuristic_values(name: str, spec: Mapping[str, Any], dist: BaseDistribution,
                     task_class: str) -> list[Any] | None:
    """The parameter's heuristic values for ``task_class``, clipped to the space; None if absent.

    ``heuristic`` entries are ``[lo, hi]`` integer ranges for int parameters and the list of
    values itself for categorical and float ones (``{HH: [a, b, c]}``).
    """
    entry = (spec.get("heuristic") or {}).get(task_class)
    if entry is None:
        return None
    if spec.get("type") != "int":
        wanted = list(entry)
    else:
        wanted = list(range(int(entry[0]), int(entry[1]) + 1))
    kept = [v for v in wanted if contains(dist, v)]
    if len(kept) < len(wanted):
        warnings.warn(f"method.space.{name}.heuristic.{task_class}={entry} reaches outside the "
                      f"space {_describe(dist)}: clipped to {kept}", stacklevel=2)
    if not kept:
        raise ValueError(f"method.space.{name}.heuristic.{task_class}={entry} has no value "
                         f"inside the space {_describe(dist)}")
    return kept


def search_values(space: Mapping[str, Mapping[str, Any]], ranges: str = "full",
                  task_class: str | None = None, default: Mapping[str, Any] | None = None
                  ) -> dict[str, list[Any]]:
    """Values per parameter for a plan.

    ``ranges``: ``heuristic`` (each parameter's Table 10 range for ``task_class``, the full grid
    where it declares none), ``full`` (the whole space) or a grid name declared under ``grids``
    (parameters without that grid stay at their ``default``).
    """
    full = grid(space)
    dists = distributions(space)
    values = {}
    for name, spec in space.items():
        if ranges == "full":
            values[name] = full[name]
        elif ranges == "heuristic":
            values[name] = heuristic_values(name, spec, dists[name], task_class or "") \
                or full[name]
        else:
            named = (spec.get("grids") or {}).get(ranges)
            values[name] = list(named) if named is not None else [(default or {})[name]]
    return values


def grid_names(space: Mapping[str, Mapping[str, Any]]) -> list[str]:
    names = {g for spec in space.values() for g in (spec.get("grids") or {})}
    return list(RANGES) + sorted(names)


def grid_size(space: Mapping[str, Mapping[str, Any]], ranges: str = "full",
              task_class: str | None = None, default: Mapping[str, Any] | None = None) -> int:
    values = search_values(space, ranges, task_class, default)
    return math.prod(len(v) for v in values.values())   # counted, never enumerated
