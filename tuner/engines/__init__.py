"""Engine servers the tuner measures in (``engine=``): each is one evaluator module (its knob
mapping, models, requests and counters, on the shared protocol of ``tuner.engines.serving``) plus
one ``conf/engine/<name>.yaml``.

``EVALUATORS`` maps ``engine.kind`` to its evaluator class (imported when chosen).
"""

from __future__ import annotations

import importlib
from typing import Any

EVALUATORS = {"hf": "tuner.measure.hf:HFEvaluator",
              "llamacpp": "tuner.engines.llamacpp:LlamaCppEvaluator",
              "vllm": "tuner.engines.vllm:VllmEvaluator"}


def make_evaluator(settings: Any, timer: Any, say: Any) -> Any:
    """The evaluator of ``settings.engine.kind`` (``timer``: the in-process one's clock)."""
    kind = settings.engine.get("kind", "hf")
    module, _, name = EVALUATORS[kind].partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(settings, timer, say) if kind == "hf" else cls(settings, say)
