"""The methods a model pair and an engine support: the members of a cross-method study.

Each member is the whole config as ``python -m tuner <the same overrides> method=<name>`` would
compose it (Hydra's own composition: a method's YAML, its defaults list, its interpolations into
``models``), validated as a study of that method is (``tuner.engines.validated``). A method whose
config does not validate here (its draft model or EAGLE head is missing, the engine does not offer
it, it samples otherwise than the study) is left out with the one line its validation gave. The
methods are read from ``conf/method/*.yaml`` (vanilla excepted: "off" is always an answer), so a
new method's YAML makes it a member with no other edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from tuner.config.errors import ConfigError
from tuner.config.values import plain

CONF = Path(__file__).resolve().parents[2] / "conf"
OFF = "vanilla"                 # speculation off: an answer of every cross-method study


@dataclass(frozen=True)
class Member:
    """One method of the union: its name (the conf/method file) and its composed config."""

    name: str
    cfg: DictConfig             # the whole config, composed with method=<name>, validated
    priced: bool = True         # False: no profile prices its drafts (an EAGLE head): it is
    #                             validated without a prediction and measured, not ranked

    @property
    def method(self) -> dict[str, Any]:
        return plain(self.cfg.method)


@dataclass(frozen=True)
class Union:
    """The members, in conf/method's order, and the methods left out with their one line."""

    members: tuple[Member, ...]
    left_out: tuple[tuple[str, str], ...]      # (name, why)

    def lines(self) -> list[str]:
        """What a study says of its union before anything loads."""
        said = [f"methods: {', '.join(m.name for m in self.members)} (and off: vanilla)"]
        said += [f"method={m.name}: no hardware profile prices its drafts (an EAGLE head's "
                 "forwards): measured at its heuristic start point, not ranked"
                 for m in self.members if not m.priced]
        return said + [f"method={name} left out: {why}" for name, why in self.left_out]


def method_names(conf: Path = CONF) -> list[str]:
    """Every method conf/method holds, vanilla and auto (the union itself) excepted, by name."""
    return sorted(p.stem for p in (conf / "method").glob("*.yaml") if p.stem not in (OFF, "auto"))


def overrides_of(cfg: DictConfig) -> list[str]:
    """The command line's overrides of ``cfg`` (Hydra's record), without the method group and
    the method's own settings (a member is composed with its own)."""
    found = hydra_record(cfg, "overrides.task") or []
    return [str(o) for o in found
            if not str(o).lstrip("+~").split("=", 1)[0].split(".", 1)[0] == "method"]


def hydra_record(cfg: DictConfig, path: str) -> Any:
    """Hydra's record at ``path`` (``overrides.task``, ``runtime.choices.search``): in ``cfg``
    where it was composed with it, else the running app's; None where neither holds it."""
    from hydra.core.hydra_config import HydraConfig
    found = OmegaConf.select(cfg, f"hydra.{path}", default=None)
    if found is None:
        try:
            found = OmegaConf.select(HydraConfig.get(), path, default=None)
        except ValueError:                 # composed outside Hydra's app: none known
            return None
    return found


def group_choice(cfg: DictConfig, group: str) -> str | None:
    """The option of config group ``group`` that ``cfg`` was composed with (Hydra's record)."""
    found = hydra_record(cfg, f"runtime.choices.{group}")
    return None if found is None else str(found)


def compose_member(overrides: Sequence[str], name: str, conf: Path = CONF) -> DictConfig:
    """The config of ``overrides`` with ``method=<name>``, composed by Hydra from ``conf``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    argv = [*overrides, f"method={name}"]
    if GlobalHydra.instance().is_initialized() and conf == CONF:
        return compose("config", overrides=argv, return_hydra_config=True)
    previous = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            return compose("config", overrides=argv, return_hydra_config=True)
    finally:
        if previous is not None:
            GlobalHydra.instance().initialize(previous)


UNPRICED = ("search.profile=null", "search.kind=grid")   # how an unpriced member validates


def predicts(cfg: DictConfig) -> bool:
    """Whether ``cfg``'s study ranks or records predictions by a hardware profile."""
    search = OmegaConf.select(cfg, "search", default=None) or {}
    return search.get("kind") == "predict" or bool(search.get("profile"))


def method_union(cfg: DictConfig, names: Sequence[str] | None = None,
                 conf: Path = CONF) -> Union:
    """The members among ``names`` (None: every method of ``conf``) for ``cfg``'s models,
    engine, sampling and task; the others left out with their line. One line (``ConfigError``)
    for a name that is no method, and for a list of which no method is supported."""
    from tuner.config.methods import method_class
    from tuner.engines import validated
    known = method_names(conf)
    wanted = known if names is None else [str(n) for n in names]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise ConfigError(f"methods={list(wanted)} is invalid: {unknown[0] if unknown else 'none'}"
                          f" is not a method; allowed are a list of {known} (vanilla, off, is "
                          "always an answer)")
    overrides = overrides_of(cfg)
    search = group_choice(cfg, "search")
    if search and not any(o.lstrip("+~").split("=", 1)[0] == "search" for o in overrides):
        overrides.append(f"search={search}")     # the union's own (method=auto's: predict)
    sampling = plain(cfg.sampling)
    members, left_out = [], []
    for name in wanted:
        try:
            member = compose_member(overrides, name, conf)
        except Exception as err:           # noqa: BLE001 - Hydra's own composition errors
            left_out.append((name, f"its config does not compose: {err}".splitlines()[0]))
            continue
        if plain(member.sampling) != sampling:
            left_out.append((name, f"it samples {plain(member.sampling)} (its YAML's default), "
                                   f"the study {sampling}: set sampling=... to compare them"))
            continue
        priced = predicts(member) and method_class(plain(member.method)).traceable
        if predicts(member) and not priced:     # measured, not ranked: validated so
            member = compose_member([*overrides, *UNPRICED], name, conf)
        try:
            validated(member)
        except ConfigError as err:
            left_out.append((name, str(err)))
            continue
        members.append(Member(name, member, priced or not predicts(cfg)))
    if not members:
        raise ConfigError(f"methods={list(wanted)} is invalid here: none is supported by these "
                          "models and this engine (" + "; ".join(
                              f"{n}: {why}" for n, why in left_out[:3]) +
                          (" ..." if len(left_out) > 3 else "") + ")")
    return Union(tuple(members), tuple(left_out))


AUTO = "auto"               # method=auto: conf/method/auto.yaml


def is_auto(cfg: DictConfig) -> bool:
    """Whether ``cfg`` asks for a study across methods (``method=auto``)."""
    return OmegaConf.select(cfg, "method.kind", default=None) == AUTO
