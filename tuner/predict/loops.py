"""Measure our own loops' cost surface (``engine=hf``): timed KV-cached forwards of the target
(and of the draft model) at the shapes the methods use, and the loop's time per step beyond its
forwards.

Each cell of the grid is a forward of ``rows`` tokens after ``context`` cached tokens, as a
verification step makes it (``logits_to_keep = rows``: every fed row is scored); the cache is
cropped back to ``context`` after each. Prefill cells are forwards over a whole prompt with an
empty cache. The per-step overhead of a loop is (wall time of a timed run − the surface's price
of its forwards) / steps, from runs of vanilla, prompt lookup (``loop``) and, with a draft model,
speculative decoding (``draft_loop``) on ``FIT_PROMPTS`` prompts, whose steps replay exactly
(``decoding.replay``), so only the time per step is fitted, never an acceptance.

Everything is timed in rounds (``measure_profile``): each round times every cell of the target,
every cell of the draft and every loop on every prompt once, after one untimed round, and each
figure is the median over the rounds. A slow spell of the machine then spreads over the cells and
the loop runs alike instead of bending one of them: the overheads are differences of two large
sums, so a surface timed in a quiet minute and loops timed in a busy one would put the whole
difference into every step's price. Each loop's fit keeps its samples (prompts × rounds) and the
other processes' load on our CPUs during every run (``tuner.measure.hygiene.LoadMeter``);
``tuner.predict.check.fit_flags`` flags a fit that should not be believed.
Timing wants a quiet machine, as every measurement does.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from decoding.runtime import forward_logits, new_cache
from tuner.measure.hygiene import DEFAULT_THRESHOLD, LoadMeter
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
# the overhead fit's prompts: (first id, distinct tokens, repeated tokens): a block of distinct
# ids followed by a repeat of its start (so prompt lookup drafts), 48 / 96 / 192 tokens long
FIT_PROMPTS = ((1000, 32, 16), (100, 64, 32), (3000, 128, 64))
FIT_TOKENS = 32                                # new tokens per overhead run
PREFILL_ROUNDS = 2                             # kept rounds that time the prefills too
BUSY_THRESHOLD = DEFAULT_THRESHOLD             # other load above it during a run: "busy"
BUSY_MIN_WINDOW_S = 0.5                        # shorter blocks are judged with their round


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


def fit_prompts(vocab: int, prompts: Sequence[tuple[int, int, int]] = FIT_PROMPTS
                ) -> list[list[int]]:
    """The overhead fit's prompt ids (``FIT_PROMPTS``; ids wrap at ``vocab``)."""
    out = []
    for first, distinct, repeated in prompts:
        block = [(first + i) % vocab for i in range(distinct)]
        out.append(block + block[:repeated])
    return out


@dataclass(frozen=True)
class LoopFit:
    """The loops' own seconds per step beyond the surface's forwards, fitted from timed runs.

    ``samples[loop][p][r]``: prompt p's run in round r, (wall − priced forwards) / steps;
    ``step_s[loop]``: the surface's price of the loop's mean step (its forwards), the scale its
    uncertainty is judged on; ``busy``: one line per run (or block of cells) during which other
    processes used more than ``BUSY_THRESHOLD`` of this process's CPUs."""

    samples: Mapping[str, tuple[tuple[float, ...], ...]]    # loop -> [prompts][rounds] s/step
    step_s: Mapping[str, float]                             # loop -> priced seconds per step
    busy: tuple[str, ...] = ()
    runs: int = 0                                           # timed runs (all loops)

    def value(self, loop: str) -> float:
        """The fitted overhead: the median of every sample of ``loop``."""
        return statistics.median(s for line in self.samples[loop] for s in line)

    def spread(self, loop: str) -> float:
        """The fitted overhead's standard error over rounds: the standard deviation of the
        rounds' means (over prompts) / √rounds; 0 with a single round. A quiet 2-core CPU
        gave 2–4 % of a step's price; the whole round's runs move together with the machine."""
        lines = self.samples[loop]
        rounds = min(len(line) for line in lines)
        if rounds < 2:
            return 0.0
        means = [statistics.fmean(line[r] for line in lines) for r in range(rounds)]
        return statistics.stdev(means) / rounds ** 0.5

    def values(self) -> dict[str, float]:
        return {loop: self.value(loop) for loop in self.samples}

    def spreads(self) -> dict[str, float]:
        return {loop: self.spread(loop) for loop in self.samples}


class _Cells:
    """One model's grid of cached forwards, timed one round at a time."""

    def __init__(self, name: str, model: nn.Module, contexts: Sequence[int],
                 rows: Sequence[int], prefill: Sequence[int], seed: int) -> None:
        self.name, self.model = name, model
        self.contexts, self.rows, self.prefill = tuple(contexts), tuple(rows), tuple(prefill)
        self.device = next(model.parameters()).device
        vocab = int(model.get_input_embeddings().weight.shape[0])
        generator = torch.Generator().manual_seed(seed)
        longest = max(max(contexts) + max(rows), max(prefill, default=0))
        self.ids = torch.randint(0, vocab, (longest,), generator=generator).to(self.device)  # [N]
        self.caches = []
        for context in contexts:
            cache = new_cache(model, context + max(rows))
            forward_logits(model, self.ids[None, :context], cache, 0, 1)
            self.caches.append(cache)
        self.times: dict[tuple[int, int], list[float]] = {
            (c, n): [] for c in contexts for n in rows}
        self.prefill_times: dict[int, list[float]] = {n: [] for n in prefill}

    def round(self, keep: bool, busy: list[str], label: str, prefills: bool = True) -> None:
        """Every cell once, then (``prefills``) every prefill once; kept unless ``keep`` is
        False."""
        model, ids, device = self.model, self.ids, self.device
        for context, cache in zip(self.contexts, self.caches):
            with LoadMeter() as meter:
                for n in self.rows:
                    elapsed = _timed(lambda: forward_logits(
                        model, ids[None, context:context + n], cache, context, n), device)
                    cache.crop(-n)                # back to `context` rows (reserved_cache)
                    if keep:
                        self.times[context, n].append(elapsed)
            _note_busy(meter, busy, f"{label}: {self.name} cells at context {context}", keep)
        if not prefills:
            return
        with LoadMeter() as meter:
            for n in self.prefill:
                elapsed = _timed(lambda n=n: forward_logits(
                    model, ids[None, :n], new_cache(model, n), 0, 1), device)
                if keep:
                    self.prefill_times[n].append(elapsed)
        _note_busy(meter, busy, f"{label}: {self.name} prefills", keep)

    def surface(self) -> CostSurface:
        seconds = tuple(tuple(statistics.median(self.times[c, n]) for n in self.rows)
                        for c in self.contexts)
        prefills = tuple((n, statistics.median(self.prefill_times[n])) for n in self.prefill)
        return CostSurface(self.contexts, self.rows, seconds, prefills)

    def close(self) -> None:
        self.caches = []


def _note_busy(meter: LoadMeter, busy: list[str], what: str, keep: bool) -> None:
    """Record ``what`` as busy when other processes used more than ``BUSY_THRESHOLD`` of the
    CPUs while it ran; blocks shorter than ``BUSY_MIN_WINDOW_S`` are judged with their round
    (/proc/stat counts in 10 ms ticks: one tick of a short block reads as a large share)."""
    sample = meter.sample
    other = sample.other_busy
    if keep and other is not None and other > BUSY_THRESHOLD and \
            sample.window_s >= BUSY_MIN_WINDOW_S:
        busy.append(f"{what} ({other:.0%} of the CPUs busy with other processes over "
                    f"{sample.window_s:.1f} s)")


class _Loops:
    """The loops whose overheads are fitted, each run once per prompt per round."""

    def __init__(self, target: nn.Module, draft: nn.Module | None,
                 prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        from decoding.prompt_lookup import PromptLookup
        from decoding.speculative import SpeculativeDecoding
        from decoding.vanilla import Vanilla
        self.device = next(target.parameters()).device
        self.prompts = [torch.tensor(list(p), device=self.device) for p in prompts]
        self.max_new_tokens = max_new_tokens
        self.methods: list[tuple[str, Any]] = [("vanilla", Vanilla(target, eos_token_ids=[])),
                                               ("loop", PromptLookup(target, eos_token_ids=[]))]
        if draft is not None:   # a draft model's forwards interleaved with the target's
            self.methods.append(("draft_loop", SpeculativeDecoding(
                target, draft, num_draft_tokens=3, eos_token_ids=[])))
        self.walls: dict[tuple[str, int], list[float]] = {}
        self.tokens: dict[tuple[str, int], list[int]] = {}

    def round(self, keep: bool, busy: list[str], label: str) -> None:
        """Every loop on every prompt once, generated as a study's trial times it
        (``decoding.generate``: the loop with its phase clock, token ids only)."""
        from decoding import generate
        for p, prompt in enumerate(self.prompts):
            for name, method in self.methods:
                out: list[Any] = []

                def run(method: Any = method, prompt: torch.Tensor = prompt) -> None:
                    out[:] = [generate(method, prompt, self.max_new_tokens)]
                with LoadMeter() as meter:
                    wall = _timed(run, self.device)
                method.reset()
                self.tokens[name, p] = list(out[0].tokens)
                if keep:
                    self.walls.setdefault((name, p), []).append(wall)
                _note_busy(meter, busy, f"{label}: {name} on fit prompt {p + 1}", keep)

    def fit(self, target: CostSurface, draft: CostSurface | None, busy: Sequence[str]
            ) -> LoopFit:
        """Each run's (wall − its forwards priced by the surfaces) / steps."""
        from decoding.replay import drafter_steps
        from tuner.predict.predict import forward_seconds, vanilla_forward_seconds
        samples: dict[str, list[tuple[float, ...]]] = {}
        step_s: dict[str, list[float]] = {}
        for name, method in self.methods:
            for p, prompt in enumerate(self.prompts):
                walls = self.walls[name, p]
                if name == "vanilla":
                    steps = self.max_new_tokens
                    priced = vanilla_forward_seconds(target, len(prompt), steps)
                else:
                    replayed = drafter_steps(method.drafter, prompt, self.tokens[name, p],
                                             self.max_new_tokens)
                    method.drafter.reset()
                    steps = len(replayed)
                    priced = forward_seconds(replayed, target,
                                             draft if name == "draft_loop" else None)
                samples.setdefault(name, []).append(tuple((w - priced) / steps for w in walls))
                step_s.setdefault(name, []).append(priced / steps)
        runs = sum(len(w) for w in self.walls.values())
        return LoopFit({k: tuple(v) for k, v in samples.items()},
                       {k: statistics.fmean(v) for k, v in step_s.items()}, tuple(busy), runs)


@torch.inference_mode()
def measure_profile(target: nn.Module, draft: nn.Module | None = None, *,
                    contexts: Sequence[int] = CONTEXTS, rows: Sequence[int] = TARGET_ROWS,
                    draft_rows: Sequence[int] = DRAFT_ROWS, prefill: Sequence[int] = PREFILL,
                    repeats: int = 5, prompts: Sequence[Sequence[int]] | None = None,
                    max_new_tokens: int = FIT_TOKENS, seed: int = 0,
                    progress: Callable[[str], None] = lambda line: None,
                    between_rounds: Callable[[int], None] = lambda round_: None
                    ) -> tuple[CostSurface, CostSurface | None, LoopFit]:
    """The target's (and the draft's) surface and the loops' fit, timed in interleaved rounds
    (module docstring): ``repeats`` kept rounds after one untimed round. ``prompts``: the fit's
    prompt ids (default ``fit_prompts``). ``between_rounds(r)`` is called before round r."""
    vocab = int(target.get_input_embeddings().weight.shape[0])
    cells = [_Cells("target", target, contexts, rows, prefill, seed)]
    if draft is not None:
        cells.append(_Cells("draft", draft, contexts, draft_rows, prefill, seed))
    loops = _Loops(target, draft, prompts if prompts is not None else fit_prompts(vocab),
                   max_new_tokens)
    busy: list[str] = []
    for round_ in range(repeats + 1):             # round 0: warm-up, not kept
        between_rounds(round_)
        began = time.perf_counter()
        label = f"round {round_}"
        with LoadMeter() as meter:
            for grid in cells:   # prefills: 17 s a round on this CPU; the warm-up + 2 kept
                grid.round(round_ > 0, busy, label, prefills=round_ <= PREFILL_ROUNDS)
            loops.round(round_ > 0, busy, label)
        _note_busy(meter, busy, f"{label} as a whole", round_ > 0)
        progress(f"  round {round_}/{repeats}{' (warm-up, not kept)' if not round_ else ''}: "
                 f"{time.perf_counter() - began:.1f} s")
    surfaces = [grid.surface() for grid in cells]
    for grid in cells:
        grid.close()
    for grid, surface in zip(cells, surfaces):
        progress(f"{grid.name}:")
        for context, line in zip(surface.contexts, surface.seconds):
            progress(f"  context {context}: " + ", ".join(
                f"{n} rows {1e3 * s:.1f} ms" for n, s in zip(surface.rows, line)))
    fit = loops.fit(surfaces[0], surfaces[1] if draft is not None else None, busy)
    return surfaces[0], surfaces[1] if draft is not None else None, fit


@torch.inference_mode()
def measure_surface(model: nn.Module, *, contexts: Sequence[int] = CONTEXTS,
                    rows: Sequence[int] = TARGET_ROWS, prefill: Sequence[int] = PREFILL,
                    repeats: int = 5, seed: int = 0) -> CostSurface:
    """One model's surface alone, timed in rounds as ``measure_profile`` times it (e.g. the
    1-row forwards a study times beside its trial 0, ``tuner.predict.check``)."""
    cells = _Cells("model", model, contexts, rows, prefill, seed)
    busy: list[str] = []
    for round_ in range(repeats + 1):
        cells.round(round_ > 0, busy, f"round {round_}")
    surface = cells.surface()
    cells.close()
    return surface


def describe_models(models: Mapping[str, Any]) -> dict[str, Any]:
    return {"target": dict(models["target"]),
            "draft": dict(models["draft"]) if models.get("draft") else None}
