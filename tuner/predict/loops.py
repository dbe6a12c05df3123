"""Measure our own loops' cost surface (``engine=hf``): timed KV-cached forwards of the target
(and of the draft model) at the shapes the methods use, and the loop's time per step beyond its
forwards.

Each cell of the grid is a forward of ``rows`` tokens after ``context`` cached tokens, as a
verification step makes it (``logits_to_keep = rows``: every fed row is scored), repeated
``repeats`` times after one warm-up, the median kept; the cache is cropped back to ``context``
after each. Prefill cells are forwards over a whole prompt with an empty cache. The per-step
overhead is measured by running vanilla, prompt lookup and (with a draft model) speculative
decoding on a prompt, whose steps replay exactly (``decoding.replay``), and taking (wall time −
the surface's forwards) / steps.
Timing wants a quiet machine, as every measurement does.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from decoding.runtime import forward_logits, new_cache
from tuner.predict.surface import CostSurface

if TYPE_CHECKING:
    from torch import nn

# cached tokens: chat prompts (GSM8K ~100-200 tokens) to summaries (CNN/DM ~400-1,900): a
# prediction beyond the grid extends its last segment, so the grid should cover the task
CONTEXTS = (16, 128, 384, 768, 1536)
# vanilla 1, a chain γ + 1, a trie its nodes + 1; lookahead's window and Ouroboros's tree 32-128
TARGET_ROWS = (1, 2, 3, 4, 5, 6, 8, 11, 16, 32, 64, 128)
# a draft model's chain feeds one or two tokens per forward, Ouroboros's lookahead draft W·(β−1)
# and more
DRAFT_ROWS = (1, 2, 4, 16, 64, 128, 256)
PREFILL = (16, 64, 256, 512, 1024, 2048)      # prompt tokens
OVERHEAD_RUNS = 3                     # timed runs per loop for its time per step (the median)


def _timed(run: Callable[[], Any], device: torch.device | None = None) -> float:
    """Wall seconds of one ``run`` (a CUDA device is synchronised inside the timed region: the
    time is the kernels', not their launch)."""
    start = time.perf_counter()
    run()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _seconds(run: Callable[[], Any], repeats: int, device: torch.device | None = None
             ) -> float:
    """Median of ``repeats`` timed runs after one untimed warm-up (allocations, kernels' first
    use)."""
    _timed(run, device)
    return statistics.median(_timed(run, device) for _ in range(repeats))


@torch.inference_mode()
def measure_surface(model: nn.Module, *, contexts: Sequence[int] = CONTEXTS,
                    rows: Sequence[int] = TARGET_ROWS, prefill: Sequence[int] = PREFILL,
                    repeats: int = 5, seed: int = 0,
                    progress: Callable[[str], None] = lambda line: None) -> CostSurface:
    """The grid of the module docstring for ``model`` (random token ids: cost does not depend on
    which tokens). The cells are timed in rounds, each round visiting every cell once (after
    one untimed round), so a slow spell of the machine spreads over all cells instead of
    bending one context's row."""
    device = next(model.parameters()).device
    vocab = int(model.get_input_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(seed)
    longest = max(max(contexts) + max(rows), max(prefill, default=0))
    ids = torch.randint(0, vocab, (longest,), generator=generator).to(device)     # [N]
    caches = []
    for context in contexts:
        cache = new_cache(model, context + max(rows))
        forward_logits(model, ids[None, :context], cache, 0, 1)
        caches.append(cache)
    times: dict[tuple[int, int], list[float]] = {(c, n): [] for c in contexts for n in rows}
    for round_ in range(repeats + 1):             # round 0: warm-up, not kept
        for context, cache in zip(contexts, caches):
            for n in rows:
                elapsed = _timed(lambda: forward_logits(
                    model, ids[None, context:context + n], cache, context, n), device)
                cache.crop(-n)                    # back to `context` rows (reserved_cache)
                if round_:
                    times[context, n].append(elapsed)
    seconds = [tuple(statistics.median(times[c, n]) for n in rows) for c in contexts]
    for context, line in zip(contexts, seconds):
        progress(f"  context {context}: " + ", ".join(f"{n} rows {1e3 * s:.1f} ms"
                                                      for n, s in zip(rows, line)))
    del caches
    prefills = []
    for n in prefill:
        prefills.append((n, _seconds(lambda n=n: forward_logits(
            model, ids[None, :n], new_cache(model, n), 0, 1), max(1, repeats // 2), device)))
    return CostSurface(tuple(contexts), tuple(rows), tuple(seconds), tuple(prefills))


@torch.inference_mode()
def step_overheads(target: nn.Module, surface: CostSurface, prompt_ids: Sequence[int],
                   draft: nn.Module | None = None, draft_surface: CostSurface | None = None,
                   max_new_tokens: int = 48) -> dict[str, float]:
    """The loop's own seconds per step beyond the surface's forwards (negative where its
    forwards ran faster inside the loop than alone): ``vanilla``'s; the draft → verify loop's
    without a draft model (``loop``, by prompt lookup) and with one (``draft_loop``, by
    speculative decoding with γ = 3: a draft model's forwards interleaved with the target's run
    slower than alone). Each from a timed run whose steps ``decoding.replay`` reproduces exactly,
    so only the time per step is fitted, never an acceptance."""
    from decoding.prompt_lookup import PromptLookup
    from decoding.replay import drafter_steps
    from decoding.speculative import SpeculativeDecoding
    from decoding.vanilla import Vanilla
    from tuner.predict.predict import forward_seconds, vanilla_forward_seconds
    device = next(target.parameters()).device
    prompt = torch.tensor(list(prompt_ids), device=device)
    vanilla = Vanilla(target, eos_token_ids=[])
    wall = _seconds(lambda: list(vanilla.stream(prompt, max_new_tokens)), OVERHEAD_RUNS, device)
    out = {"vanilla": (wall - vanilla_forward_seconds(surface, len(prompt), max_new_tokens))
           / max_new_tokens}
    loops: list[tuple[str, Any, CostSurface | None]] = [
        ("loop", PromptLookup(target, eos_token_ids=[]), None)]
    if draft is not None and draft_surface is not None:
        loops.append(("draft_loop", SpeculativeDecoding(target, draft, num_draft_tokens=3,
                                                        eos_token_ids=[]), draft_surface))
    for key, method, priced in loops:
        steps: list[Any] = []

        def run(method: Any = method) -> None:
            steps[:] = list(method.stream(prompt, max_new_tokens))
        wall = _seconds(run, OVERHEAD_RUNS, device)
        tokens = [t for s in steps for t in s.tokens]
        replayed = drafter_steps(method.drafter, prompt, tokens, max_new_tokens)
        out[key] = (wall - forward_seconds(replayed, surface, priced)) / len(replayed)
    return out


def describe_models(models: Mapping[str, Any]) -> dict[str, Any]:
    return {"target": dict(models["target"]),
            "draft": dict(models["draft"]) if models.get("draft") else None}
