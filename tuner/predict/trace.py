"""Acceptance from one untimed generation, for methods whose acceptance does not replay.

Lookahead and Ouroboros draft from target outputs met along the way (their pools and Jacobi
windows), SpecInfer samples its drafts, EAGLE reads the target's states: a vanilla trajectory does
not give their steps (``decoding.replay``). At temperature 0 their generation is deterministic, so
one *untimed* run of the method itself gives its steps exactly as a timed run would (measured:
the same accepted counts, ``tests/test_prediction.py``). ``traced`` records, while it runs, every
forward of the models it is given: which model, the tokens it fed and the context it attended to;
those shapes are what a cost surface prices (``tuner.predict.predict.traced_seconds``). The run
is made with hooks on, so it is never timed; it needs no vanilla beside it and no quiet machine.
At T > 0 a run is one sample: ``UNTIMED_SEEDS`` runs with other seeds than the timed run's give
the average and its spread (``untimed_runs(…, seed)``, ``by_seed``).

What a trace does not price: a forward of a module other than the ones named (an EAGLE head:
``check_prediction`` refuses those methods), and time outside forwards, which the profile's loop
overhead per step stands for (a step = the draft forwards since the last target forward, then
that target forward).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

if TYPE_CHECKING:
    from torch import nn

    from tuner.predict.surface import CostSurface


@dataclass(frozen=True)
class TracedForward:
    """One model forward seen in a traced generation."""

    model: str          # "target" or "draft"
    context: int        # rows the model's KV cache held before it (committed + scratch)
    rows: int           # tokens fed


@dataclass(frozen=True)
class TracedGeneration:
    """One untimed generation of a method on one prompt: its forwards and its step counts."""

    prompt_len: int
    new_tokens: int
    steps: int                            # verification steps (target forwards after the first)
    accepted: int                         # draft tokens accepted over all steps
    forwards: tuple[TracedForward, ...]   # in the order they ran
    seed: int | None = None               # T > 0: the seed it was sampled with

    def grouped(self) -> list[list[TracedForward]]:
        """The forwards as steps: the draft forwards since the last target forward, then that
        target forward (a trailing draft-only group joins the last step)."""
        steps: list[list[TracedForward]] = []
        current: list[TracedForward] = []
        for forward in self.forwards:
            current.append(forward)
            if forward.model == "target":
                steps.append(current)
                current = []
        if current:
            if steps:
                steps[-1].extend(current)
            else:
                steps.append(current)
        return steps


def _cache_length(kwargs: Mapping[str, Any]) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return int(cache.get_seq_length()) if cache is not None else 0


@contextmanager
def traced(models: Sequence[tuple[str, nn.Module]]) -> Iterator[list[TracedForward]]:
    """Record every forward of ``models`` ((name, module) pairs: "target", "draft"; several
    drafts may share the name; one module may not appear twice) while the block runs; the list
    it yields fills in call order. Hooks are removed on the way out."""
    seen: list[TracedForward] = []
    if len({id(m) for _, m in models}) != len(models):
        raise ValueError("traced: the models must be distinct modules (a self-draft that is the "
                         "target itself cannot be told apart)")
    handles = []
    for name, module in models:

        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 name: str = name) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                raise ValueError(f"traced: a forward of the {name} model without input_ids")
            seen.append(TracedForward(name, _cache_length(kwargs), int(ids.shape[-1])))
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


UNTIMED_SEEDS = 3      # T > 0: seeded untimed runs per prediction (an average, with its spread)


def untimed_runs(method: Any, prompts: Sequence[Sequence[int]],
                 models: Sequence[tuple[str, nn.Module]],
                 max_new_tokens: int, seed: int | None = None, fresh: bool = True,
                 keep: bool = False) -> list[TracedGeneration]:
    """One generation of ``method`` per prompt, in order, from a fresh history (``reset``
    before, as a timed run starts after its warm-up, and after), every forward of ``models``
    traced. The method must run eagerly (a compiled target's graphs bypass the hooks).
    ``seed``: sample with this seed instead of the method's own (T > 0; restored after).
    ``fresh=False``: the history goes on from the method's last generation; ``keep=True``: it
    is kept after (a ranking adding one prompt at a time, ``tuner.predict.halving``: its first
    prompt's run is fresh and kept, each later one goes on and is kept)."""
    from decoding import generate
    own = method.seed
    if seed is not None:
        method.seed = seed
    if fresh:
        method.reset()
    generations = []
    try:
        for ids in prompts:
            with traced(models) as forwards:
                out = generate(method, ids, max_new_tokens)
            generations.append(TracedGeneration(len(ids), len(out.tokens), out.stats.steps,
                                                out.stats.accepted, tuple(forwards), seed))
    finally:
        method.seed = own
        if not keep:
            method.reset()
    return generations


def by_seed(generations: Sequence[Any]) -> dict[int, list[TracedGeneration]]:
    """Seeded untimed generations grouped by their seed (empty at T = 0)."""
    out: dict[int, list[TracedGeneration]] = {}
    for g in generations:
        if isinstance(g, TracedGeneration) and g.seed is not None:
            out.setdefault(g.seed, []).append(g)
    return out


def beyond_grid(generations: Sequence[Any], target: CostSurface,
                draft: CostSurface | None) -> str | None:
    """A line naming the traced cached forwards wider than their surface's rows (priced by
    extending its last segment), or None; a forward over an empty cache is a prefill, on its own
    grid; replayed generations (not traced) are left out."""
    parts = []
    traced_ = [g for g in generations if isinstance(g, TracedGeneration)]
    for name, surface in (("target", target), ("draft", draft)):
        widest = max((f.rows for g in traced_ for f in g.forwards
                      if f.model == name and f.context), default=0)
        if surface is not None and widest > surface.rows[-1]:
            parts.append(f"{name} forwards of up to {widest} rows beyond the profile's "
                         f"{surface.rows[-1]}")
    if not parts:
        return None
    return ("; ".join(parts) + ": extrapolated from the last rows measured (profile wider: "
            "python -m tuner.profile --rows ... --draft-rows ...)")
