"""Scrapes → windows: the counters differenced between scrapes, restart-safe.

A *window* spans consecutive scrapes and closes at the first scrape where it holds at least
``min_steps`` decode steps. A decode step is one target forward after a request's prefill:

    S = Δgenerated − Δaccepted − Δrequests     where the engine counts finished requests (each
                                                request's first token comes from its prefill);
    S = D                                       where it does not and the deployment drafts with a
                                                model (every decode step drafts);
    S = Δgenerated − Δaccepted                  else (each request's first token counted as a
                                                step: L reads low by about one step per request);
    never below D. Drafts D, drafted tokens T, accepted A; then
    mean accepted length (per step)  L = 1 + A / S      (tokens per target forward: what pays)
    acceptance per position i        c_i / D            (of the drafts; exact where every draft
                                                          had full length: T = D · k)
    time per output token            Δseconds / Δcount of the engine's token timer
    live batch                       the engine's gauge, averaged over the window's scrapes
                                     that saw requests (an idle scrape's 0 is not a batch)

A counter below its value at the previous scrape is a restart: the open window is dropped (its
difference is unknown), a new *segment* starts at that scrape, and the event says so — never a
negative rate.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from decoding.acceptance import AcceptanceCounts
from tuner.engines.metrics import Counters


@dataclass(frozen=True)
class Scrape:
    at: float                    # unix seconds
    counters: Counters


@dataclass(frozen=True)
class Window:
    """Counts between two scrapes of one segment (module docstring). ``counts``: the window's
    ``AcceptanceCounts``, whose decode steps are S (its prefills: the finished requests where the
    engine counts them); every figure below is read from it."""

    index: int                   # 0, 1, ... over the whole watch
    segment: int                 # 0 until the first restart, then 1, ...
    start: float                 # unix seconds of the opening and closing scrapes
    end: float
    counts: AcceptanceCounts     # drafts D, drafted T, accepted A, per position c_i, steps
    generated: int
    tpot_s: float | None         # measured time per output token (None: no token timed)
    batch: float | None          # the live batch (None: the gauge was not printed)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def steps(self) -> int:
        """S: decode steps (module docstring)."""
        return self.counts.decode_steps

    @property
    def drafts(self) -> int:
        return self.counts.drafts

    @property
    def draft_tokens(self) -> int:
        return self.counts.drafted

    @property
    def accepted(self) -> int:
        return self.counts.accepted

    @property
    def accepted_per_pos(self) -> tuple[int, ...]:
        """[positions] accepted at draft position i (from 0)."""
        return self.counts.accepted_per_position

    @property
    def mean_length(self) -> float:
        """L = 1 + accepted / S: tokens per decode step."""
        return self.counts.tokens_per_decode_step

    @property
    def step_fractions(self) -> tuple[float, ...]:
        """p_i = P(a step accepts position i) = c_i / S (i from 0): Σ p_i = L − 1."""
        return self.counts.step_fractions()

    @property
    def acceptance_per_pos(self) -> tuple[float, ...]:
        """c_i / D: the drafts' acceptance at position i."""
        return self.counts.draft_fractions()

    @property
    def live_batch(self) -> int | None:
        """The live batch as a batch size (rounded, at least 1; None: unknown)."""
        return None if self.batch is None else max(round(self.batch), 1)

    @property
    def drafted_per_step(self) -> float:
        return self.counts.drafted_per_decode_step

    def step_variance(self) -> float:
        """The variance of accepted tokens per step (``AcceptanceCounts.step_variance``)."""
        return self.counts.step_variance()

    def full_length(self, k: int) -> bool:
        """Every draft had ``k`` tokens (per-position acceptance exact below k)."""
        return self.counts.full_length(k)


@dataclass(frozen=True)
class Restart:
    """A counter went down between two scrapes: the server restarted."""

    at: float
    segment: int                 # the new segment's number
    dropped_steps: int           # what the dropped open window held before the restart


@dataclass
class Windower:
    """Feeds on scrapes, yields closed windows and restarts (module docstring)."""

    min_steps: int
    batch_is_window_mean: bool = False   # the gauge is a mean since the previous scrape
    steps_are_drafts: bool = False       # no request counter, every decode step drafts
    segment: int = 0
    index: int = 0
    opened: Scrape | None = None
    last: Scrape | None = None
    batches: list[float] = field(default_factory=list)

    def push(self, scrape: Scrape) -> Iterator[Window | Restart]:
        last, self.last = self.last, scrape
        if last is not None and scrape.counters.went_down(last.counters):
            held = 0 if self.opened is None else self.steps(self.opened.counters,
                                                            last.counters)
            self.segment += 1
            self.opened, self.batches = scrape, self.start_batches(scrape)
            yield Restart(scrape.at, self.segment, held)
            return
        if self.opened is None:
            self.opened, self.batches = scrape, self.start_batches(scrape)
            return
        if scrape.counters.batch:
            self.batches.append(scrape.counters.batch)
        if self.steps(self.opened.counters, scrape.counters) >= self.min_steps:
            yield self.close(scrape)

    def start_batches(self, scrape: Scrape) -> list[float]:
        # a point gauge counts at the opening scrape too; a window mean covers the time before it
        return [] if self.batch_is_window_mean or not scrape.counters.batch else \
            [scrape.counters.batch]

    def close(self, scrape: Scrape) -> Window:
        a, b = self.opened.counters, scrape.counters
        counted = b.token_count - a.token_count
        window = Window(
            index=self.index, segment=self.segment, start=self.opened.at, end=scrape.at,
            counts=self.counts(a, b), generated=b.generated - a.generated,
            tpot_s=(b.token_seconds - a.token_seconds) / counted if counted > 0 else None,
            batch=sum(self.batches) / len(self.batches) if self.batches else None)
        self.index += 1
        self.opened, self.batches = scrape, self.start_batches(scrape)
        return window

    def counts(self, a: Counters, b: Counters) -> AcceptanceCounts:
        """The counts from scrape ``a`` to ``b``, their decode steps S as the module docstring
        says (the prefills: the finished requests where the engine counts them, else none)."""
        got = b.acceptance().minus(a.acceptance())
        if a.requests is None or b.requests is None:
            # no request counter: every forward a decode step, or the drafts where a draft
            # model drafts every decode step
            got = replace(got, steps=got.drafts if self.steps_are_drafts else got.steps,
                          prefills=0)
        steps = max(got.decode_steps, got.drafts, 0)
        return replace(got, steps=steps + got.prefills)

    def steps(self, a: Counters, b: Counters) -> int:
        """Decode steps from scrape ``a`` to ``b`` (module docstring)."""
        return self.counts(a, b).decode_steps
