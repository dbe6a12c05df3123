"""Small helpers every config check shares: a plain view of a config node, integer settings."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from tuner.config.errors import ConfigError


def plain(cfg: Any) -> Any:
    """Dicts and lists for a DictConfig (interpolations resolved); anything else unchanged."""
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg


def integer(name: str, value: Any, low: int, allowed: str) -> int:
    """``value`` when it is an int >= ``low`` (not a bool); else one line naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}={value!r} is invalid: allowed is {allowed}")
    return value


def get_class(path: str) -> Any:
    """``hydra.utils.get_class`` (resolves exactly as ``instantiate`` will), minus its ERROR log
    record on failure: the caller turns the failure into its one line."""
    import logging

    from hydra.utils import get_class as hydra_get_class
    logger = logging.getLogger("hydra.utils")
    disabled, logger.disabled = logger.disabled, True
    try:
        return hydra_get_class(path)
    finally:
        logger.disabled = disabled
