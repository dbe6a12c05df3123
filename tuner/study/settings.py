"""``StudySettings``: everything a study needs to know, built once from the validated config.

``StudySettings.from_config(cfg)`` validates the whole config (one-line errors, nothing loaded),
resolves the budget (CPU caps under ``budget=auto``), splits the task's prompts into tuning and
held-out slices, fingerprints what changes the measurements and names the study. Every later
stage (storage, evaluator, optimizer, trackers, report) reads this frozen record; the Slurm launch
and the replay use it too, without touching any storage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

from decoding.models import resolve_device
from tuner.config.errors import ConfigError
from tuner.config.identity import fingerprint, short_hash
from tuner.search.racing import Race
from tuner.config.methods import method_choice
from tuner.config.validate import check_journal, plain
from tuner.engines import engine_config, engine_named, validated
from tuner.engines.base import Engine
from tuner.measure.bounds import DEFAULT_SLACK
from tuner.measure.energy import EnergyMeter
from tuner.measure.evaluator import MeasureSettings, MethodView
from tuner.measure.hygiene import DEFAULT_WINDOW_S
from tuner.measure.quality import QualityBound
from tuner.measure.rates import Traffic
from tuner.predict.cache import AUTO
from tuner.search.objectives import ENERGY, PERPLEXITY, better_first, directions
from tuner.study.storage import journal_path
from tuner.study.union import Union, group_choice, is_auto, method_names, method_union
from tuner.tasks.task import Prompt, Task


@dataclass(frozen=True)
class StudySettings(MethodView):
    """One study's settings (plain values; see the module docstring)."""

    name: str                          # the Optuna study name (and MLflow parent run name)
    family: str                        # name without a study_tag (scheduled re-runs share it)
    fingerprint: Mapping[str, str]     # tuner.config.identity: what changes the measurements
    task: Task
    tuning: tuple[Prompt, ...]         # prompts the search measures on
    held_out: tuple[Prompt, ...]       # prompts only the winner's confirmation sees
    budget: Mapping[str, int]          # n_prompts, n_held_out, max_new_tokens, n_trials
    concurrency: tuple[int, ...]       # requests in flight at once, one measurement per level
    sampling: Mapping[str, Any]        # temperature, top_k, top_p
    seed: int
    models: Mapping[str, Any]          # target/draft specs (decoding.models)
    method: Mapping[str, Any]          # _target_, lossless, needs_draft, params, space
    method_choice: str                 # the conf/method file name (replay commands)
    engine: Mapping[str, Any]          # conf/engine: kind and its settings (tuner.engines)
    choices: Mapping[str, str]         # the config groups chosen (models=tiny, engine=..., ...)
    search: Mapping[str, Any]          # kind, sampler, pruner, objectives, bounds, ranges
    objectives: tuple[str, ...]
    directions: tuple[str, ...]
    bound: QualityBound
    baseline: str                      # per_trial | per_study
    warmup_prompts: int
    near_tie_ulps: float
    drift_threshold: float
    device: torch.device
    threads: Any                       # "auto" or an int (tuner.measure.hygiene)
    contention: str                    # wait | warn | fail
    contention_wait_s: float           # wait: the longest wait for a quiet machine per pair
    contention_window_s: float         # seconds of each load sample before a pair
    storage: str | None
    studies_dir: str
    heartbeat: Mapping[str, Any]
    tracking: Mapping[str, Any]
    phase: str
    resume: str
    config_yaml: str                   # the resolved config (an MLflow artifact)
    min_held_out_prompts: int = 3      # fewer held-out prompts: no non-vanilla recommendation
    notices: tuple[str, ...] = ()      # lines to print before the study starts
    traffic: Traffic = Traffic()       # budget.request_rate, requests_per_rate, search.slo
    profile: Any = None                # search.profile loaded (tuner.predict.surface) or None
    predict_for: Any = None            # search.predict_for loaded: another machine's profile
    bound_slack: float = 0.25          # tuner.measure.bounds: the physical bound's slack
    control: Mapping[str, bool] = field(default_factory=lambda: {"guard": True,
                                                                 "override": False})
    #                                    the A/A control's guard (tuner.study.guard); not in the
    #                                    fingerprint: it decides whether to measure, not how

    # -- derived ---------------------------------------------------------------------------------

    @property
    def sign(self) -> int:
        """+1 when the first objective is maximised: plans and the winner maximise sign·value."""
        return better_first(self.directions[0])

    @property
    def scores_perplexity(self) -> bool:
        """Perplexity costs one target forward per output (after the timed window)."""
        return not self.lossless or bool(set(PERPLEXITY) & set(self.objectives))

    @property
    def race(self) -> Race | None:
        """``search.race`` (``tuner.search.racing``), where the search has a plan and its one
        objective is fed per prompt (speedup, decode_speedup); None otherwise."""
        fed = list(self.objectives) in (["speedup"], ["decode_speedup"])
        if not fed or self.search.get("kind") not in ("heuristic", "grid", "predict"):
            return None
        return Race.from_config(self.search.get("race"))

    @property
    def untimed(self) -> str:
        """``search.untimed`` resolved: ``auto`` is a sweep across methods (a union: Algorithm
        1 per method, ``tuner.predict.halving.coordinate_sweep``), halving for one method."""
        from tuner.config.union import is_union
        chosen = str(self.search.get("untimed", "auto"))
        if chosen == "auto":
            return "sweep" if is_union(self.method) else "halving"
        return chosen

    @property
    def untimed_workers(self) -> int:
        """``search.untimed_workers`` resolved (``tuner.predict.workers.worker_count``)."""
        from tuner.measure.hygiene import allowed_cpus
        from tuner.predict.workers import worker_count
        return worker_count(self.search.get("untimed_workers", "auto"), len(allowed_cpus()),
                            self.device.type)

    @property
    def journal(self) -> Path:
        return journal_path(self.studies_dir, self.name)

    def searched(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in params.items() if k in self.space}

    @property
    def engine_object(self) -> Engine:
        """The engine the study measures in (``tuner.engines``): its checks, capabilities,
        deployable answer and backend."""
        return engine_named(self.engine["kind"])

    @property
    def measuring(self) -> MeasureSettings:
        """What the evaluator needs of this study (nothing else): each ``MeasureSettings`` field
        is this record's field (or property) of the same name, but the two derived here."""
        derived = {"work_dir": str(Path(self.studies_dir) / self.name),
                   "head_identity": self.fingerprint.get("method.head")}
        return MeasureSettings(**{f.name: derived[f.name] if f.name in derived
                                  else getattr(self, f.name) for f in fields(MeasureSettings)})

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: DictConfig) -> StudySettings:
        """The settings of ``cfg``'s study (``method=auto``: the study across methods,
        ``tuner.study.union.union_settings``)."""
        if is_auto(cfg):
            return union_settings(cfg)[0]
        engine_object = validated(cfg)
        choice = method_choice(cfg)
        method = engine_object.method(cfg, choice)
        task_cfg, engine = plain(cfg.task), engine_config(cfg)
        # search.objectives' auto resolved: in process that is [speedup], as before auto, so
        # in-process studies keep their fingerprint and name
        search = {**plain(cfg.search), "objectives": engine_object.objectives(cfg)}
        try:
            task = Task(task_cfg)
        except ValueError as err:          # e.g. task.categories that the task does not have,
            raise ConfigError(str(err)) from None   # a malformed record in a user's prompt file
        device = resolve_device(plain(cfg.models)["target"].get("device"))
        budget, notices = resolve_budget(cfg, device.type == "cuda")
        try:
            tuning, held_out = task.split(budget["n_prompts"], budget["n_held_out"])
        except ValueError as err:
            raise ConfigError(str(err)) from None
        objectives = tuple(search["objectives"])
        _check_energy(objectives, device)
        from tuner.config.search import check_pruner_reach
        check_pruner_reach(search, budget["n_prompts"] * len(cfg.budget.concurrency))
        sampling = plain(cfg.sampling)
        threads = cfg.get("threads", "auto")
        concurrency = tuple(cfg.budget.concurrency)
        budget_cfg = plain(cfg.budget)
        traffic = Traffic(tuple(float(r) for r in budget_cfg.get("request_rate") or ()),
                          int(budget_cfg.get("requests_per_rate", 8)), search.get("slo"))
        profile = None
        if search.get("profile") == AUTO:  # this machine's, cached; made in the run if none
            profile = auto_profile(engine_object, plain(cfg.models), threads)
        elif search.get("profile"):        # one line for a profile of other models or engine
            from tuner.predict.surface import load_profile
            profile = load_profile(str(search["profile"]), models=plain(cfg.models),
                                   engine=engine_object.name, setting="search.profile")
            sizes = profile.batch_sizes()
            outside = [c for c in concurrency if not sizes[0] <= c <= sizes[-1]]
            if outside:
                raise ConfigError(f"search.profile={search['profile']!r} was measured at batch "
                                  f"sizes {list(sizes)}, which do not reach "
                                  f"budget.concurrency level {outside[0]}: allowed is a profile "
                                  "measured up to every level (python -m tuner.profile --engine "
                                  f"{engine_object.name} --levels "
                                  f"{' '.join(map(str, concurrency))})")
        if profile is not None and profile.flags:      # not believed when it was made
            line = (f"search.profile={search['profile']!r} was FLAGGED when it was made "
                    f"({profile.flags[0]}{'; ...' if len(profile.flags) > 1 else ''})")
            if search["kind"] == "predict":
                raise ConfigError(f"{line}: search=predict would rank by it; allowed is a "
                                  "profile made again on a quiet machine (python -m "
                                  "tuner.profile; check uptime first)")
            notices = (*notices, f"{line}: no trial records a prediction by it; make it again "
                                 "on a quiet machine")
            profile = None
        predict_for = None
        if search.get("predict_for"):      # another machine: our loops' acceptance, its costs
            from tuner.predict.surface import load_profile
            predict_for = load_profile(str(search["predict_for"]), models=plain(cfg.models),
                                       engine=engine_object.name, setting="search.predict_for")
            if predict_for.flags:
                notices = (*notices, f"search.predict_for={search['predict_for']!r} was FLAGGED "
                                     f"when it was made ({predict_for.flags[0]}): its "
                                     "predictions carry that doubt")
        print_ = fingerprint(
            task=task_cfg, tuning_ids=[p.id for p in tuning],
            held_out_ids=[p.id for p in held_out], budget=budget, sampling=sampling,
            seed=int(cfg.seed), models=plain(cfg.models), method=dict(method), search=search,
            baseline=str(cfg.baseline), warmup_prompts=int(cfg.warmup_prompts),
            near_tie_ulps=float(cfg.near_tie_ulps), device=device, threads=threads,
            concurrency=concurrency, engine=engine_object.identity(engine, concurrency),
            data_sha256=task.data_sha256, traffic=traffic.identity())
        family = f"{cfg.study_prefix}-{short_hash(print_)}"
        tag = cfg.get("study_tag")
        name = str(cfg.study_name or (f"{family}-{tag}" if tag else family))
        if not cfg.storage:
            check_journal(journal_path(cfg.studies_dir, name))   # a torn last line: refused
        return cls(
            name=name, family=family, fingerprint=print_, task=task, tuning=tuple(tuning),
            held_out=tuple(held_out), budget=budget, concurrency=concurrency,
            sampling=sampling, seed=int(cfg.seed),
            models=plain(cfg.models), method=method, method_choice=choice, engine=engine,
            choices=group_choices(cfg),
            search=search,
            objectives=objectives, directions=tuple(directions(objectives)),
            bound=QualityBound.from_search(search), baseline=str(cfg.baseline),
            warmup_prompts=int(cfg.warmup_prompts), near_tie_ulps=float(cfg.near_tie_ulps),
            drift_threshold=float(cfg.drift_threshold), device=device, threads=threads,
            contention=str(cfg.get("contention", "wait")),
            contention_wait_s=float(cfg.get("contention_wait_s", 120)),
            contention_window_s=float(cfg.get("contention_window_s", DEFAULT_WINDOW_S)),
            storage=cfg.storage or None,
            studies_dir=str(cfg.studies_dir), heartbeat=plain(cfg.get("heartbeat")) or {},
            tracking=plain(cfg.tracking), phase=str(cfg.get("phase", "all")),
            resume=str(cfg.resume), config_yaml=resolved_yaml(cfg), notices=notices,
            min_held_out_prompts=int(cfg.get("min_held_out_prompts", 3)), traffic=traffic,
            profile=profile, predict_for=predict_for, control=control_settings(cfg),
            bound_slack=bound_slack(cfg))


def auto_profile(engine: Engine, models: Mapping[str, Any], threads: Any) -> Any:
    """``search.profile=auto``: the profile cached for these models, this machine, engine and
    thread count (``tuner.predict.cache``), or None: the run makes it before the models load
    (``tuner.run``). Our own loops only: an engine server's profile is made by ``python -m
    tuner.profile --engine <kind>`` (one line)."""
    if not engine.own_loops:
        raise ConfigError(f"search.profile=auto is invalid for engine={engine.name}: a profile "
                          "is made here on first use for our own loops only; allowed is a "
                          f"profile file (python -m tuner.profile --engine {engine.name} ...)")
    from tuner.predict.cache import Key, cached, thread_count
    return cached(Key.here(models, engine.name, thread_count(threads)))


def bound_slack(cfg: DictConfig) -> float:
    """``bound_slack``: a number > 0 (one line otherwise)."""
    value = cfg.get("bound_slack", DEFAULT_SLACK)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"bound_slack={value!r} is invalid: allowed is a number > 0 (the "
                          "fraction a paired speedup may exceed its tokens per decode step by "
                          "before it is measured again; default 0.25)")
    return float(value)


def control_settings(cfg: DictConfig) -> dict[str, bool]:
    """``control.guard`` and ``control.override``, each a boolean (one line otherwise)."""
    given = plain(cfg.get("control")) or {}
    out = {"guard": True, "override": False}
    for key, value in given.items():
        if key not in out:
            raise ConfigError(f"control.{key} is not a setting: allowed are control.guard, "
                              "control.override")
        if not isinstance(value, bool):
            raise ConfigError(f"control.{key}={value!r} is invalid: allowed are true, false")
        out[key] = value
    return out


def resolve_budget(cfg: DictConfig, on_gpu: bool) -> tuple[dict[str, int], tuple[str, ...]]:
    """The task's budget, capped by ``cpu_budget`` under ``budget=auto`` without a GPU."""
    budget = {"n_prompts": int(cfg.task.n_prompts), "n_held_out": int(cfg.task.n_held_out),
              "max_new_tokens": int(cfg.task.max_new_tokens),
              "n_trials": int(cfg.search.n_trials)}
    if cfg.budget.mode == "auto" and not on_gpu:
        capped = {k: min(v, int(cfg.cpu_budget[k])) for k, v in budget.items()}
        if capped != budget:
            return capped, (f"No GPU: CPU-sized budget chosen automatically {capped} (the task "
                            f"asks for {budget}); run with budget=full for the task's own "
                            "settings.",)
    return budget, ()


def group_choices(cfg: DictConfig) -> dict[str, str]:
    """Hydra's record of the config group options this run composed."""
    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default=None)
    if choices is None:
        from hydra.core.hydra_config import HydraConfig
        try:
            choices = HydraConfig.get().runtime.choices
        except ValueError:                 # composed outside Hydra's app
            return {}
    return {str(k): str(v) for k, v in dict(choices).items() if v is not None}


def resolved_yaml(cfg: DictConfig) -> str:
    """The config as run (Hydra's own section left out)."""
    return OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]),
                             resolve=True)


def _check_energy(objectives: tuple[str, ...], device: torch.device) -> None:
    energy = [o for o in objectives if o in ENERGY]
    if not energy:
        return
    meter = EnergyMeter(device)
    if not meter.available:
        raise ConfigError(f"search.objectives={list(objectives)} includes {energy[0]}, which "
                          f"needs GPU energy measurements, unavailable here: {meter.reason}")


def union_settings(cfg: DictConfig) -> tuple[StudySettings, Union]:
    """``method=auto``: the settings of one study across the union's members (their configs
    validated one by one, each as a study of its own: ``tuner.study.union.method_union``; the
    union's method and space: ``tuner.config.union``), and the union. Members a profile prices
    come first, cheapest deployment first (``tuner.search.racing.deployment_rank``): trial 0 is
    the first one's default and the study's search is its. One line (``ConfigError``) for what
    such a study cannot do here, before anything loads."""
    from tuner.config.search import check_search
    from tuner.config.union import union_method
    from tuner.search.racing import deployment_rank
    method = plain(cfg.method)
    unknown = sorted(set(method) - {"kind", "members"})
    if unknown:
        raise ConfigError(f"method.{unknown[0]} is not a setting of method=auto: allowed are "
                          "method.members (all, or a list of methods)")
    wanted = method.get("members", "all")
    if wanted != "all" and not (isinstance(wanted, list) and wanted):
        raise ConfigError(f"method.members={wanted!r} is invalid: allowed are all, or a "
                          f"non-empty list of {method_names()}")
    engine = engine_named(str(cfg.engine.kind))
    search = plain(cfg.search)
    kind = search.get("kind")
    if kind == "predict" and not engine.own_loops:
        raise ConfigError(f"search=predict is invalid for method=auto on engine={engine.name}: "
                          "nothing ranks an engine server's points before they are measured "
                          "(its profile prices a trial's own acceptance, after it); allowed "
                          f"is search=heuristic (method=auto engine={engine.name} "
                          "search=heuristic: Algorithm 1 across methods, raced on wall clock)")
    if kind not in ("predict", "heuristic"):
        chosen = group_choice(cfg, "search") or kind      # search=tpe is kind sampler
        raise ConfigError(f"search={chosen} is invalid for method=auto: a study across methods "
                          "ranks every method's points by one profile, then races them "
                          "(search=predict), or sweeps the methods at their start points and "
                          "then the best one's parameters (search=heuristic); allowed are "
                          f"predict and heuristic (one method's own searches: method=<name> "
                          f"search={chosen})")
    if search.get("predict_for"):
        raise ConfigError("search.predict_for is invalid for method=auto: another machine's "
                          "answer is predicted for one method's grid; allowed is null here (run "
                          "method=<the winner's method> search.predict_for=... for it)")
    # its own settings, once, before any member's (objectives resolved as from_config does)
    check_search({**search, "objectives": engine.objectives(cfg)}, {}, "")
    union = method_union(cfg, None if wanted == "all" else [str(n) for n in wanted])
    members = sorted(union.members, key=lambda m: (not m.priced, deployment_rank(m.name),
                                                   m.name))
    if not members[0].priced:
        raise ConfigError(f"method.members={[m.name for m in members]} is invalid for "
                          "method=auto: no profile prices any of them (an EAGLE head's forwards), "
                          "so nothing can be ranked; allowed is a list with a method a profile "
                          "prices, or method=<name> for one of them")
    union = Union(tuple(members), union.left_out)
    studies = {m.name: StudySettings.from_config(m.cfg) for m in members}
    base = studies[members[0].name]
    joint = union_method({name: s.method for name, s in studies.items()},
                         [m.name for m in members if not m.priced])
    print_ = {k: v for k, v in base.fingerprint.items() if not k.startswith("method.")}
    print_["method._target_"] = json.dumps("auto")
    print_["method.members"] = json.dumps(
        {name: {k: v for k, v in s.fingerprint.items() if k.startswith("method.")}
         for name, s in studies.items()}, sort_keys=True)
    family = f"{cfg.study_prefix}-{short_hash(print_)}"
    tag = cfg.get("study_tag")
    name = str(cfg.study_name or (f"{family}-{tag}" if tag else family))
    if not cfg.storage:
        check_journal(journal_path(cfg.studies_dir, name))
    said = union.lines()
    notices = tuple(said) + tuple(n for n in base.notices if n not in said)
    return replace(base, name=name, family=family, fingerprint=print_, method=joint,
                   method_choice="auto", notices=notices, config_yaml=resolved_yaml(cfg)), union


def member_settings(settings: StudySettings, name: str) -> StudySettings:
    """A study across methods seen from member ``name`` (its method, its choice): what its
    winner's replay line, best YAML and outcome are written with."""
    return replace(settings, method=dict(settings.method["members"][name]), method_choice=name)
