"""``Engine``: what one inference engine is to the tuner, in one object.

An engine (``engine.kind`` in ``conf/engine/<kind>.yaml``) owns:

* its config checks (the models it can load, the methods it offers, its knobs and their spaces),
  run by ``tuner.config.validate`` before anything expensive;
* the method as it sees it (``method``): the conf/method config itself in process, an engine's
  knob mapping for a server, in the shape every later stage reads;
* its part of the study identity (``identity``: its settings and the build that runs);
* where its program comes from and how it is installed (``program``);
* its declared capabilities (the ``ClassVar``s below, each declared by every engine class in
  its own body and read, never probed): the concurrency levels it serves, whether it honours
  ``engine.compile``, whether it streams, predicts or measures a cost surface, and its knob of
  drafted tokens per step;
* where a winner's parameters live in the best YAML (``best_params`` / ``recorded_params``);
* its backend (``evaluator``): what generates a batch of prompts under one setting and returns
  tokens, timings and acceptance counts (``tuner.measure.evaluator.Evaluator``).

Nothing outside ``tuner/engines/`` and ``conf/engine/`` names an engine: the tuner asks the
object (``tuner.engines.engine_named``). docs/engines.md lists what a new engine provides.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Hashable, Mapping, Sequence

from omegaconf import DictConfig

from tuner.config.errors import ConfigError
from tuner.config.values import plain
from tuner.engines import server_kinds
from tuner.measure.figures import split_level
from tuner.search.objectives import ENGINE_ONLY, resolve

if TYPE_CHECKING:
    from tuner.engines.metrics import LiveMetrics
    from tuner.measure.evaluator import Evaluator, MeasureSettings
    from tuner.measure.timing import Timer



def acting(method: Mapping[str, Any], params: Mapping[str, Any], name: str) -> bool:
    """``params`` set ``name`` to a number and it acts there (the method's ``active_when``)."""
    from tuner.search.space import is_active
    space = method.get("space") or {}
    value = params.get(name)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        (name not in space or is_active(name, space[name], params))


class Engine:
    """One engine (see the module docstring). Subclasses set the class attributes and override
    the hooks; an engine object holds no state (one instance per process)."""

    name: ClassVar[str]                 # engine.kind
    display: ClassVar[str]              # how messages name it ("llama.cpp", "vLLM")
    max_concurrency: ClassVar[int] = 1  # the largest budget.concurrency level it serves
    # engine.compile=true is honoured (checked in ``check``: refused by an engine without it)
    compiles: ClassVar[bool] = False
    # measures its cost surface in a synthetic-acceptance mode (python -m tuner.profile --engine;
    # its evaluator's synthetic_spec, tuner.predict.synthetic)
    synthetic_surface: ClassVar[bool] = False
    # what search.objectives' ``auto`` stands for (tuner.search.objectives.resolve)
    default_objective: ClassVar[str] = "speedup"
    streams: ClassVar[bool] = False     # serves budget.request_rate (streamed, timed per token)
    # records predictions from a hardware profile (search.profile; tuner.predict) beside its
    # measurements: acceptance replayed in our own loops, priced by the profile's cost surface
    predicts: ClassVar[bool] = False
    # the method knob that sets the drafted tokens per step (k): the cost surface's and the
    # per-level schedule's axis (tuner.study.level_plan); None: no such knob
    draft_tokens_knob: ClassVar[str | None] = None
    # its methods are this project's decoding classes (decoding.*), whose capabilities
    # (keeps_history, replayable, ...) the study may read (tuner.config.methods.method_class)
    own_loops: ClassVar[bool] = False
    # what its server's /metrics names (python -m tuner.watch; tuner.engines.metrics); None: it
    # runs in our own loops, no server to watch
    live_metrics: ClassVar[LiveMetrics | None] = None
    # the knobs that can set the drafted tokens per step of its methods, in the order read: the
    # first one a point sets and that acts there (``active_when``) is its draft size (llama.cpp:
    # a draft model's n_max, an n-gram type's size_m, ngram-mod's mod_n_max); () where the
    # method class declares its own (``decoding.base.DecodingMethod.draft_size_params``)
    draft_size_knobs: ClassVar[tuple[str, ...]] = ()

    # -- config ------------------------------------------------------------------------------

    def check(self, cfg: DictConfig, choice: str) -> None:
        """One ``ConfigError`` line for anything this engine cannot run (nothing loaded)."""
        self.check_compile_flag(plain(cfg.get("engine")) or {})
        levels = list(plain(cfg.budget).get("concurrency") or [1])
        objectives = self.objectives(cfg)
        self.check_objectives(objectives if isinstance(objectives, list) else [], levels)
        if max(levels) > self.max_concurrency:
            self.refuse_levels(levels)
        rates = plain(cfg.budget).get("request_rate") or []
        if rates and not self.streams:
            raise ConfigError(f"budget.request_rate={rates} is invalid for engine={self.name}: "
                              "traffic at a request rate is sent to an engine server that "
                              "streams its tokens (engine=llamacpp, engine=vllm); allowed is [] "
                              "here")
        search = plain(cfg.search)
        for key in ("profile", "predict_for"):
            if search.get(key):
                self.check_prediction(cfg, choice, f"search.{key}={search[key]!r}")

    def check_compile_flag(self, engine: Mapping[str, Any]) -> None:
        """``engine.compile`` is a boolean, and true only for an engine that honours it
        (``compiles``)."""
        compile_ = engine.get("compile", False)
        if not isinstance(compile_, bool):
            raise ConfigError(f"engine.compile={compile_!r} is invalid: allowed are true and "
                              "false")
        if compile_ and not self.compiles:
            from tuner.engines import ENGINES, engine_named
            honoured = " | ".join(f"engine={k}" for k in ENGINES if engine_named(k).compiles)
            raise ConfigError(f"engine.compile=true is invalid for engine={self.name}: it has "
                              f"no compiled mode here; allowed is false, or {honoured}")

    def check_prediction(self, cfg: DictConfig, choice: str, setting: str) -> None:
        """``search.profile`` / ``search.predict_for``: a prediction needs our own loops and a
        method whose forwards a profile prices (all but EAGLE's head); at T > 0 its acceptance
        comes from seeded untimed runs (never a replay)."""
        if not self.predicts:
            raise ConfigError(f"{setting} is invalid for engine={self.name}: predictions from a "
                              "hardware profile are made in our own loops (engine=hf) so far; "
                              "allowed is null here")
        from tuner.config.methods import method_class
        if not method_class(plain(cfg.method)).traceable:
            raise ConfigError(f"{setting} is invalid for method={choice}: it drafts nothing "
                              "to predict (vanilla), or from an EAGLE head, whose forwards no "
                              "hardware profile prices yet; allowed are methods speculative, "
                              "block, tree, prompt_lookup (acceptance replayed), lookahead, "
                              "ouroboros, specinfer, mjsd (acceptance from an untimed run), or "
                              "null")
        if isinstance(plain(cfg.models).get("draft"), list):
            raise ConfigError(f"{setting} is invalid with several draft models "
                              f"(models.draft={plain(cfg.models)['draft']}): a profile prices "
                              "one draft model; allowed is one draft, or null")

    def schedule_form(self, schedule: Any,
                      base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A predicted per-batch-size schedule (``tuner.predict.schedule.Schedule``) in this
        engine's own form (nested data, ``tuner.predict.forms``), for the best YAML's ``deploy``
        block; ``base``: the fixed speculative settings the schedule completes (vLLM's
        ``--speculative-config`` entries but k: ``VllmEvaluator.speculative_base``)."""
        return {}

    def refuse_levels(self, levels: list[int]) -> None:
        raise ConfigError(f"budget.concurrency={levels} is invalid for engine={self.name}: "
                          f"allowed are levels up to {self.max_concurrency}")

    def objectives(self, cfg: DictConfig) -> Any:
        """``search.objectives`` with ``auto`` resolved for this engine (as given where it is
        not a list: the search check names it)."""
        return resolve(plain(cfg.search).get("objectives"), self.default_objective)

    def check_objectives(self, objectives: list[str], levels: list[int]) -> None:
        """Level objectives (``…@c4``) name a measured level; throughput needs several requests
        in flight, which only an engine that serves levels measures."""
        for name in objectives:
            level = split_level(str(name))[1]
            if level is not None and level not in levels:
                raise ConfigError(f"search.objectives={objectives}: {name} names concurrency "
                                  f"level {level}, which budget.concurrency={levels} does not "
                                  "measure")
            if (level is not None or name in ENGINE_ONLY) and self.max_concurrency == 1:
                raise ConfigError(f"search.objectives={objectives}: {name} is measured by "
                                  f"engine servers only ({server_kinds()}); engine={self.name} "
                                  "measures one request at a time")

    def method(self, cfg: DictConfig, choice: str) -> dict[str, Any]:
        """The method config the study runs (``_target_``, ``lossless``, ``needs_draft``,
        ``params``, ``space``): conf/method's unless the engine maps it onto its own knobs."""
        return plain(cfg.method)

    def identity(self, engine: Mapping[str, Any], concurrency: Sequence[int] = (1,)
                 ) -> dict[str, Any] | None:
        """What identifies this engine's measurements in the study fingerprint (None: nothing
        beyond the defaults every older study had); ``concurrency``: the study's levels."""
        return None

    def draft_size(self, method: Mapping[str, Any], params: Mapping[str, Any]) -> float | None:
        """The draft tokens one target forward of ``params`` verifies, as the method (a study's
        method config: ``_target_``, ``space``) or this engine declares them; None where it
        declares none or a declared knob does not act at ``params`` (a static tree's size, the
        n-gram cache's). Never guessed from a parameter's name. A union of methods' point
        (``tuner.config.union``): its member's."""
        from tuner.config.union import is_union, member_of
        if is_union(method):
            return self.draft_size(*member_of(method, params)[1:])
        if self.draft_size_knobs:
            knob = self.draft_size_knob(method, params)
            return None if knob is None else float(params[knob])
        from tuner.config.methods import method_class
        names = method_class(method).draft_size_params
        if not names or not all(acting(method, params, k) for k in names):
            return None
        return math.prod(float(params[name]) for name in names)

    def baseline_key(self, engine: Mapping[str, Any], method: Mapping[str, Any],
                     params: Mapping[str, Any]) -> Hashable:
        """What the baseline server a trial at ``params`` measures against is launched with:
        points of one key share one baseline (a plan orders them together, so that it starts
        once per key: ``tuner.search.plans.GridPlan``). None here: one baseline for every point
        (our own loops, an engine whose baseline is its plain server)."""
        return None

    @classmethod
    def draft_size_knob(cls, method: Mapping[str, Any], params: Mapping[str, Any]) -> str | None:
        """The first of ``draft_size_knobs`` that ``params`` set and that acts there (None:
        none does)."""
        return next((k for k in cls.draft_size_knobs if acting(method, params, k)), None)

    # -- results -----------------------------------------------------------------------------

    def best_params(self, choice: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """The best YAML's section that sets ``params`` on replay (``+best=``)."""
        return {"method": {"params": dict(params)}}

    @staticmethod
    def recorded_params(best: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters a best YAML written by any engine records."""
        return dict((best.get("method") or {}).get("params") or next(
            (m.get("params") for m in ((best.get("engine") or {}).get("methods") or {}).values()),
            None) or {})

    # -- the backend -------------------------------------------------------------------------

    def evaluator(self, settings: MeasureSettings, timer: Timer,
                  say: Callable[[str], None]) -> Evaluator:
        """The backend measuring ``settings`` (``timer``: the in-process clock)."""
        raise NotImplementedError
