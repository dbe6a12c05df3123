"""The search: its kind, budget, objectives and bounds, the grid or heuristic values it will try,
the Optuna classes it names, and the quality bounds' need for a task metric."""

from __future__ import annotations

import math
from typing import Any, Mapping

from tuner.config.errors import ConfigError
from tuner.config.values import integer
from tuner.search.space import distributions, grid_names, heuristic_values

SEARCH_KINDS = ("heuristic", "grid", "sampler")


def check_search(search: Mapping[str, Any], space: Mapping[str, Any], task_class: str) -> None:
    kind = search.get("kind")
    if kind not in SEARCH_KINDS:
        raise ConfigError(f"search.kind={kind!r} is unknown: allowed are {list(SEARCH_KINDS)}")
    integer("search.n_trials", search.get("n_trials"), 1, "an integer >= 1")
    timeout = search.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ConfigError(f"search.timeout={timeout!r} is invalid: allowed is a number of "
                          "seconds > 0, or null")
    from tuner.search.objectives import OBJECTIVES
    objectives = search.get("objectives")
    if not isinstance(objectives, list) or not objectives or \
            any(o not in OBJECTIVES for o in objectives) or len(set(objectives)) < len(objectives):
        raise ConfigError(f"search.objectives={objectives!r} is invalid: allowed is a list of "
                          f"distinct names from {list(OBJECTIVES)}")
    if search.get("pruner") and objectives != ["speedup"]:
        raise ConfigError(f"search.pruner is set with search.objectives={objectives}: the pruner "
                          "is fed per-prompt paired speedups, so allowed is objectives=[speedup] "
                          "or pruner=null")
    bounds = (("max_quality_drop", 0.0, ">= 0 (the largest acceptable drop of the task's metric "
               "against vanilla)"),
              ("max_perplexity_ratio", 1e-300, "> 0 (e.g. 1.05: at most 5 % above vanilla's "
               "perplexity)"))
    for name, low, allowed in bounds:
        value = search.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < low):
            raise ConfigError(f"search.{name}={value!r} is invalid: allowed is a number "
                              f"{allowed}, or null")
    if kind == "grid":
        ranges = search.get("ranges", "heuristic")
        allowed = grid_names(space)
        if ranges not in allowed:
            raise ConfigError(f"search.ranges={ranges!r} is invalid for this method: allowed are "
                              f"{allowed}")
    if kind == "heuristic" or (kind == "grid" and search.get("ranges", "heuristic") ==
                               "heuristic"):
        for name, dist in distributions(space).items():
            try:
                heuristic_values(name, space[name], dist, task_class)
            except ValueError as err:
                raise ConfigError(str(err)) from None
    for key in ("sampler", "pruner"):
        target = (search.get(key) or {}).get("_target_", "")
        if target and not str(target).startswith("optuna."):
            raise ConfigError(f"search.{key}._target_={target!r} is not allowed: only Optuna "
                              "classes ('optuna.')")


def check_quality(search: Mapping[str, Any], task: Mapping[str, Any]) -> None:
    """A bound or objective on the task's quality needs a task that scores its outputs."""
    wants = [f"search.max_quality_drop={search['max_quality_drop']}"] \
        if search.get("max_quality_drop") is not None else []
    wants += ["search.objectives with quality_drop"] if "quality_drop" in \
        (search.get("objectives") or []) else []
    if wants and task.get("metric", "none") == "none":
        raise ConfigError(f"{wants[0]} needs a task quality metric, but task {task.get('name')} "
                          "has metric='none': allowed is a task with a metric (gsm8k, humaneval, "
                          "mbpp, cnndm, wmt16), or search.max_perplexity_ratio instead")
