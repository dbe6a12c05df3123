"""The paired protocol, written once for every backend (in process, llama.cpp, vLLM, ...).

A backend (``Backend``) only generates: a batch of prompts under one setting (the method, or the
baseline) at one concurrency level, returning one ``Measurement`` per prompt. This module owns how
that becomes a fair comparison:

  1. warm-up, untimed, on the first tuning prompts, both sides (``Backend.warm_up``);
  2. per concurrency level c, batches of c prompts (cycled, so that c requests are really in
     flight; the in-process backend serves c = 1 only);
  3. per batch: the CPUs settle (``Backend.settle``: a server that has just answered may keep a
     core busy), the machine is checked for other load (the contention guard), then the baseline
     and the method answer the same batch one after the other, the order alternating with the
     batch count and the caller's ``parity`` (the baseline goes first on the k-th batch when
     ``(parity + k) % 2 == 0``), each side after the CPUs settled again;
  4. per request: the paired speedup (``paired_speedup``), end to end and of the decode phase
     alone (``paired_decode_speedup``: the prefill left out), checked against its physical bound
     (``tuner.measure.bounds``: beyond it, the batch is measured again, both sides; beyond it
     again, ``ImpossibleMeasurement`` fails the trial), and, at temperature 0 for a lossless
     method, the lossless check with the one near-tie rule (``tuner.measure.lossless.judge``;
     the backend supplies only how to read a logit gap, ``Backend.gap``); at several requests
     in flight a divergence where the baseline's own output changes when the batch is sent again
     is flagged ``engine_varies`` instead of judged;
  5. ``assess``: one summary with one set of keys for every backend (speed, acceptance, energy,
     per-level throughput and latency, task quality of both sides, perplexity where the backend
     can score it), computed after the timed window.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Protocol, Sequence

from tuner.measure.bounds import ImpossibleMeasurement, beyond
from tuner.measure.evaluator import Evaluation, MeasureSettings, Paired
from tuner.measure.levels import level_summary
from tuner.measure.lossless import Gap, first_difference, judge
from tuner.measure.measurement import (Measurement, paired_decode_speedup, paired_speedup,
                                       summarize)
from tuner.measure.quality import compare

if TYPE_CHECKING:
    from tuner.measure.energy import EnergyReading
    from tuner.measure.hygiene import ContentionGuard
    from tuner.tasks.task import Prompt

LEVEL_STRIDE = 100_000          # pruner steps: level index * stride + the prompt's index
RERUNS = 3                      # a divergence at c > 1: the baseline's batch sent again (untimed)
Batch = Sequence[tuple[int, "Prompt"]]     # (study index, prompt), in measuring order


class Backend(Protocol):
    """What the paired protocol needs of an engine's backend (see the module docstring)."""

    settings: MeasureSettings
    guard: ContentionGuard
    baseline_name: str          # how messages name the baseline ("vanilla", "llama.cpp's own ...")
    quality_cache: dict         # (prompt ids, baseline tokens) -> the baseline's task quality
    say: Callable[[str], None]  # progress lines (a batch measured again)
    bound_slack: float          # the physical bound's slack beyond L (tuner.measure.bounds)

    def warm_up(self, method: Any, baseline: bool) -> None:
        """Untimed runs of ``method`` (and of the baseline when ``baseline``)."""

    def run(self, method: Any | None, batch: Batch, level: int) -> list[Measurement]:
        """The batch's prompts generated together with ``method`` (None: the baseline)."""

    def settle(self) -> None:
        """Return once the CPUs are quiet enough to time the next side (or at once)."""

    def gap(self, prompt: Prompt, prefix: Sequence[int], chosen: int, other: int) -> Gap:
        """How far ``other`` trails ``chosen`` in the baseline's next-token distribution after
        prompt + ``prefix``, with the tolerance a rounding near-tie explains."""

    def energy(self, ms: Sequence[Measurement]) -> EnergyReading | None:
        """The energy ``ms`` took (None: not measured by this backend)."""

    def log_prob(self, m: Measurement) -> float | None:
        """The target's mean log-probability of ``m``'s tokens (None: cannot score here)."""

    def extra_summary(self, pairs: Sequence[Paired]) -> dict[str, float]:
        """Backend-specific numbers of the measurement that gave ``pairs`` (e.g. a server's
        restart time, a prediction of the prompts measured)."""


def batches(prompts: Batch, level: int) -> list[list[tuple[int, Prompt]]]:
    """Batches of ``level`` prompts covering every prompt at least once (cycled when fewer)."""
    count = -(-len(prompts) // level)
    return [[prompts[(b * level + j) % len(prompts)] for j in range(level)]
            for b in range(count)]


def measure_pairs(backend: Backend, method: Any, prompts: Batch, parity: int,
                  stored: Mapping[str, Measurement] | None = None,
                  fresh: bool | None = None,
                  levels: Sequence[int] | None = None, bounded: bool = True
                  ) -> Iterator[Paired]:
    """Steps 1–4 of the module docstring for ``method`` on ``prompts`` at every level of
    ``backend.settings.concurrency`` (``levels``: these of them only); ``stored``: the study's
    baseline per prompt id (``baseline=per_study``), so only the method runs; ``fresh``: whether
    that baseline was measured in this call (default: only when none is stored); ``bounded``:
    False for an A/A control, which reports what its path reads (a gap is its finding, not a
    disturbed trial)."""
    fresh = stored is None if fresh is None else fresh
    backend.warm_up(method, baseline=stored is None)
    slack = backend.bound_slack if bounded else math.inf
    k = 0
    for level_index, level in enumerate(backend.settings.concurrency):
        if levels is not None and level not in levels:
            continue
        for batch in batches(prompts, level):
            k += 1
            refs, got = _within_bounds(backend, method, batch, level, parity + k, stored, slack)
            again = Rerun(backend, batch, level)
            for slot, ((index, prompt), ref, m) in enumerate(zip(batch, refs, got)):
                checked = check(backend, m, ref, prompt, partial(again.tokens, slot))
                yield Paired(level_index * LEVEL_STRIDE + index, checked, ref, fresh)


def _within_bounds(backend: Backend, method: Any, batch: Batch, level: int, turn: int,
                   stored: Mapping[str, Measurement] | None, slack: float
                   ) -> tuple[list[Measurement], list[Measurement]]:
    """One batch's (baseline, method) answers with their paired figures, measured again (the
    other side first) where one reads beyond its physical bound; ``ImpossibleMeasurement`` where
    it does so twice (``tuner.measure.bounds``)."""
    refs, got = _paired_batch(backend, method, batch, level, turn % 2 == 0, stored)
    found = beyond(got, slack)
    if not found:
        return refs, got
    backend.say(f"impossible: {found[0].line()}; measuring this batch again")
    refs, got = _paired_batch(backend, method, batch, level, turn % 2 == 1, stored)
    again = beyond(got, slack)
    if again:
        raise ImpossibleMeasurement(
            f"impossible measurement, twice: {again[0].line()} (first {found[0].line()}); every "
            "step costs at least one target forward, so the machine was disturbed or the two "
            "sides do not run alike (an A/A control: python -m tuner.control)")
    return refs, got


def _paired_batch(backend: Backend, method: Any, batch: Batch, level: int,
                  baseline_first: bool, stored: Mapping[str, Measurement] | None
                  ) -> tuple[list[Measurement], list[Measurement]]:
    """One batch measured (the CPUs settled, the machine checked) and its paired figures."""
    backend.settle()
    load = backend.guard.check()
    if stored is not None:
        refs, got = [stored[p.id] for _, p in batch], backend.run(method, batch, level)
    else:
        refs, got = _both_sides(backend, method, batch, level, baseline_first)
    return refs, [replace(m, speedup=paired_speedup(ref, m),
                          decode_speedup=paired_decode_speedup(ref, m),
                          other_load=load.other_busy, contended=load.contended,
                          waited_s=load.waited_s) for ref, m in zip(refs, got)]


def _both_sides(backend: Backend, method: Any, batch: Batch, level: int, baseline_first: bool
                ) -> tuple[list[Measurement], list[Measurement]]:
    """The baseline's and the method's answers to one batch, one side after the other."""
    answers: dict[bool, list[Measurement]] = {}
    for turn, is_baseline in enumerate((True, False) if baseline_first else (False, True)):
        if turn:                        # the first side follows the caller's settle and check
            backend.settle()
        answers[is_baseline] = backend.run(None if is_baseline else method, batch, level)
    return answers[True], answers[False]


class Rerun:
    """The baseline's answers to one batch sent again (untimed, at most ``RERUNS`` times, only
    when asked: a divergence at several requests in flight)."""

    def __init__(self, backend: Backend, batch: Batch, level: int) -> None:
        self.backend, self.batch, self.level = backend, batch, level
        self.answers: list[list[Measurement]] | None = None

    def tokens(self, slot: int) -> list[tuple[int, ...]]:
        if self.answers is None:
            self.answers = [self.backend.run(None, self.batch, self.level)
                            for _ in range(RERUNS)]
        return [answer[slot].tokens for answer in self.answers]


def check(backend: Backend, m: Measurement, ref: Measurement, prompt: Prompt,
          reruns: Callable[[], list[tuple[int, ...]]] | None = None) -> Measurement:
    """The lossless check of ``m`` against the baseline's ``ref`` (temperature 0, lossless
    methods; otherwise ``m`` unchanged); ``reruns()``: the baseline's tokens for this request
    when its batch is sent again (asked only for a divergence at several requests in flight)."""
    s = backend.settings
    if not (s.greedy and s.lossless):
        return m

    def gap(position: int) -> Gap:
        return backend.gap(prompt, ref.tokens[:position], int(ref.tokens[position]),
                           int(m.tokens[position]))

    def varies(position: int) -> bool:
        if reruns is None or m.concurrency <= 1:
            return False
        return any(varies_by(tokens, ref.tokens, position) for tokens in reruns())

    return judge(m, ref.tokens, gap, backend.baseline_name, varies)


def varies_by(again: Sequence[int], first: Sequence[int], position: int) -> bool:
    """Whether a second answer leaves the first at or before ``position``."""
    differs = first_difference(again, first)
    return differs is not None and differs <= position


# -- after the timed window --------------------------------------------------------------------


def assess(backend: Backend, pairs: Sequence[Paired]) -> Evaluation:
    """Step 5 of the module docstring: the pairs as one ``Evaluation``."""
    s = backend.settings
    ms, refs = [p.method for p in pairs], [p.baseline for p in pairs]
    fresh = [p.baseline for p in pairs if p.fresh_baseline]
    summary = summarize(ms, backend.energy(ms), s.device)
    if fresh:
        summary["vanilla_tokens_per_s"] = sum(r.new_tokens for r in fresh) / \
            sum(r.wall_s for r in fresh)
    summary.update(energy_versus(summary, refs))
    if any(m.batch_wall_s is not None for m in ms):     # requests sent in batches per level
        summary.update(level_summary(pairs))
    summary.update(backend.extra_summary(pairs))
    record, ms, refs = quality(backend, pairs, ms, refs)
    summary.update(record)
    fresh = [r for p, r in zip(pairs, refs) if p.fresh_baseline]
    baseline = summarize([replace(r, speedup=1.0) for r in fresh], backend.energy(fresh),
                         s.device) if fresh else {}
    return Evaluation(summary, tuple(ms), tuple(fresh), baseline)


def quality(backend: Backend, pairs: Sequence[Paired], ms: list[Measurement],
            refs: list[Measurement]) -> tuple[dict[str, float], list[Measurement],
                                              list[Measurement]]:
    """Task quality of the method and of the baseline on the same prompts; perplexities (lossy
    methods, perplexity objectives) where the backend can score them."""
    task = backend.settings.task
    prompts = {p.id: p for p in (*backend.settings.tuning, *backend.settings.held_out)}
    shown = [prompts[m.prompt_id] for m in ms]
    method_quality, _ = task.score(shown, [m.text for m in ms])
    key = tuple((r.prompt_id, r.tokens) for r in refs)    # the baseline repeats (fixed seed)
    if key not in backend.quality_cache:
        backend.quality_cache[key] = task.score(shown, [r.text for r in refs])[0]
    vanilla_quality = backend.quality_cache[key]
    method_lp = vanilla_lp = None
    if backend.settings.scores_perplexity:
        scored = [(backend.log_prob(m), backend.log_prob(r)) for m, r in zip(ms, refs)]
        if all(a is not None and b is not None for a, b in scored):
            ms = [replace(m, mean_log_prob=a) for m, (a, _) in zip(ms, scored)]
            refs = [replace(r, mean_log_prob=b) for r, (_, b) in zip(refs, scored)]
            method_lp, vanilla_lp = [a for a, _ in scored], [b for _, b in scored]
    return compare(method_quality, vanilla_quality, method_lp, vanilla_lp), ms, refs


def energy_versus(summary: Mapping[str, float], vanilla: Sequence[Measurement]
                  ) -> dict[str, float]:
    """Vanilla's J/token on the same prompts and the method's ratio to it (NVML, GPU only)."""
    joules = [v.energy_j for v in vanilla]
    if "energy_j_per_token" not in summary or not vanilla or any(j is None for j in joules):
        return {}
    per_token = sum(joules) / max(sum(v.new_tokens for v in vanilla), 1)
    return {"vanilla_energy_j_per_token": per_token,
            "energy_ratio": summary["energy_j_per_token"] / per_token}

