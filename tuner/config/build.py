"""The only place that loads models and instantiates methods from config.

Method configs name their class with ``_target_``; only classes defined in ``decoding.`` modules are
allowed (checked on the resolved class, so ``decoding.models.torch.nn.Linear`` is refused too).
"""

from __future__ import annotations

from typing import Any, Mapping

from decoding.api import instantiate
from decoding.models import ModelPair, load_pair
from decoding.tokenizers import ByteTokenizer   # its home is the library; re-exported here
from tuner.config.validate import method_class, plain

__all__ = ["ByteTokenizer", "build_method", "load_models", "method_class", "plain"]


def load_models(models_cfg: Mapping[str, Any], needs_draft: bool) -> tuple[ModelPair, Any]:
    """The pair (draft omitted for single-model methods) and a tokenizer for the task."""
    specs = plain(models_cfg)
    draft = specs.get("draft") if needs_draft else {"kind": "none"}
    pair = load_pair(specs["target"], draft)
    tokenizer = pair.tokenizer
    if tokenizer is None:
        if pair.target.config.vocab_size < 256:
            raise ValueError("a model without a tokenizer needs vocab_size >= 256 to take text "
                             "prompts (bytes)")
        tokenizer = ByteTokenizer()
    return pair, tokenizer


def build_method(method_cfg: Mapping[str, Any], params: Mapping[str, Any], pair: ModelPair,
                 sampling: Mapping[str, Any], seed: int) -> Any:
    """Instantiate the method with the pair's models (``decoding.api.instantiate``), its params and
    the sampling settings."""
    return instantiate(method_class(method_cfg), pair, **dict(params), **plain(sampling),
                       seed=seed)
