"""The method and its sampling settings: the class ``_target_`` names, its real signature, the
parameters and search space it is given, and temperature / top-k / top-p / seed.

The method's module is imported (to read its signature); nothing is instantiated.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tuner.config.errors import ConfigError
from tuner.config.values import get_class, integer
from tuner.search.space import check_active_when, distributions, validate_params

if TYPE_CHECKING:
    from decoding.base import DecodingMethod

SAMPLING_ARGS = ("temperature", "top_k", "top_p", "seed")


def method_class(method_cfg: Mapping[str, Any]) -> type[DecodingMethod]:
    """The class named by ``_target_``: it must be defined in a ``decoding.`` module (a union of
    methods: the capabilities its members share, ``tuner.config.union.union_class``)."""
    if isinstance(method_cfg.get("members"), Mapping):
        return union_class(method_cfg)
    target = str(method_cfg.get("_target_", ""))
    if not target.startswith("decoding."):
        raise ConfigError(f"method._target_={target!r} is not allowed: only classes defined "
                          "under 'decoding.' can be instantiated")
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
    from decoding.base import DecodingMethod    # declares what a method can do (capabilities)
    if not issubclass(cls, DecodingMethod):
        raise ConfigError(f"method._target_={target!r} is not a decoding method: allowed are "
                          "subclasses of decoding.base.DecodingMethod (they declare their "
                          "capabilities)")
    return cls


def union_class(method: Mapping[str, Any]) -> type[DecodingMethod]:
    """A union of methods' class (``tuner.config.union``): the capabilities its members share,
    what a study reads of a union (one prompt order for every trial where any member may keep
    a history); a point's own capabilities are its member's."""
    return _union_class(tuple(str(m["_target_"]) for m in method["members"].values()))


@functools.lru_cache(maxsize=32)
def _union_class(targets: tuple[str, ...]) -> type[DecodingMethod]:
    from decoding.base import DecodingMethod
    classes = [method_class({"_target_": t}) for t in targets]
    return type("UnionOfMethods", (DecodingMethod,), {
        "__module__": __name__, "__doc__": union_class.__doc__,
        "keeps_history": any(c.keeps_history is not False for c in classes),
        "replayable": all(c.replayable for c in classes),
        "traceable": all(c.traceable for c in classes),
        "supports_compiled": all(c.supports_compiled for c in classes),
        "head_version": None, "draft_size_params": ()})


def method_arguments(cls: type) -> list[str]:
    """The hyperparameters a method takes (everything but models and the sampling arguments)."""
    from decoding.api import hyperparameters   # the one definition, shared with build_method
    return hyperparameters(cls)


def check_method(method: Mapping[str, Any]) -> None:
    """The method's class, its parameters and space (an engine server's mapping: no class)."""
    if "engine" in method:             # engine=llamacpp...: knobs checked by its engine object (tuner.engines)
        check_space(method.get("params") or {}, method.get("space") or {})
        return
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
    check_space(params, space)
    if not isinstance(method.get("needs_draft"), bool):
        raise ConfigError(f"method.needs_draft={method.get('needs_draft')!r} is invalid: allowed "
                          "are true, false")
    from decoding.api import takes_draft
    if method["needs_draft"] != takes_draft(cls):
        takes = takes_draft(cls)
        raise ConfigError(f"method.needs_draft={method['needs_draft']} contradicts "
                          f"{method['_target_']}, which takes {'a' if takes else 'no'} draft "
                          f"model: allowed is needs_draft={str(takes).lower()}")


def check_space(params: Mapping[str, Any], space: Mapping[str, Any]) -> None:
    """The space is well formed, the defaults lie inside it, every searched name has one."""
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
    integer("seed", seed, 0, "an integer >= 0")


def method_choice(cfg: Any) -> str:
    """The conf/method file chosen (``method=prompt_lookup``), from Hydra's record of choices."""
    from omegaconf import OmegaConf

    from tuner.config.values import plain
    chosen = OmegaConf.select(cfg, "hydra.runtime.choices.method", default=None)
    if chosen is None:
        from hydra.core.hydra_config import HydraConfig
        try:
            chosen = HydraConfig.get().runtime.choices.get("method")
        except ValueError:                 # composed outside Hydra's app
            chosen = None
    return str(chosen or plain(cfg.method)["_target_"].split(".")[-1].lower())
