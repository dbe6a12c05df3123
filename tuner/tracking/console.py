"""The study's progress on the terminal: one line per trial start, prompt pair and trial end."""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from tuner.study.callbacks import Callback, TrialOutcome


class ConsoleProgress(Callback):
    """Prints what happens (``say`` is ``print`` with flush by default): per trial its place in
    the search and an estimate of the time left (``cost``: ``tuner.search.cost.SearchCost``, from
    the study's finished trials and the finish; without it from this process's trials), per
    prompt pair its speed, per trial its result."""

    def __init__(self, say: Callable[[str], None], study: Any = None, limit: int = 0,
                 cost: Any = None) -> None:
        self.say, self.study, self.limit, self.cost = say, study, limit, cost
        self.settings = None
        self.durations: list[float] = []
        self.began = 0.0

    def study_started(self, settings, study, created) -> None:
        self.settings = settings

    def trial_started(self, trial, params: Mapping[str, Any], stage: str) -> None:
        from tuner.study.trials import spent
        place = spent(self.study) + 1 if self.study is not None else trial.number + 1
        left = max(self.limit - place + 1, 1)
        eta = ""
        if self.cost is not None:          # tuner.search.cost: the study's trials, the finish
            eta = self.cost.progress()
        elif self.durations:
            mean = sum(self.durations) / len(self.durations)
            eta = f", ~{_minutes(mean * left)} left at {_minutes(mean)} per trial"
        self.say(f"trial {trial.number} [{stage}] {dict(params)} ({place} of at most "
                 f"{self.limit} trials{eta})")
        if not self.durations:
            self.say("  untimed warm-up, then each prompt: vanilla and the method, interleaved "
                     "(the first trial also loads what the method needs)")
        self.began = time.monotonic()

    def prompt_measured(self, trial, done: int, total: int, pair) -> None:
        got = pair.method
        busy = f", MACHINE BUSY (other load {got.other_load:.2f})" if got.contended else ""
        if got.waited_s >= 1:
            busy += (f" after waiting {got.waited_s:.0f} s for other processes "
                     "(contention=wait)" if got.contended else
                     f", measured after waiting {got.waited_s:.0f} s for the machine to be quiet")
        decode = getattr(got, "decode_speedup", None)
        decode = f" (decode phase {decode:.3f})" if decode is not None else ""
        self.say(f"  trial {trial.number} prompt {done}/{total}: {got.new_tokens} tokens "
                 f"{got.tokens_per_s:.2f} tok/s, paired speedup {got.speedup:.3f}{decode}{busy}")

    def trial_ended(self, trial, outcome: TrialOutcome) -> None:
        if self.began:
            self.durations.append(time.monotonic() - self.began)
        if outcome.state == "FAIL":
            self.say(f"trial {trial.number} FAILED: {outcome.error}")
            if outcome.kind == "lossless":
                self.say("  (a lossless method diverged from vanilla: this is a bug, not a bad "
                         "hyperparameter)")
            return
        summary = outcome.evaluation.summary
        drift = summary.get("vanilla_drift_ratio")
        if outcome.tags.get("vanilla_drift") == "true":
            self.say(f"  WARNING: trial {trial.number}: vanilla ran at {drift:.2f}x the study's "
                     f"first vanilla time per token (threshold {self.settings.drift_threshold}): "
                     "the machine's speed changed; the paired speedup still compares like with "
                     "like")
        decode = summary.get("decode_speedup")
        decode = f", decode phase {decode:.3f}" if decode is not None else ""
        if outcome.state == "PRUNED":
            self.say(f"  trial {trial.number} pruned after {int(summary['prompts'])} prompts "
                     f"(paired speedup so far {summary['speedup']:.3f}{decode})")
            return
        self.say(f"trial {trial.number} done: paired speedup {summary['speedup']:.3f}{decode} "
                 f"({summary['tokens_per_s']:.2f} tok/s, mean accepted "
                 f"{summary['mean_accepted_tokens']:.2f}{self._quality(summary, outcome)})")

    def _quality(self, summary: Mapping[str, float], outcome: TrialOutcome) -> str:
        text = ""
        if "perplexity_ratio" in summary:
            text = f", perplexity ratio {summary['perplexity_ratio']:.3f}"
        if "quality_drop" in summary and not self.settings.lossless:
            text += f", quality drop {summary['quality_drop']:+.3f}"
        if "feasible" in outcome.tags:
            text += ", feasible" if outcome.tags["feasible"] == "true" else \
                f", INFEASIBLE ({self.settings.bound.describe()})"
        if summary.get("contended_prompts"):
            text += (f", {int(summary['contended_prompts'])} prompt(s) measured while the "
                     "machine was busy")
        return text


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
