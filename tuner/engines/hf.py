"""``engine=hf`` (the default): this project's own decoding loops with transformers, in process,
one request at a time. Every method of conf/method/ runs here, as configured.

``engine.compile=true`` runs the target on a static cache compiled per forward length (CUDA graphs
on a GPU): part of the study identity; a method that cannot run compiled says why itself
(``DecodingMethod.compiled_refusal``). The backend is ``tuner.engines.inprocess.HFEvaluator``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from omegaconf import DictConfig

from tuner.config.errors import ConfigError
from tuner.config.methods import method_class
from tuner.config.values import plain
from tuner.engines import server_kinds
from tuner.engines.base import Engine

if TYPE_CHECKING:
    from tuner.measure.evaluator import Evaluator, MeasureSettings
    from tuner.measure.timing import Timer


class HFEngine(Engine):
    """The in-process engine (see the module docstring)."""

    name, display = "hf", "transformers (in process)"
    max_concurrency = 1
    compiles = True                     # a static cache compiled per forward length
    synthetic_surface = False           # its profile is tuner.profile's own loops
    default_objective = "speedup"
    streams = False
    predicts = True
    draft_tokens_knob = None            # each method names its own (num_draft_tokens, ...)
    own_loops = True                    # decoding.* methods in process
    live_metrics = None                 # no server: nothing to watch (python -m tuner.watch)
    draft_size_knobs = ()               # each method class declares its own (draft_size_params)

    def refuse_levels(self, levels: list[int]) -> None:
        raise ConfigError(f"budget.concurrency={levels} needs an engine server: "
                          f"engine={self.name} measures one request at a time; allowed is [1], "
                          f"or {server_kinds()}")

    def check(self, cfg: DictConfig, choice: str) -> None:
        super().check(cfg, choice)
        self.check_compile(plain(cfg.get("engine")) or {}, choice, plain(cfg.method))

    def check_compile(self, engine: Mapping[str, Any], choice: str,
                      method: Mapping[str, Any]) -> None:
        """engine.compile (a boolean: ``Engine.check_compile_flag``): its buckets are ascending
        positive integers; the method can run on a compiled target (it says so itself)."""
        if not engine.get("compile", False):
            return
        from decoding.compiled import check_buckets
        try:
            check_buckets(list(engine.get("compile_buckets") or []))
        except ValueError as err:
            raise ConfigError(f"engine.compile_{err}") from None
        refusal = method_class(method).compiled_refusal(method.get("params") or {})
        if refusal:
            raise ConfigError(refusal.format(method=f"method={choice}",
                                             compile="engine.compile=true",
                                             off="engine.compile=false"))

    def identity(self, engine: Mapping[str, Any], concurrency: Sequence[int] = (1,)
                 ) -> dict[str, Any] | None:
        """Eager (every older study): no key; compiled: its buckets and torch's version."""
        if not engine.get("compile"):
            return None
        import torch
        return {"kind": self.name, "compile": True,
                "compile_buckets": list(engine["compile_buckets"]), "torch": torch.__version__}

    def evaluator(self, settings: MeasureSettings, timer: Timer,
                  say: Callable[[str], None]) -> Evaluator:
        from tuner.engines.inprocess import HFEvaluator
        return HFEvaluator(settings, timer, say)
