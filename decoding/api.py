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
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

import decoding
from decoding.acceptance import AcceptanceCounts
from decoding.base import DecodingMethod
from decoding.clock import PhaseClock

if TYPE_CHECKING:
    from decoding.base import Method, Step
    from decoding.models import ModelPair

MODEL_ARGUMENTS = ("target", "draft")   # injected from the pair (``instantiate``)
SHARED_ARGUMENTS = ("temperature", "top_k", "top_p", "seed", "eos_token_ids")   # every method's


def discover_methods() -> dict[str, type]:
    """Every ``DecodingMethod`` subclass with its own ``name``, from every ``decoding`` module.

    Adding a method means adding its module (and its ``conf/method`` YAML): no list to edit here.
    Every module is imported (none has side effects on import) except private ones: ``__main__``
    is the demo CLI, which ``python -m decoding`` runs itself.
    """
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(decoding.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"decoding.{info.name}")
        for cls in vars(module).values():
            if isinstance(cls, type) and issubclass(cls, DecodingMethod) \
                    and cls is not DecodingMethod and cls.__module__ == module.__name__ \
                    and "name" in vars(cls):
                found[cls.name] = cls
    return dict(sorted(found.items()))


def takes_draft(cls: type) -> bool:
    """Whether a method's constructor takes draft model(s)."""
    return "draft" in inspect.signature(cls).parameters


def hyperparameters(cls: type) -> list[str]:
    """A method's hyperparameters: its constructor's keyword arguments, in order, minus the models
    (``MODEL_ARGUMENTS``) and the sampling arguments and stop ids every method takes
    (``SHARED_ARGUMENTS``). The one definition, for ``build_method`` and the tuner's configs."""
    return [name for name in inspect.signature(cls).parameters
            if name not in MODEL_ARGUMENTS + SHARED_ARGUMENTS]


def instantiate(cls: type, pair: ModelPair, **kwargs: Any) -> Method:
    """Construct ``cls`` with the pair's models: the one place models are handed to a method.

    ``target`` always; ``draft`` when the constructor takes one: the draft model, or every draft
    (a tuple, SpecInfer) when several were loaded. ``kwargs``: hyperparameters and shared
    arguments, passed as given.
    """
    models = {"target": pair.target}
    if takes_draft(cls):
        models["draft"] = pair.drafts if len(pair.drafts) > 1 else pair.draft
    return cls(**models, **kwargs)


METHODS: dict[str, type] = discover_methods()


FIRST_STEP = "first_step"       # PhaseClock phase: from the call to the first emitted step


@dataclass(frozen=True)
class GenerationStats:
    """Counters of one generation. Terms as in ``decoding.base`` (vLLM's).

    ``counts`` is the generation's ``decoding.acceptance.AcceptanceCounts`` (the first step is
    its prefill), which defines every figure read from these counters; ``mean_accepted_tokens``
    is its tokens per forward (vLLM/Spec-Bench: 1 + accepted / steps, bonus included, so vanilla
    scores exactly 1). Collected from Python ints the loop already has: no device sync.
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
    # the first step, its time and tokens: the prompt's prefill (vanilla; EAGLE, which drafts
    # from the target's features only after it), fused with the first draft's verification in
    # methods that draft at once; the rest of the generation is its decode phase
    first_step_s: float = 0.0
    first_step_tokens: int = 0
    first_step_accepted: int = 0         # drafted tokens the first step (the prefill) accepted
    drafts: int = 0                      # steps that verified a draft

    @property
    def counts(self) -> AcceptanceCounts:
        """The generation's counts: every step a target forward, the first one its prefill."""
        return AcceptanceCounts(
            steps=self.steps, prefills=1 if self.steps else 0, drafts=self.drafts,
            drafted=self.drafted, accepted=self.accepted,
            accepted_per_position=self.accepted_per_position,
            drafted_per_position=self.drafted_per_position,
            prefill_accepted=self.first_step_accepted)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per target forward, the prefill counted (``AcceptanceCounts``)."""
        return self.counts.tokens_per_forward

    @property
    def acceptance_rate(self) -> float:
        return self.counts.acceptance_rate

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
                   extras=extras, first_step_s=times.get(FIRST_STEP, 0.0),
                   first_step_tokens=len(steps[0].tokens) if steps else 0,
                   first_step_accepted=steps[0].accepted if steps else 0,
                   drafts=sum(1 for s in steps if s.drafted))


@dataclass(frozen=True)
class Generation:
    tokens: tuple[int, ...]     # new tokens only
    text: str | None            # decoded new tokens (None without a tokenizer)
    stats: GenerationStats


def build_method(name: str, pair: ModelPair, **arguments: Any) -> Method:
    """Instantiate a decoding method by name with the pair's models (``instantiate``).

    Args:
        name: one of ``METHODS``.
        pair: the loaded models; single-model methods use only ``pair.target``.
        **arguments: the method's hyperparameters (``hyperparameters``, e.g. num_draft_tokens)
            and any of ``SHARED_ARGUMENTS`` (temperature, top_k, top_p, seed, eos_token_ids).
    """
    if name not in METHODS:
        raise ValueError(f"method {name!r} is unknown: allowed are {sorted(METHODS)}")
    cls = METHODS[name]
    allowed = hyperparameters(cls) + list(SHARED_ARGUMENTS)
    unknown = sorted(set(arguments) - set(allowed))
    if unknown:
        raise ValueError(f"method {name!r} has no hyperparameter(s) {unknown}: allowed are "
                         f"{allowed}")
    return instantiate(cls, pair, **arguments)


def encode_prompt(tokenizer: Any, prompt: str | Sequence[Mapping[str, str]], chat: bool = True,
                  add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a prompt: a text (one user turn) or chat messages.

    Through the chat template when the tokenizer has one and ``chat``; else the plain text (the
    messages' contents joined by blank lines).

    Args:
        tokenizer: a Hugging Face tokenizer (or anything with ``__call__`` and ``chat_template``).
        prompt: the user's text, or messages ``{"role": ..., "content": ...}`` in order.
        chat: use the chat template when there is one.
        add_generation_prompt: end with the opening of the assistant's turn (False when the
            messages already end with the assistant's answer, e.g. training text).
    """
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; this model has none (tiny random "
                         "models take token ids)")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
        [dict(message) for message in prompt]
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages,
                                                  add_generation_prompt=add_generation_prompt,
                                                  tokenize=True, return_dict=False))
    return list(tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"])


def generate(method: Method, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int,
             tokenizer: Any = None, chat: bool = True) -> Generation:
    """Run ``method`` on one prompt (text or token ids) and collect tokens and statistics."""
    if isinstance(prompt, str):
        prompt = encode_prompt(tokenizer, prompt, chat)
    clock = PhaseClock(next(method.target.parameters()).device)
    stream = method.stream(torch.as_tensor(prompt), max_new_tokens, clock)
    with clock.phase(FIRST_STEP):               # time to the first token(s): the prefill phase
        first = next(stream, None)
    steps = [] if first is None else [first, *stream]
    tokens = tuple(t for s in steps for t in s.tokens)
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
    return Generation(tokens, text, GenerationStats.from_steps(steps, clock.totals()))
