"""The public entry points: build a method by name, generate, and per-generation statistics.

    from decoding import load_pair, build_method, generate
    pair = load_pair("smollm2")                       # embedded default (offline)
    method = build_method("speculative", pair, num_draft_tokens=4)
    out = generate(method, "What is 7 * 6?", max_new_tokens=32, tokenizer=pair.tokenizer)
    print(out.text, out.stats.mean_accepted_tokens)
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

import decoding
from decoding.base import DecodingMethod
from decoding.clock import PhaseClock

if TYPE_CHECKING:
    from decoding.base import Method, Step
    from decoding.models import ModelPair

NOT_METHODS = ("api", "demo", "models")   # modules that define no method (demo is a CLI)


def discover_methods() -> dict[str, type]:
    """Every ``DecodingMethod`` subclass defined in a ``decoding`` module, by its ``name``.

    Adding a method means adding its module (and its ``conf/method`` YAML): no list to edit here.
    """
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(decoding.__path__):
        if info.name in NOT_METHODS:
            continue
        module = importlib.import_module(f"decoding.{info.name}")
        for cls in vars(module).values():
            if isinstance(cls, type) and issubclass(cls, DecodingMethod) \
                    and cls is not DecodingMethod and cls.__module__ == module.__name__ and "name" in vars(cls):
                found[cls.name] = cls
    return dict(sorted(found.items()))


METHODS: dict[str, type] = discover_methods()


@dataclass(frozen=True)
class GenerationStats:
    """Counters of one generation. Terms as in ``decoding.base`` (vLLM's).

    ``mean_accepted_tokens`` follows vLLM/Spec-Bench: 1 + accepted / steps (bonus included, so
    vanilla scores exactly 1). Collected from Python ints the loop already has: no device sync.
    For token trees ``drafted`` counts verified tree tokens and positions are tree depths:
    ``accepted_per_position[i] / drafted_per_position[i]`` is the acceptance per drafted token at
    depth i; the extras hold ``tree_size``, ``tree_depth`` and ``tree_draws`` summed over steps.
    """

    new_tokens: int
    steps: int                           # target forwards
    draft_forwards: int
    drafted: int
    accepted: int
    drafted_per_position: tuple[int, ...]   # [γ_max] tokens drafted at position (tree depth) i
    accepted_per_position: tuple[int, ...]  # [γ_max] steps that accepted position (tree depth) i
    accepted_length_hist: tuple[int, ...]   # [γ_max + 1] steps that accepted exactly j tokens
    draft_time_s: float
    verify_time_s: float
    extras: dict[str, float] = field(default_factory=dict)   # method-specific counters, summed

    @property
    def mean_accepted_tokens(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @classmethod
    def from_steps(cls, steps: Sequence[Step], times: dict[str, float]) -> GenerationStats:
        width = max((len(s.drafted_per_depth) for s in steps), default=0)
        drafted_pos, accepted_pos = [0] * width, [0] * width
        hist = [0] * (width + 1)
        extras: dict[str, float] = {}
        for s in steps:
            for key, value in (s.extras or {}).items():   # "*_last" keys are gauges
                extras[key] = value if key.endswith("_last") else extras.get(key, 0.0) + value
            for i, size in enumerate(s.drafted_per_depth):
                drafted_pos[i] += size
            for i in range(s.accepted):
                accepted_pos[i] += 1
            hist[s.accepted] += 1
        return cls(new_tokens=sum(len(s.tokens) for s in steps), steps=len(steps),
                   draft_forwards=sum(s.draft_forwards for s in steps),
                   drafted=sum(s.drafted for s in steps),
                   accepted=sum(s.accepted for s in steps),
                   drafted_per_position=tuple(drafted_pos),
                   accepted_per_position=tuple(accepted_pos), accepted_length_hist=tuple(hist),
                   draft_time_s=times.get("draft", 0.0), verify_time_s=times.get("verify", 0.0),
                   extras=extras)


@dataclass(frozen=True)
class Generation:
    tokens: tuple[int, ...]     # new tokens only
    text: str | None            # decoded new tokens (None without a tokenizer)
    stats: GenerationStats


def build_method(name: str, pair: ModelPair, **hyperparameters: Any) -> Method:
    """Instantiate a decoding method by name with the pair's models.

    Args:
        name: one of ``METHODS``.
        pair: the loaded models; single-model methods use only ``pair.target``.
        **hyperparameters: the method's keyword arguments (e.g. num_draft_tokens, temperature).
    """
    if name not in METHODS:
        raise ValueError(f"method {name!r} is unknown: allowed are {sorted(METHODS)}")
    cls = METHODS[name]
    allowed = [p for p in inspect.signature(cls).parameters
               if p not in ("target", "draft")]
    unknown = sorted(set(hyperparameters) - set(allowed))
    if unknown:
        raise ValueError(f"method {name!r} has no hyperparameter(s) {unknown}: allowed are "
                         f"{allowed}")
    models = {"target": pair.target}
    if "draft" in inspect.signature(cls).parameters:
        models["draft"] = pair.drafts if len(pair.drafts) > 1 else pair.draft
    return cls(**models, **hyperparameters)


def encode_prompt(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids of ``text``: through the chat template when the tokenizer has one and chat=True."""
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; this model has none (tiny random "
                         "models take token ids)")
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return list(tokenizer(text)["input_ids"])


def generate(method: Method, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int,
             tokenizer: Any = None, chat: bool = True) -> Generation:
    """Run ``method`` on one prompt (text or token ids) and collect tokens and statistics."""
    if isinstance(prompt, str):
        prompt = encode_prompt(tokenizer, prompt, chat)
    clock = PhaseClock(next(method.target.parameters()).device)
    steps = list(method.stream(torch.as_tensor(prompt), max_new_tokens, clock))
    tokens = tuple(t for s in steps for t in s.tokens)
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
    return Generation(tokens, text, GenerationStats.from_steps(steps, clock.totals()))
