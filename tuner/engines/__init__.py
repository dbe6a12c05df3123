"""The engines the tuner measures in (``engine=``), each one object in one module
(``tuner.engines.base.Engine``) plus one ``conf/engine/<kind>.yaml``.

``ENGINES`` registers each engine once (imported when chosen); ``engine_named`` gives its object,
``validated`` checks a whole config with it. Nothing outside this package and ``conf/engine/``
names an engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tuner.config.errors import ConfigError
from tuner.config.values import plain

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from tuner.engines.base import Engine

DEFAULT = "hf"                  # engine.kind when a config has no engine group (older studies)
ENGINES = {"hf": "tuner.engines.hf:HFEngine",
           "llamacpp": "tuner.engines.llamacpp:LlamaCppEngine",
           "vllm": "tuner.engines.vllm:VllmEngine"}


def server_kinds() -> str:
    """How messages name the engine servers (every engine but the in-process default)."""
    return " | ".join(f"engine={kind}" for kind in ENGINES if kind != DEFAULT)


def engine_config(cfg: DictConfig) -> dict[str, Any]:
    """The config's ``engine`` node as plain values (the default engine when absent)."""
    found = plain(cfg.get("engine")) or {}
    return {"kind": DEFAULT, **found} if "kind" not in found else found


def engine_named(kind: Any) -> Engine:
    """The engine object of ``engine.kind``; one line for an unknown kind."""
    if kind not in ENGINES:
        servers = " | ".join(f"engine={k}" for k in ENGINES if k != DEFAULT)
        raise ConfigError(f"engine.kind={kind!r} is unknown: allowed are {list(ENGINES)} "
                          f"(engine={DEFAULT} | {servers})")
    module, _, name = ENGINES[kind].partition(":")
    return getattr(importlib.import_module(module), name)()


def engine_of(cfg: DictConfig) -> Engine:
    """The engine object ``cfg`` chooses."""
    return engine_named(engine_config(cfg)["kind"])


def validated(cfg: DictConfig) -> Engine:
    """Check every setting of ``cfg`` (``tuner.config.validate``) with its engine's own checks;
    returns the engine object."""
    from tuner.config.validate import validate
    validate(cfg, engine_of)
    return engine_of(cfg)
