"""The watch's change test (``tuner.watch.drift``) on simulated traffic with known change points:
false alarms per 1,000 steady windows and the delay to a 20 % drop in mean accepted length.
tests/test_watch.py runs a shorter version (it imports the simulator from here).

    .venv/bin/python bench/watch_drift.py          # ~1 min on 2 cores; writes
                                                   # bench/results_watch_drift.json

A window holds ``steps`` decode steps of k drafts from ``steps / per_request`` requests; a step
accepts min(k, ⌊ln U / ln α_r⌋) tokens (P(X ≥ i) = α_r^i), with α_r = α for every request
(independent steps) or drawn per request from Beta(α κ, (1 − α) κ) (requests differ; κ = 20: a
spread of about ±0.1 at α = 0.6; κ = 5: about ±0.2). Statistics only: nothing here is timed.
``steps="auto"`` sizes the windows as ``--min-steps auto`` does (``tuner.watch.drift.WindowSizer``:
a warm-up of 200-step windows measures the traffic, a second warm-up at the size it gives makes the
reference; whole requests per window here).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from decoding.acceptance import AcceptanceCounts
from tuner.watch.drift import ChangeTest, Observation, Verdict, WindowSizer

ROOT = Path(__file__).resolve().parents[1]


def mean_length(alpha: float, k: int) -> float:
    """1 + Σ_{i=1..k} α^i: the mean accepted length of k drafts accepted position by position
    with probability α."""
    return 1.0 + sum(alpha ** i for i in range(1, k + 1))


def alpha_for(length: float, k: int) -> float:
    low, high = 1e-9, 1 - 1e-9
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if mean_length(mid, k) < length else (low, mid)
    return (low + high) / 2


def simulated_window(rng: np.random.Generator, alpha: float, k: int, steps: int,
                     per_request: int, kappa: float | None) -> Observation:
    """One window (module docstring) as the change test reads it."""
    requests = steps // per_request
    alphas = np.full(requests, alpha) if kappa is None else \
        rng.beta(alpha * kappa, (1 - alpha) * kappa, requests).clip(1e-9, 1 - 1e-9)
    accepted = np.minimum(k, np.floor(np.log(rng.random(steps)) /
                                      np.log(np.repeat(alphas, per_request)))).astype(int)
    counts = AcceptanceCounts(steps=steps, drafts=steps, drafted=steps * k,
                              accepted=int(accepted.sum()),
                              accepted_per_position=tuple(int((accepted > i).sum())
                                                          for i in range(k)))
    return Observation(steps, counts.accepted, counts.step_variance())


def observe(test: ChangeTest, sizer: WindowSizer | None, steps: int, sizes: list[int] | None,
            window: Callable[[int], Observation]) -> Verdict:
    """One window of ``steps`` (or the sizer's, in whole requests: ``window`` rounds) through
    the test; the sizer told after it; a new size appended to ``sizes``."""
    verdict = test.observe(window(steps if sizer is None else sizer.steps))
    if sizer is not None:
        sized = sizer.after(test)
        if sized is not None and sizes is not None:
            sizes.append(sized.steps)
    return verdict


def false_alarms_per_1000(alpha: float, kappa: float | None, runs: int, windows: int, seed: int,
                          k: int = 4, steps: int | str = 200, per_request: int = 25,
                          make: Callable[[], ChangeTest] = ChangeTest,
                          sizes: list[int] | None = None) -> float:
    """Alarms per 1,000 steady windows after the warm-up (a test restarts after each)."""
    rng = np.random.default_rng(seed)
    alarms = 0

    def window(n: int) -> Observation:
        return simulated_window(rng, alpha, k, -(-n // per_request) * per_request, per_request,
                                kappa)
    for _ in range(runs):
        test = make()
        sizer = WindowSizer(test.shift, test.arl) if steps == "auto" else None
        warm = test.warmup * (2 if sizer else 1)      # auto: the measuring warm-up, then its own
        for _ in range(warm + windows):
            verdict = observe(test, sizer, 0 if sizer else int(steps), sizes, window)
            alarms += verdict.state == "ALARM"
    return 1000 * alarms / (runs * windows)


def delays(alpha: float, kappa: float | None, runs: int, seed: int, k: int = 4,
           drop: float = 0.2, steps: int | str = 200, per_request: int = 25,
           sizes: list[int] | None = None) -> np.ndarray:
    """Windows from a ``drop`` in mean accepted length to its alarm (1: the first window after
    the change), 20 windows after the warm-up; 99 where none came within 50."""
    rng = np.random.default_rng(seed)
    after = alpha_for((1 - drop) * mean_length(alpha, k), k)
    out = []
    for _ in range(runs):
        test = ChangeTest()
        sizer = WindowSizer(test.shift, test.arl) if steps == "auto" else None
        change = test.warmup * (2 if sizer else 1) + 20
        found = 99
        for w in range(change + 50):
            def window(n: int, a: float = alpha if w < change else after) -> Observation:
                return simulated_window(rng, a, k, -(-n // per_request) * per_request,
                                        per_request, kappa)
            verdict = observe(test, sizer, 0 if sizer else int(steps), sizes, window)
            if verdict.state == "ALARM" and w >= change:
                found = w - change + 1
                break
        out.append(found)
    return np.array(out)


def sizes_across_a_change(alpha: float, kappa: float | None, runs: int, seed: int,
                          change: float = -0.5, at: int = 6, k: int = 4,
                          per_request: int = 25) -> tuple[np.ndarray, np.ndarray, float]:
    """The sizes ``--min-steps auto`` chooses where its measuring warm-up (windows of 200 steps)
    holds a ``change`` in mean accepted length from its window ``at`` on (the traffic switched
    while the watch measured it); those the first warm-up's pooled spread about its mean would
    have given (φ read as ``Reference.dispersion``, no level-shift check: the sizing before
    2026-11-29's third session); the mean number of 200-step windows measured before the size."""
    from dataclasses import replace

    from tuner.watch.drift import reference_of, sized_steps
    rng = np.random.default_rng(seed)
    after = alpha_for((1 + change) * mean_length(alpha, k), k)
    chosen, pooled, measured = [], [], 0
    for _ in range(runs):
        test = ChangeTest()
        sizer = WindowSizer(test.shift, test.arl)
        w, seen = 0, []
        while True:
            obs = simulated_window(rng, alpha if w < at else after, k, 200, per_request, kappa)
            test.observe(obs)
            seen.append(obs)
            w += 1
            if w == test.warmup:        # the first warm-up as it was, before any check
                first = reference_of(seen)
                pooled.append(sized_steps(replace(first, successive=first.dispersion)).steps)
            sized = sizer.after(test)
            if sized is not None:
                chosen.append(sized.steps)
                measured += w
                break
    return np.array(chosen), np.array(pooled), measured / runs


def main() -> None:
    rows = []
    for label, kappa, steps in (("independent steps", None, 200), ("kappa 20", 20.0, 200),
                                ("kappa 5", 5.0, 200), ("kappa 5, 800 steps", 5.0, 800),
                                ("independent steps, auto", None, "auto"),
                                ("kappa 20, auto", 20.0, "auto"), ("kappa 5, auto", 5.0, "auto")):
        for alpha in (0.3, 0.6, 0.85):
            runs = 80 if steps in (200, "auto") else 20
            sizes: list[int] = []
            alarms = false_alarms_per_1000(alpha, kappa, runs, 1000, seed=1, steps=steps,
                                           sizes=sizes)
            found = delays(alpha, kappa, 200, seed=2, steps=steps)
            rows.append({"traffic": label, "alpha": alpha, "steps_per_window": steps,
                         "steady_runs": runs, "false_alarms_per_1000": alarms,
                         "found_within_5": float((found <= 5).mean()),
                         "median_delay": float(np.median(found))})
            if sizes:
                rows[-1]["sized_steps"] = {"median": float(np.median(sizes)),
                                           "p10": float(np.percentile(sizes, 10)),
                                           "p90": float(np.percentile(sizes, 90))}
            print(f"{label:24s} alpha {alpha}: {alarms:.2f} false alarms / 1,000 windows "
                  f"({runs} x 1,000), a 20 % drop found within 5 windows in "
                  f"{100 * rows[-1]['found_within_5']:.0f} % of 200 runs, median "
                  f"{rows[-1]['median_delay']:.0f}" + (
                      f"; windows of {np.median(sizes):.0f} steps (10-90 %: "
                      f"{np.percentile(sizes, 10):.0f}-{np.percentile(sizes, 90):.0f})"
                      if sizes else ""), flush=True)
    shifted = []
    for label, kappa in (("independent steps", None), ("kappa 20", 20.0), ("kappa 5", 5.0)):
        for change in (-0.3, 0.2):
            alpha = 0.6
            after = alpha_for((1 + change) * mean_length(alpha, 4), 4)
            steady, _, _ = sizes_across_a_change(after, kappa, 100, seed=3, change=0.0)
            sized, pooled, measured = sizes_across_a_change(alpha, kappa, 100, seed=3,
                                                            change=change)
            shifted.append({"traffic": label, "alpha": alpha, "change": change, "runs": 100,
                            "sized_median": float(np.median(sized)),
                            "steady_after_median": float(np.median(steady)),
                            "pooled_median": float(np.median(pooled)),
                            "windows_measured": measured})
            print(f"{label:24s} a {change:+.0%} change in L at the sizing warm-up's 7th window "
                  f"(alpha {alpha}): windows of {np.median(sized):.0f} steps (steady traffic "
                  f"after the change: {np.median(steady):.0f}; the pooled spread without the "
                  f"check: {np.median(pooled):.0f}), {measured:.1f} windows of 200 measured",
                  flush=True)
    out = ROOT / "bench" / "results_watch_drift.json"
    out.write_text(json.dumps({"defaults": {"warmup": ChangeTest().warmup,
                                            "shift": ChangeTest().shift,
                                            "arl": ChangeTest().arl},
                               "rows": rows, "change_in_sizing_warmup": shifted},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
