"""The only place that loads models and instantiates methods from config.

Method configs name their class with ``_target_``; only targets under ``decoding.`` are allowed
(a cheap allow-list, like Hydra 1.4's coming instantiate whitelist).
"""

from __future__ import annotations

from typing import Any, Mapping

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from decoding.models import ModelPair, load_pair


class ByteTokenizer:
    """UTF-8 bytes as tokens, for tiny random models (vocab ≥ 256) that have no tokenizer."""

    chat_template = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def plain(cfg: Any) -> Any:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg


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


def method_class(method_cfg: Mapping[str, Any]) -> type:
    target = str(method_cfg.get("_target_", ""))
    if not target.startswith("decoding."):
        raise ValueError(f"method _target_={target!r} is not allowed: only classes under "
                         "'decoding.' can be instantiated")
    return get_class(target)


def build_method(method_cfg: Mapping[str, Any], params: Mapping[str, Any], pair: ModelPair,
                 sampling: Mapping[str, Any], seed: int) -> Any:
    """Instantiate the method with the pair's models, its params and the sampling settings."""
    cls = method_class(method_cfg)
    models = {"target": pair.target}
    if method_cfg.get("needs_draft", False):   # several drafts (SpecInfer) travel as a tuple
        models["draft"] = pair.drafts if len(pair.drafts) > 1 else pair.draft
    return cls(**models, **dict(params), **plain(sampling), seed=seed)
