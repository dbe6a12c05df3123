"""Check a composed config completely before any model, storage or MLflow store is touched.

``validate(cfg, engines)`` raises ``ConfigError`` with one line naming the setting, the value and what is
allowed. It reads only small files (the task's shipped data, a GGUF header, a journal's lines),
imports the method's module to check its real signature, instantiates the Optuna sampler and
pruner, and sends one short HTTP GET to a tracking server that should already run. The engine's
own checks run here too (``tuner.engines``: the caller hands its engine objects in).
docs/bad-input.md lists every message (each backed by a test in tests/test_validate.py).

The checks live by subject: ``task`` (settings and data file), ``methods`` (method, sampling),
``models`` (specs, EAGLE head, context length), ``search`` (search, Optuna classes, quality
bounds), ``stores`` (storage, folders, journal, tracking). Their public names are importable
from here too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, Protocol

from omegaconf import DictConfig

from tuner.config.errors import ConfigError
from tuner.config.methods import (
    SAMPLING_ARGS,
    check_method,
    check_sampling,
    method_arguments,
    method_choice,
    method_class,
)
from tuner.config.models import (
    check_context,
    check_generation_fits,
    check_head,
    check_head_fits,
    check_models,
)
from tuner.config.search import (
    SEARCH_KINDS,
    check_optuna,
    check_quality,
    check_search,
    check_traffic,
)
from tuner.config.stores import (
    TRACKING,
    check_folder,
    check_journal,
    check_storage,
    check_tracking,
)
from tuner.config.task import check_task
from tuner.config.values import integer, plain

# validate() and the checks' public names, importable from here (where callers always looked)
__all__ = ["BASELINES", "PHASES", "RESUME", "SAMPLING_ARGS", "SEARCH_KINDS", "TRACKING",
           "check_context", "check_folder", "check_generation_fits", "check_head",
           "check_head_fits", "check_journal", "check_launcher", "check_method", "check_models",
           "check_optuna", "check_quality", "check_sampling", "check_search", "check_storage",
           "check_task", "check_tracking", "generation_budget", "integer", "method_arguments",
           "method_class", "plain", "validate"]
BASELINES = ("per_trial", "per_study")
RESUME = ("auto", "force")
PHASES = ("all", "prepare", "work", "finish")
CPU_BUDGET = {"n_prompts": 1, "n_held_out": 0, "max_new_tokens": 1, "n_trials": 1}   # minimums


class EngineChecks(Protocol):
    """What validation needs of an engine (``tuner.engines.base.Engine``)."""

    def check(self, cfg: DictConfig, choice: str) -> None: ...

    def method(self, cfg: DictConfig, choice: str) -> dict[str, Any]: ...

    def objectives(self, cfg: DictConfig) -> Any: ...


def validate(cfg: DictConfig, engines: Callable[[DictConfig], EngineChecks]) -> None:
    """Every setting the study will use, checked in one pass (cheap; no models, no storage).

    ``engines``: the config -> its engine's object (``tuner.engines.engine_of``), whose own
    checks run here and which says what method config the study runs."""
    try:
        task, models = plain(cfg.task), plain(cfg.models)
        plain(cfg.method)
    except Exception as err:   # noqa: BLE001 - an interpolation error is a config error too
        raise ConfigError(f"the config does not resolve: {err}".splitlines()[0]) from None
    check_choices(cfg)
    choice = method_choice(cfg)
    checks = engines(cfg)
    checks.check(cfg, choice)
    method = checks.method(cfg, choice)
    check_task(task)
    check_method(method)
    check_sampling(plain(cfg.sampling), cfg.seed)
    check_models(models, method["needs_draft"])
    check_head(method, models)
    search = {**plain(cfg.search), "objectives": checks.objectives(cfg)}   # auto resolved
    check_search(search, method.get("space") or {}, task.get("task_class", "LH"))
    check_quality(search, task)
    check_traffic(search, plain(cfg.budget))
    check_numbers(cfg)
    check_context(models, method["needs_draft"], *generation_budget(cfg, task, models))
    check_storage(cfg.storage)
    beat = plain(cfg.get("heartbeat")) or {}
    integer("heartbeat.interval", beat.get("interval", 60), 1, "an integer >= 1 (seconds)")
    if beat.get("grace") is not None:
        integer("heartbeat.grace", beat.get("grace"), int(beat.get("interval", 60)) + 1,
                "an integer > heartbeat.interval (seconds), or null")
    check_folder("studies_dir", cfg.studies_dir, "a folder path (default: studies; '.' for the "
                 "current folder)")
    launcher = plain(cfg.get("launcher")) or {"kind": "local"}
    tracking = plain(cfg.tracking)
    check_tracking(tracking, launcher_starts_server=launcher.get("kind") == "slurm" and
                   cfg.get("phase", "all") == "all" and bool(tracking.get("start")))
    check_launcher(launcher)


def check_choices(cfg: DictConfig) -> None:
    check_budget(plain(cfg.get("budget")))
    for name, allowed in (("baseline", BASELINES), ("resume", RESUME),
                          ("phase", PHASES)):
        if cfg.get(name) not in allowed:
            raise ConfigError(f"{name}={cfg.get(name)!r} is invalid: allowed are {list(allowed)}")
    if cfg.study_name is not None and not str(cfg.study_name).replace("-", "").replace(
            "_", "").replace(".", "").isalnum():
        raise ConfigError(f"study_name={cfg.study_name!r} is invalid: allowed are letters, "
                          "digits, '-', '_' and '.'")


def check_budget(budget: Any) -> None:
    """``budget``: a config group (auto | full) with ``mode`` and ``concurrency``."""
    if not isinstance(budget, Mapping) or budget.get("mode") not in ("auto", "full"):
        raise ConfigError(f"budget={budget!r} is invalid: allowed are budget=auto, budget=full")
    levels = budget.get("concurrency")
    if not isinstance(levels, list) or not levels or len(set(levels)) < len(levels) or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in levels):
        raise ConfigError(f"budget.concurrency={levels!r} is invalid: allowed is a list of "
                          "distinct integers >= 1 (requests in flight at once), e.g. [1,4,8]")
    rates = budget.get("request_rate", [])
    if not isinstance(rates, list) or len(set(rates)) < len(rates) or any(
            isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)
            or not 0 < r <= 1000 for r in rates):
        raise ConfigError(f"budget.request_rate={rates!r} is invalid: allowed is a list of "
                          "distinct numbers of requests per second in (0, 1000], e.g. [1,4], "
                          "or [] for none")
    from tuner.measure.figures import rate_key, rate_text
    from tuner.measure.traffic import MAX_REQUESTS, MAX_SCHEDULE_S
    if len({rate_text(r) for r in rates}) < len(rates):
        raise ConfigError(f"budget.request_rate={rates!r} is invalid: two rates share the "
                          f"figures' key ({[rate_key('', r) for r in rates]}): allowed are rates "
                          "that differ within 6 significant digits")
    count = budget.get("requests_per_rate", 8)
    integer("budget.requests_per_rate", count, 1,
            f"an integer from 1 to {MAX_REQUESTS} (requests in each rate's schedule)")
    if count > MAX_REQUESTS:
        raise ConfigError(f"budget.requests_per_rate={count!r} is invalid: allowed is an integer "
                          f"from 1 to {MAX_REQUESTS} (requests in each rate's schedule)")
    slow = [r for r in rates if count / r > MAX_SCHEDULE_S]
    if slow:
        raise ConfigError(f"budget.request_rate={rates!r} with budget.requests_per_rate={count}: "
                          f"a schedule at {slow[0]:g}/s lasts about {count / slow[0]:.0f} s per "
                          f"server and trial: allowed are schedules up to {MAX_SCHEDULE_S} s "
                          "(a higher rate or fewer requests)")


def check_numbers(cfg: DictConfig) -> None:
    integer("warmup_prompts", cfg.warmup_prompts, 0, "an integer >= 0")
    if "near_tie_tolerance" in cfg:
        raise ConfigError("near_tie_tolerance is no longer read: a probability gap cannot tell a "
                          "bf16 rounding flip from a bug; allowed is near_tie_ulps (units of the "
                          "dtype's resolution at the logit, default 4)")
    tolerance = cfg.near_tie_ulps
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) \
            or not 0 <= tolerance <= 64:
        raise ConfigError(f"near_tie_ulps={tolerance!r} is invalid: allowed is a number in "
                          "[0, 64]")
    drift = cfg.drift_threshold
    if not isinstance(drift, (int, float)) or not 0 < drift or math.isinf(drift):
        raise ConfigError(f"drift_threshold={drift!r} is invalid: allowed is a number > 0")
    from tuner.measure.hygiene import (DEFAULT_WINDOW_S, MIN_WINDOW_S, allowed_cpus,
                                       check_contention_mode, check_threads)
    # the CPUs it will run on are known where it runs (a Slurm sweep's jobs run launcher=local)
    here = (cfg.get("launcher") or {}).get("kind", "local") == "local"
    for check, value in ((lambda v: check_threads(v, allowed_cpus() if here else None),
                          cfg.get("threads", "auto")),
                         (check_contention_mode, cfg.get("contention", "wait"))):
        try:
            check(value)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    integer("min_held_out_prompts", cfg.get("min_held_out_prompts", 3), 1, "an integer >= 1")
    wait = cfg.get("contention_wait_s", 120)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait < math.inf:
        raise ConfigError(f"contention_wait_s={wait!r} is invalid: allowed is a number of "
                          "seconds > 0")
    window = cfg.get("contention_window_s", DEFAULT_WINDOW_S)
    if isinstance(window, bool) or not isinstance(window, (int, float)) or \
            not MIN_WINDOW_S <= window < math.inf:
        raise ConfigError(f"contention_window_s={window!r} is invalid: allowed is a number of "
                          f"seconds >= {MIN_WINDOW_S}")
    caps = plain(cfg.get("cpu_budget")) or {}
    for key, low in CPU_BUDGET.items():
        if key in caps:
            integer(f"cpu_budget.{key}", caps[key], low, f"an integer >= {low}")


def generation_budget(cfg: DictConfig, task: Mapping[str, Any],
                      models: Mapping[str, Any]) -> tuple[int, str]:
    """(max_new_tokens a study will generate, the setting it comes from), as ``budget`` resolves
    it: ``budget=auto`` without a GPU caps it at cpu_budget.max_new_tokens."""
    wanted = int(task["max_new_tokens"])
    cap = (plain(cfg.get("cpu_budget")) or {}).get("max_new_tokens")
    if cfg.budget.mode == "auto" and cap is not None and int(cap) < wanted:
        from decoding.models import resolve_device
        if resolve_device(models["target"].get("device")).type != "cuda":
            return int(cap), "cpu_budget.max_new_tokens"
    return wanted, "task.max_new_tokens"


def check_launcher(launcher: Mapping[str, Any]) -> None:
    kind = launcher.get("kind")
    if kind == "local":
        return
    if kind != "slurm":
        raise ConfigError(f"launcher.kind={kind!r} is unknown: allowed are local, slurm")
    from tuner.cluster.slurm import SlurmSettings
    try:
        SlurmSettings.from_config(launcher)
    except ValueError as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    import shutil
    if shutil.which("sbatch") is None:
        raise ConfigError("launcher=slurm: sbatch is not installed here (allowed: a Slurm "
                          "login node, or scripts/services.sh for a one-machine cluster)")
