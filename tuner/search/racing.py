"""Racing for the timed stage: measure points in order of prediction, drop the ones a sequential
paired rule shows behind, stop when no point left unmeasured can still win.

A race has three rules, each stated with its error:

  * **Drop** (per prompt, inside a trial): ``tuner.search.pruners.PairedPruner`` with the race's
    indifference margin δ and per-look error α: a trial is stopped once a one-sided t bound on
    its per-prompt paired log-ratios against the leader lies below ln(1 − δ). A point truly
    within δ of the leader is dropped with probability at most (n − 1)·α over a study of n
    tuning prompts (Bonferroni over the looks): 7.5 % at n = 4, α = 0.025. This is the F-race
    idea (Birattari et al., GECCO 2002: candidates raced on instances, dropped by a paired test
    once it rejects) with a paired t rule whose variance is pooled over the study's trials;
    ``bench/pruner_resample.py`` and ``tests/test_racing.py`` check it on resampled measured
    tables.
  * **Stop** (between trials, ``stop_bound``): the prediction's calibration is learnt from the
    points measured so far, r_i = ln(measured_i / predicted_i) over n points: its centre c (the
    mean) and its error, the one-sided prediction interval of a new point's residual,
    e = max(``error_floor``, t_{1−``miss``, n−1} · s · √(1 + 1/n)) with s the residuals' standard
    deviation (normal residuals: a point's measurement exceeds p·exp(c + e) with probability
    ``miss``, 10 %). An unmeasured point of prediction p could measure at most p·exp(c + e);
    the race stops when no unmeasured point's bound beats the leader L by more than δ:
    max p·exp(c + e) ≤ L·(1 + δ). Nothing stops it before ``min_measured`` points past the
    default are finished, nor with fewer than 3 residuals (no spread to speak of).
  * **Ties** (``tie_break``): finished points within δ of the best are one class; the one with
    the smallest draft (fewest draft tokens per step: less verification work and less to lose
    when acceptance moves) wins, then the best measured. The draft size is what the method or
    engine declares (``tuner.engines.base.Engine.draft_size``: a llama.cpp n-gram type's
    ``size_m``, SpecInfer's drafts × γ); a point whose size is not declared ranks after the
    sized ones of its class.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence


@dataclass(frozen=True)
class Race:
    """A race's settings (``search.race``)."""

    margin: float = 0.02          # δ: points within it of the leader are ties
    alpha: float = 0.025          # the drop rule's one-sided error per look
    error_floor: float = 0.05     # the least calibration error assumed (ln units: ~5 %)
    min_measured: int = 2         # points finished past the default before the stop rule acts
    miss: float = 0.1             # the stop bound's one-sided miss rate per unmeasured point

    @classmethod
    def from_config(cls, race: Mapping[str, Any] | None) -> Race | None:
        if not race:
            return None
        return cls(**{k: race[k] for k in ("margin", "alpha", "error_floor", "min_measured",
                                            "miss") if k in race})

    def looks_error(self, prompts: int) -> float:
        """The drop rule's stated error for a point at the margin over ``prompts`` prompts."""
        return min(1.0, max(0, prompts - 1) * self.alpha)


@dataclass(frozen=True)
class Calibration:
    """What the measured points say of the prediction: ln(measured / predicted)."""

    centre: float                 # c: the mean residual
    error: float                  # e: the one-sided prediction interval's half-width (≥ floor)
    points: int                   # residuals it was learnt from

    def bound(self, predicted: float) -> float:
        """The most an unmeasured point of this prediction could measure."""
        return predicted * math.exp(self.centre + self.error)


def calibration(pairs: Sequence[tuple[float, float]], floor: float, miss: float = 0.1
                ) -> Calibration | None:
    """From (measured, predicted) pairs of finished points (both > 0); None with fewer than 3
    (module docstring: the prediction interval of one more point's residual)."""
    from scipy.stats import t as student_t
    residuals = [math.log(m / p) for m, p in pairs
                 if m > 0 and p > 0 and math.isfinite(m) and math.isfinite(p)]
    n = len(residuals)
    if n < 3:
        return None
    centre, spread = statistics.fmean(residuals), statistics.stdev(residuals)
    half = float(student_t.ppf(1 - miss, n - 1)) * spread * math.sqrt(1 + 1 / n)
    return Calibration(centre, max(floor, half), n)


def stop_bound(race: Race, leader: float, finished: int, calib: Calibration | None,
               unmeasured: Sequence[float]) -> str | None:
    """Why the race stops now (a line), or None while an unmeasured point could still beat the
    leader by more than δ. ``unmeasured``: their predictions, best first or not."""
    if not unmeasured:
        return "every ranked point measured"
    if finished < race.min_measured or calib is None or not math.isfinite(leader) or \
            leader <= 0:
        return None
    best = max(unmeasured)
    if best == -math.inf:
        return "no unmeasured point can be predicted"
    reach = calib.bound(best)
    if reach <= leader * (1 + race.margin):
        return (f"no unmeasured point can beat the leader ({leader:.3f}x) by more than "
                f"{race.margin:.0%}: the best of {len(unmeasured)} left is predicted "
                f"{best:.3f}x, at most {reach:.3f}x with the calibration of {calib.points} "
                f"measured points (x{math.exp(calib.centre):.3f}, error "
                f"±{math.exp(calib.error) - 1:.1%})")
    return None


# Across methods, a tie goes to the cheaper deployment: what serving the answer adds to the
# target alone, least first. Speculation off adds nothing; an n-gram lookup only a table of the
# context; lookahead no model but wider forwards and its pool; an EAGLE head a small network on
# the target's features (EAGLE-3 reads three layers); a draft model a second model's memory and
# forwards (token verification before block verification: the rule every engine ships); a tree
# of one draft more rows per forward; SpecInfer several drafts' trees; Ouroboros a draft and its
# phrase pools; MJSD (lossy) beams and a quality bound to watch. A method not listed comes after
# these, by name (a new conf/method YAML needs no edit here to be ranked).
CHEAPER_DEPLOYMENT_FIRST = ("vanilla", "prompt_lookup", "lookahead", "eagle", "eagle3",
                            "speculative", "block", "tree", "specinfer", "ouroboros", "mjsd")


def deployment_rank(method: str) -> int:
    """Where ``method`` stands in ``CHEAPER_DEPLOYMENT_FIRST`` (a method not listed: after)."""
    order = list(CHEAPER_DEPLOYMENT_FIRST)
    return order.index(method) if method in order else len(order)


def tie_break(finished: Sequence[tuple[Any, Mapping[str, Any], float]], margin: float,
              draft_size: Callable[[Mapping[str, Any]], float | None],
              deployment: Callable[[Mapping[str, Any]], int] = lambda params: 0) -> Any:
    """The winner among ``(id, params, value)`` (higher is better): of the points within
    ``margin`` of the best, the cheapest ``deployment(params)`` (a study across methods: the
    method's ``deployment_rank``), then the smallest ``draft_size(params)`` (None: not
    declared, after every declared size), then the best value. None when empty."""
    usable = [f for f in finished if math.isfinite(f[2])]
    if not usable:
        return None
    best = max(v for _, _, v in usable)
    ties = [f for f in usable if f[2] >= best * (1 - margin)] if best > 0 else \
        [f for f in usable if f[2] == best]

    def size(params: Mapping[str, Any]) -> float:
        declared = draft_size(params)
        return math.inf if declared is None else declared
    return min(ties, key=lambda f: (deployment(f[1]), size(f[1]), -f[2]))[0]
