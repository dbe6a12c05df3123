"""A pruner that can prune at the handful of prompts a CPU study measures.

Optuna's ``WilcoxonPruner`` compares a trial's per-prompt values with the best trial's by a
signed-rank test, whose smallest one-sided p on n pairs is 1/2^n: 0.25 after 2 prompts, 0.125
after 3. A study of 3 tuning prompts (``budget=auto``) asks the pruner after prompts 1 and 2 (the
last prompt is always measured), so ``p_threshold=0.1`` can never be reached there: such a
configuration is refused in one line (``tuner.config.search.check_pruner_reach``).

``PairedPruner`` uses what a signed-rank test throws away: how far apart the pairs are. Each
prompt's paired speedup is compared with the best completed trial's on the same prompt,
d_i = ln(s_i / b_i), and the trial is pruned when a one-sided t bound says it is behind by more
than the indifference margin δ:

    mean(d) + t_{1−α, ν} · s / √n  <  ln(1 − δ)

where s² is the variance of the per-prompt differences around their mean, pooled over the
study's completed trials (each against the best on its prompts) and the trial itself, with ν
degrees of freedom (Σ (prompts − 1)); nothing is pruned before ν ≥ ``min_df``. Pooling lets one
prompt speak: the spread of the differences is learnt from the trials already measured in this
study, on this machine, for this method — not assumed.

Error rate (stated, and checked by resampling measured per-prompt tables in
``bench/pruner_resample.py``): under normally distributed differences of common variance, a
trial whose true geometric-mean speedup is within δ of the best's is pruned at one look with
probability at most α; a study of n prompts looks n − 1 times, so at most (n − 1)·α per trial
(Bonferroni): α = 0.025 gives ≤ 5 % at 3 prompts. A trial pruned is never the winner, and it
costs the prompts it measured.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import optuna
from optuna.pruners import BasePruner
from optuna.study import StudyDirection
from optuna.trial import TrialState

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial


class PairedPruner(BasePruner):
    """Prune a trial whose paired per-prompt values trail the best trial's by more than
    ``margin`` with one-sided confidence 1 − ``alpha`` (module docstring).

    Args:
        margin: δ, the indifference margin: trials within it of the best are not to be pruned
            (0.02: 2 % slower).
        alpha: the one-sided error rate per look for a trial at the margin.
        min_df: the pooled degrees of freedom needed before anything is pruned.
    """

    def __init__(self, margin: float = 0.02, alpha: float = 0.025, min_df: int = 2) -> None:
        if not 0 <= margin < 1:
            raise ValueError(f"margin={margin!r}: expected a fraction in [0, 1)")
        if not 0 < alpha < 0.5:
            raise ValueError(f"alpha={alpha!r}: expected a probability in (0, 0.5)")
        if isinstance(min_df, bool) or not isinstance(min_df, int) or min_df < 1:
            raise ValueError(f"min_df={min_df!r}: expected an integer >= 1")
        self.margin, self.alpha, self.min_df = margin, alpha, min_df

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        values = trial.intermediate_values
        try:
            best = study.best_trial
        except ValueError:                 # nothing completed yet
            return False
        sign = 1.0 if study.direction == StudyDirection.MAXIMIZE else -1.0
        mine = differences(values, best.intermediate_values, sign)
        if mine is None or not mine:
            return False
        squares, df = _residual_squares(mine), len(mine) - 1
        for other in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if other.number in (best.number, trial.number):
                continue
            theirs = differences(other.intermediate_values, best.intermediate_values, sign)
            if theirs is not None and len(theirs) >= 2:
                squares += _residual_squares(theirs)
                df += len(theirs) - 1
        if df < self.min_df:
            return False
        from scipy.stats import t as student_t
        mean = sum(mine) / len(mine)
        bound = mean + float(student_t.ppf(1 - self.alpha, df)) * \
            math.sqrt(squares / df / len(mine))
        return bound < math.log(1 - self.margin)


def differences(values: dict[int, float], best: dict[int, float], sign: float
                ) -> list[float] | None:
    """sign · ln(value / best value) on the steps both have; None where a value is not a
    positive finite number (a ratio of speeds is never 0: no judgement then)."""
    common = sorted(set(values) & set(best))
    out = []
    for step in common:
        a, b = values[step], best[step]
        if not (math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0):
            return None
        out.append(sign * math.log(a / b))
    return out


def _residual_squares(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs)
