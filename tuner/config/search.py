"""The search: its kind, budget, objectives and bounds, the grid or heuristic values it will try,
and the Optuna sampler and pruner (resolved and instantiated once here, so a wrong class or
argument is one line, not a traceback after the study opened)."""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Mapping
from typing import Any

from tuner.config.errors import ConfigError
from tuner.config.values import get_class, integer
from tuner.search.space import distributions, grid_names, heuristic_values

SEARCH_KINDS = ("heuristic", "grid", "predict", "sampler")
UNTIMED = ("auto", "halving", "sweep")   # search=predict: tuner.predict.halving
OPTUNA_KINDS = {"sampler": ("optuna.samplers", "BaseSampler"),
                "pruner": ("optuna.pruners", "BasePruner")}
OWN_CLASSES = {"pruner": "tuner.search.pruners."}   # the project's own, beside Optuna's


def check_search(search: Mapping[str, Any], space: Mapping[str, Any], task_class: str) -> None:
    kind = search.get("kind")
    if kind not in SEARCH_KINDS:
        raise ConfigError(f"search.kind={kind!r} is unknown: allowed are {list(SEARCH_KINDS)}")
    integer("search.n_trials", search.get("n_trials"), 1, "an integer >= 1")
    integer("search.profile_rounds", search.get("profile_rounds", 5), 1, "an integer >= 1 (the "
            "timed rounds of a profile made here for search.profile=auto)")
    timeout = search.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ConfigError(f"search.timeout={timeout!r} is invalid: allowed is a number of "
                          "seconds > 0, or null")
    hours = search.get("max_hours", "auto")
    if hours != "auto" and hours is not None and (
            isinstance(hours, bool) or not isinstance(hours, (int, float)) or
            not math.isfinite(hours) or not hours > 0):
        raise ConfigError(f"search.max_hours={hours!r} is invalid: allowed is a number of hours "
                          "> 0, auto (2 without a GPU, 12 with one) or null (no cap)")
    from tuner.search.objectives import OBJECTIVES, direction
    objectives = search.get("objectives")
    if not isinstance(objectives, list) or not objectives or \
            any(direction(str(o)) is None for o in objectives) or \
            len(set(objectives)) < len(objectives):
        raise ConfigError(f"search.objectives={objectives!r} is invalid: allowed is a list of "
                          f"distinct names from {list(OBJECTIVES)} or auto (the engine's own "
                          "paired speedup), or with an engine server "
                          "speedup@c<level>, decode_speedup@c<level>, throughput_ratio@c<level>, "
                          "tokens_per_s@c<level>, throughput_ratio, and with budget.request_rate "
                          "goodput@r<rate>, tpot_ms_p90@r<rate>, ... (tuner/search/objectives.py)")
    if search.get("pruner") and objectives not in (["speedup"], ["decode_speedup"]):
        raise ConfigError(f"search.pruner is set with search.objectives={objectives}: the pruner "
                          "is fed per-prompt paired speedups, so allowed is objectives=[speedup] "
                          "or [decode_speedup], or pruner=null")
    bounds = (("max_quality_drop", 0.0, (">= 0 (the largest acceptable drop of the task's "
                                         "metric against vanilla)")),
              ("max_perplexity_ratio", 1e-300, ("> 0 (e.g. 1.05: at most 5 % above vanilla's "
                                                "perplexity)")))
    for name, low, allowed in bounds:
        value = search.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < low):
            raise ConfigError(f"search.{name}={value!r} is invalid: allowed is a number "
                              f"{allowed}, or null")
    if kind == "predict":
        if not search.get("profile"):
            raise ConfigError("search.profile=None is invalid for search=predict: it ranks the "
                              "grid by predicted speedup, so allowed is auto (this machine's "
                              "profile, made on first use and cached) or a hardware profile "
                              "JSON (python -m tuner.profile --models <models> --out <file>)")
        if objectives not in (["auto"], ["speedup"]):
            raise ConfigError(f"search.objectives={objectives} is invalid for search=predict: it "
                              "ranks points by predicted paired speedup, so allowed is [auto] or "
                              "[speedup]")
        integer("search.top", search.get("top"), 1, "an integer >= 1 (the best-predicted points "
                "measured)")
        integer("search.spread", search.get("spread"), 0, "an integer >= 0 (points spread over "
                "the rest of the ranking, measured to calibrate)")
        workers = search.get("untimed_workers", "auto")
        if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int)
                                  or workers < 1):
            raise ConfigError(f"search.untimed_workers={workers!r} is invalid: allowed are auto "
                              "(one worker per CPU the study may use, on a CPU; none on an "
                              "accelerator) or an integer >= 1 (1: untimed runs in the study's "
                              "own process)")
        untimed = search.get("untimed", "auto")
        if untimed not in UNTIMED:
            raise ConfigError(f"search.untimed={untimed!r} is invalid: allowed are "
                              f"{list(UNTIMED)} (how points predicted from untimed runs are "
                              "ranked: auto = sweep across methods (method=auto), halving for "
                              "one method)")
    check_race(search.get("race"))
    if search.get("race") is not None and kind not in ("heuristic", "grid", "predict"):
        raise ConfigError(f"search.race is set with search.kind={kind} (a sampler chooses its "
                          "trials one by one; racing drops the points of a plan): allowed is "
                          "search.race with search=heuristic, grid or predict, and no "
                          "search.race here")
    if kind in ("grid", "predict"):
        ranges = search.get("ranges", "heuristic")
        allowed = grid_names(space)
        if ranges not in allowed:
            raise ConfigError(f"search.ranges={ranges!r} is invalid for this method: allowed are "
                              f"{allowed}")
    if kind == "heuristic" or (kind in ("grid", "predict") and
                               search.get("ranges", "heuristic") == "heuristic"):
        for name, dist in distributions(space).items():
            try:
                heuristic_values(name, space[name], dist, task_class)
            except ValueError as err:
                raise ConfigError(str(err)) from None
    for key in OPTUNA_KINDS:
        check_optuna(key, search.get(key))


def check_race(race: Any) -> None:
    """``search.race``: null, or a mapping of margin, alpha, error_floor, min_measured."""
    if race is None:
        return
    known = ("margin", "alpha", "error_floor", "min_measured", "miss")
    if not isinstance(race, Mapping) or set(race) - set(known):
        raise ConfigError(f"search.race={race!r} is invalid: allowed is null (no racing) or a "
                          f"mapping with keys from {list(known)}")
    rules = {"margin": (0.0, 1.0, "a fraction in [0, 1) (the indifference margin, e.g. 0.02)"),
             "alpha": (1e-9, 0.5, "a probability in (0, 0.5) (the error per look, e.g. 0.025)"),
             "error_floor": (0.0, 5.0, "a number in [0, 5) (the least calibration error, in "
                             "ln units, e.g. 0.05)"),
             "miss": (1e-9, 0.5, "a probability in (0, 0.5) (the stop bound's one-sided miss "
                      "rate per unmeasured point, e.g. 0.1)")}
    for key, (low, high, allowed) in rules.items():
        value = race.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not low <= value < high:
            raise ConfigError(f"search.race.{key}={value!r} is invalid: allowed is {allowed}")
    if race.get("min_measured") is not None:
        integer("search.race.min_measured", race["min_measured"], 1,
                "an integer >= 1 (points finished past the default before the race may stop)")


def check_traffic(search: Mapping[str, Any], budget: Mapping[str, Any]) -> None:
    """``search.slo`` and rate objectives (``…@r<rate>``) against ``budget.request_rate``."""
    from tuner.measure.figures import parse, rate_key, rate_text
    from tuner.measure.traffic import SLO_KEYS
    rates = [float(r) for r in budget.get("request_rate") or []]
    slo = search.get("slo")
    if slo is not None:
        if not isinstance(slo, Mapping) or not slo or any(
                key not in SLO_KEYS or isinstance(v, bool) or not isinstance(v, (int, float))
                or not math.isfinite(v) or v <= 0 for key, v in slo.items()):
            raise ConfigError(f"search.slo={slo!r} is invalid: allowed is null or a mapping of "
                              f"per-request bounds in milliseconds > 0 with keys from "
                              f"{list(SLO_KEYS)}, e.g. {{tpot_ms: 50}}")
        if not rates:
            raise ConfigError(f"search.slo={slo} is set but budget.request_rate=[] measures no "
                              "rate: allowed is search.slo with budget.request_rate=[...] "
                              "(e.g. [1,4]), or search.slo=null")
    for name in search.get("objectives") or []:
        key = parse(str(name))
        if key is None or key.rate is None:
            continue
        base, rate = key.name, key.rate
        if rate_text(rate) not in {rate_text(r) for r in rates}:
            raise ConfigError(f"search.objectives: {name} names request rate {rate}, which "
                              f"budget.request_rate={budget.get('request_rate')} does not "
                              "measure")
        if not key.canonical:       # the figures' keys: 4 -> @r4, 0.5 -> @r0.5
            spelled = key.flat()
            raise ConfigError(f"search.objectives: {name} is spelled {spelled} in the trials' "
                              f"figures: allowed is {spelled}")
        if base == "goodput_ratio":
            raise ConfigError(f"search.objectives: {name} is not an objective (it is not "
                              "measured where none of vanilla's requests met the SLO): allowed "
                              f"is {rate_key('goodput', rate)}")
        if base.startswith("goodput") and slo is None:
            raise ConfigError(f"search.objectives: {name} needs search.slo (the bounds a "
                              "request must meet to count), e.g. search.slo={tpot_ms:50}")


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


def check_optuna(key: str, spec: Any) -> None:
    """``search.<key>`` (sampler or pruner): an Optuna class of that kind, its arguments real.

    Instantiated once (cheap: no storage, no study) so bad values fail here with one line.
    """
    if not spec:
        return
    if not isinstance(spec, Mapping) or not spec.get("_target_"):
        raise ConfigError(f"search.{key}={spec!r} is invalid: allowed is null or a mapping with "
                          f"_target_ (one of {allowed_classes(key)})")
    target = str(spec["_target_"])
    own = OWN_CLASSES.get(key)
    if not target.startswith("optuna.") and not (own and target.startswith(own)):
        raise ConfigError(f"search.{key}._target_={target!r} is not allowed: only Optuna "
                          "classes ('optuna.')" + (f" or this project's ('{own}')" if own
                                                   else ""))
    import importlib
    module_name, base_name = OPTUNA_KINDS[key]
    base = getattr(importlib.import_module(module_name), base_name)
    try:
        cls = get_class(target)
    except (ImportError, ValueError, AttributeError):
        cls = None
    if not inspect.isclass(cls) or not issubclass(cls, base):
        what = "does not exist" if cls is None else f"is not an Optuna {key}"
        raise ConfigError(f"search.{key}._target_={target!r} {what}: allowed are "
                          f"{allowed_classes(key)}")
    arguments = {k: v for k, v in spec.items() if not k.startswith("_")}
    params = inspect.signature(cls).parameters
    takes = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        for name, value in arguments.items():
            if name not in takes:
                raise ConfigError(f"search.{key}.{name}={value!r} is not an argument of "
                                  f"{target}: allowed are {takes}")
    from hydra.utils import instantiate
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")       # experimental-feature notices
            instantiate(dict(spec))
    except Exception as err:   # noqa: BLE001 - whatever the class rejects, said in one line
        cause = err.__cause__ or err
        detail = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        given = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
        raise ConfigError(f"search.{key}: {target}({given}) fails: {detail}: allowed arguments "
                          f"are {takes}") from None


def check_pruner_reach(search: Mapping[str, Any], steps: int) -> None:
    """A ``WilcoxonPruner`` that can never prune at the study's size is refused in one line.

    The pruner is asked after every reported prompt but the last (``tuner.study.objective``),
    so it sees at most ``steps`` − 1 paired differences, where the smallest one-sided p a
    signed-rank test can reach is 1/2^(steps − 1); it needs at least max(2,
    ``n_startup_steps``) of them."""
    spec = search.get("pruner") or {}
    if not str(spec.get("_target_", "")).endswith("WilcoxonPruner"):
        return
    threshold = float(spec.get("p_threshold", 0.1))
    startup = int(spec.get("n_startup_steps", 2))
    looks = steps - 1
    smallest = 0.5 ** looks if looks > 0 else 1.0
    if looks < max(2, startup) or smallest >= threshold:
        raise ConfigError(
            f"search.pruner: WilcoxonPruner(p_threshold={threshold:g}) can never prune at "
            f"{steps} tuning prompt(s): it is asked after at most {looks}, where the smallest "
            f"p a signed-rank test reaches is {smallest:g} (it needs p < {threshold:g} and "
            f"at least {max(2, startup)} prompts); allowed: the paired pruner (search=tpe's "
            "default, tuner.search.pruners.PairedPruner), more prompts (task.n_prompts >= "
            f"{needed_prompts(threshold, startup)}), or search.pruner=null")


def needed_prompts(threshold: float, startup: int) -> int:
    """The fewest tuning prompts at which a signed-rank test can reach p < ``threshold``."""
    looks = max(2, startup)
    while 0.5 ** looks >= threshold:
        looks += 1
    return looks + 1


def allowed_classes(key: str) -> str:
    """'optuna.samplers.{RandomSampler, TPESampler, ...}': the public classes of that kind."""
    import importlib
    module_name, base_name = OPTUNA_KINDS[key]
    module = importlib.import_module(module_name)
    base = getattr(module, base_name)
    names = sorted(n for n, c in vars(module).items() if inspect.isclass(c) and issubclass(
        c, base) and not n.startswith(("_", "Base")))
    text = f"{module_name}.{{{', '.join(names)}}}"
    if key == "pruner":
        text += ", tuner.search.pruners.PairedPruner"
    return text
