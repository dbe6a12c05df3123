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
Timing wants a quiet machine, as every measurement does. The load from other processes is told
apart in two cases (``_Round``), checked after every timed block of every round, the warm-up's
included:
  * **sustained**: over the round so far, at least ``SUSTAINED_MIN_S`` (10 s) of it, other
    processes used more than ``BUSY_THRESHOLD`` (25 %) of our CPUs: the profile stops
    (``ProfileDisturbed``, one line naming the load and the round), so a disturbed profile is
    never a 30-minute wait (a busy process beside it ran the rounds 5-9x slower);
  * **a burst**: one timed block (a context's cells, the prefills, one loop run; at least
    ``BUSY_MIN_WINDOW_S``) above 25 % while its round stays under the sustained bound: that
    block is measured again, up to ``BURST_RETRIES`` times; a block still disturbed after them
    is recorded (``LoopFit.busy``) and flags the profile.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from decoding.runtime import forward_logits, new_cache
from tuner.measure.hygiene import DEFAULT_THRESHOLD, LoadMeter, LoadSample
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
SUSTAINED_MIN_S = 10.0     # others' load over at least this much of a round is sustained: stop
BURST_RETRIES = 2          # a block a burst disturbed is measured again, at most this often


class ProfileDisturbed(RuntimeError):
    """Sustained load from other processes during a profile (module docstring): one line."""


class _Round:
    """One round's load checks (module docstring): each timed block through ``block``; the
    round's own meter tells sustained load (``stop``: raise) from a block's burst (measured
    again). ``meter``: how a block's load is read (a test passes a scripted one)."""

    def __init__(self, label: str, keep: bool, busy: list[str], stop: bool = True,
                 meter: Callable[[], LoadMeter] = LoadMeter) -> None:
        self.label, self.keep, self.busy, self.stop, self.meter = label, keep, busy, stop, meter
        self.retried: dict[str, str] = {}        # block -> its last disturbed attempt
        self.whole = meter().__enter__()

    def block(self, what: str, run: Callable[[], Any]) -> Any:
        """``run()`` timed under its own meter; measured again while a burst disturbed it (kept
        rounds only); the last attempt's result."""
        for attempt in range(BURST_RETRIES + 1):
            with self.meter() as meter:
                result = run()
            self.check()
            line = _disturbed(meter.sample, f"{self.label}: {what}")
            if line is None or not self.keep:
                return result
            if attempt < BURST_RETRIES:
                self.retried[what] = line
        self.busy.append(line)
        return result

    def check(self) -> None:
        """Stop (``ProfileDisturbed``) under sustained load over the round so far."""
        sample = self.whole.peek()
        if self.stop and sample.other_busy is not None and sample.window_s >= SUSTAINED_MIN_S \
                and sample.other_busy > BUSY_THRESHOLD:
            raise ProfileDisturbed(
                f"the profile stopped in {self.label}"
                f"{' (the warm-up)' if self.label == 'round 0' else ''}: other processes used "
                f"{sample.other_busy:.0%} of CPUs {list(sample.cpus)} over its first "
                f"{sample.window_s:.0f} s (sustained load: more than {BUSY_THRESHOLD:.0%} over at "
                f"least {SUSTAINED_MIN_S:.0f} s of a round; a shorter burst is measured again); "
                "stop them or give the profile other CPUs (taskset -c), then make it again")

    def close(self) -> LoadSample:
        """The round as a whole: checked once more; a kept round shorter than the sustained
        bound's span, its blocks each too short to judge, is recorded where the whole read
        busy."""
        self.check()
        self.whole.__exit__(None, None, None)
        line = _disturbed(self.whole.sample, f"{self.label} as a whole")
        if self.keep and line is not None:
            self.busy.append(line)
        return self.whole.sample


class ServedLoad:
    """An engine profile's load checks (``python -m tuner.profile --engine``): its servers are
    other processes, so each cell (one k at one level: its requests) is metered with the
    servers' process groups counted as the profile's own (``groups``: those running now;
    ``tuner.measure.hygiene.group_cpu_s``). As in ``_Round``: sustained load, more than
    ``BUSY_THRESHOLD`` of the CPUs over at least ``SUSTAINED_MIN_S`` of the cells measured so
    far, stops the profile (``ProfileDisturbed``); a cell a burst disturbed is measured again,
    up to ``BURST_RETRIES`` times, then recorded in ``busy`` (it flags the profile). The load
    is read every ``PEEK_S`` while a cell runs, not only after it: beside a busy process a
    server's threads can crawl (llama-server's two threads on two CPUs, one taken: a cell ran
    for minutes), so sustained load stops the servers (``abort``), which ends the cell's
    requests, and the profile stops. Server starts are not metered (no cell runs then)."""

    PEEK_S = 1.0

    def __init__(self, groups: Callable[[], Sequence[int]], abort: Callable[[], None]) -> None:
        self.groups, self.abort = groups, abort
        self.busy: list[str] = []
        self.other_s = 0.0                  # others' CPU share x seconds, over the cells
        self.window_s = 0.0

    def block(self, what: str, run: Callable[[], Any], timed: bool = True) -> Any:
        """``run()`` (one cell) metered, its load read while it runs; measured again while a
        burst disturbed it (``timed``; an untimed request, a server's first, is not)."""
        import threading
        for attempt in range(BURST_RETRIES + 1 if timed else 1):
            meter = LoadMeter(groups=self.groups())
            tripped: list[str] = []
            done = threading.Event()

            def watch() -> None:
                while not done.wait(self.PEEK_S):
                    line = self.sustained(meter.peek(), what)
                    if line is not None:
                        tripped.append(line)
                        self.abort()
                        return
            with meter:
                watcher = threading.Thread(target=watch, daemon=True)
                watcher.start()
                try:
                    result = run()
                except Exception:
                    if tripped:             # the servers stopped under it: the load's line
                        raise ProfileDisturbed(tripped[0]) from None
                    raise
                finally:
                    done.set()
                    watcher.join()
            if tripped:
                raise ProfileDisturbed(tripped[0])
            sample = meter.sample
            line = self.sustained(sample, what)
            if sample.other_busy is not None:
                self.other_s += sample.other_busy * sample.window_s
                self.window_s += sample.window_s
            if line is not None:
                raise ProfileDisturbed(line)
            line = _disturbed(sample, what)
            if line is None or not timed:
                return result
        self.busy.append(line)
        return result

    def sustained(self, sample: LoadSample, what: str) -> str | None:
        """The stop line where the cells so far with ``sample`` added read sustained load."""
        window = self.window_s + (sample.window_s if sample.other_busy is not None else 0.0)
        other = self.other_s + (sample.other_busy or 0.0) * sample.window_s
        if window < SUSTAINED_MIN_S or other / window <= BUSY_THRESHOLD:
            return None
        return (f"the engine profile stopped at {what}: other processes used "
                f"{other / window:.0%} of the CPUs over the first {window:.0f} s of its "
                f"requests (sustained load: more than {BUSY_THRESHOLD:.0%} over at least "
                f"{SUSTAINED_MIN_S:.0f} s; the servers' own processes not counted; a shorter "
                "burst is measured again); stop them or give the profile other CPUs (taskset "
                "-c), then make it again")


def _disturbed(sample: LoadSample, what: str) -> str | None:
    """The line of a block other processes disturbed (over ``BUSY_THRESHOLD`` of the CPUs for at
    least ``BUSY_MIN_WINDOW_S``: /proc/stat counts 10 ms ticks, one tick of a shorter block
    reads as a large share), else None."""
    other = sample.other_busy
    if other is None or other <= BUSY_THRESHOLD or sample.window_s < BUSY_MIN_WINDOW_S:
        return None
    return (f"{what} ({other:.0%} of the CPUs busy with other processes over "
            f"{sample.window_s:.1f} s)")


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

    def round(self, load: _Round, prefills: bool = True) -> None:
        """Every cell once, then (``prefills``) every prefill once; kept where ``load.keep``."""
        model, ids, device = self.model, self.ids, self.device
        for context, cache in zip(self.contexts, self.caches):
            def cells(context: int = context, cache: Any = cache) -> list[float]:
                out = []
                for n in self.rows:
                    out.append(_timed(lambda: forward_logits(
                        model, ids[None, context:context + n], cache, context, n), device))
                    cache.crop(-n)                # back to `context` rows (reserved_cache)
                return out
            elapsed = load.block(f"{self.name} cells at context {context}", cells)
            if load.keep:
                for n, seconds in zip(self.rows, elapsed):
                    self.times[context, n].append(seconds)
        if not prefills:
            return
        elapsed = load.block(f"{self.name} prefills", lambda: [_timed(
            lambda n=n: forward_logits(model, ids[None, :n], new_cache(model, n), 0, 1), device)
            for n in self.prefill])
        if load.keep:
            for n, seconds in zip(self.prefill, elapsed):
                self.prefill_times[n].append(seconds)

    def surface(self) -> CostSurface:
        seconds = tuple(tuple(statistics.median(self.times[c, n]) for n in self.rows)
                        for c in self.contexts)
        prefills = tuple((n, statistics.median(self.prefill_times[n])) for n in self.prefill)
        return CostSurface(self.contexts, self.rows, seconds, prefills)

    def close(self) -> None:
        self.caches = []


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

    def round(self, load: _Round) -> None:
        """Every loop on every prompt once, generated as a study's trial times it
        (``decoding.generate``: the loop with its phase clock, token ids only)."""
        from decoding import generate
        for p, prompt in enumerate(self.prompts):
            for name, method in self.methods:
                def run(method: Any = method, prompt: torch.Tensor = prompt
                        ) -> tuple[float, list[int]]:
                    out: list[Any] = []
                    wall = _timed(lambda: out.append(generate(method, prompt,
                                                              self.max_new_tokens)), self.device)
                    method.reset()
                    return wall, list(out[0].tokens)
                wall, self.tokens[name, p] = load.block(f"{name} on fit prompt {p + 1}", run)
                if load.keep:
                    self.walls.setdefault((name, p), []).append(wall)

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
        load = _Round(f"round {round_}", round_ > 0, busy)
        for grid in cells:       # prefills: 17 s a round on this CPU; the warm-up + 2 kept
            grid.round(load, prefills=round_ <= PREFILL_ROUNDS)
        loops.round(load)
        whole = load.close()
        progress(f"  round {round_}/{repeats}{' (warm-up, not kept)' if not round_ else ''}: "
                 f"{time.perf_counter() - began:.1f} s" + (
                     f", other processes {whole.other_busy:.0%} of the CPUs"
                     if whole.other_busy is not None else "") + (
                     f"; {len(load.retried)} block(s) measured again after a burst"
                     if load.retried else ""))
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
        load = _Round(f"round {round_}", round_ > 0, busy, stop=False)
        cells.round(load)
        load.close()
    surface = cells.surface()
    cells.close()
    return surface


def describe_models(models: Mapping[str, Any]) -> dict[str, Any]:
    return {"target": dict(models["target"]),
            "draft": dict(models["draft"]) if models.get("draft") else None}
