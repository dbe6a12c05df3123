"""A per-batch-size speculation schedule: the best k per level and where it changes.

Given ``speedup(k, batch)`` (the predicted paired speedup of k drafted tokens per step at a batch
size; k = 0 is speculation off, 1.0 by definition) and the levels where it was predicted, the
best k per level (0 where no k beats vanilla) and, between two levels whose best k differ, the
threshold where the two predictions cross, with the loss of the wrong side at each level shown
(a threshold on the wrong side of a level costs that much there) (``plan``). Measured per-level
winners make the same ``Schedule`` (``from_winners``: each threshold is the upper level, no
losses known). One ``Schedule`` feeds every engine's form (``tuner.predict.forms``: vLLM,
SGLang, TensorRT-LLM, llama.cpp), so the forms never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence


@dataclass(frozen=True)
class LevelChoice:
    batch: int
    k: int                       # 0: speculation off
    speedup: float | None        # predicted, of k (1.0 for k = 0); None: a measured winner


@dataclass(frozen=True)
class Boundary:
    """Between levels ``low`` < ``high`` whose best k differ."""

    low: int
    high: int
    threshold: int               # first batch size of the upper k
    k_low: int
    k_high: int
    loss_at_low: float | None    # 1 − speedup(k_high, low) / speedup(k_low, low); None: unknown
    loss_at_high: float | None   # 1 − speedup(k_low, high) / speedup(k_high, high)


@dataclass(frozen=True)
class Schedule:
    levels: tuple[LevelChoice, ...]
    boundaries: tuple[Boundary, ...]
    max_batch: int

    @property
    def top(self) -> int:
        """The largest k at any level (0: speculation off at every level)."""
        return max(c.k for c in self.levels)

    def ranges(self) -> list[list[int]]:
        """[[start, end, k], ...] from 1 to ``max_batch``, consecutive equal k merged."""
        starts = [1] + [b.threshold for b in self.boundaries]
        ks = [self.levels[0].k] + [b.k_high for b in self.boundaries]
        out = []
        for i, (start, k) in enumerate(zip(starts, ks)):
            end = starts[i + 1] - 1 if i + 1 < len(starts) else self.max_batch
            if out and out[-1][2] == k:
                out[-1][1] = end
            else:
                out.append([start, end, k])
        return out

    def lines(self) -> list[str]:
        def shown(c: LevelChoice) -> str:
            if not c.k:
                return "speculation off (no k beats vanilla)"
            return f"k={c.k}" + ("" if c.speedup is None else f" ({c.speedup:.2f}x predicted)")
        out = [f"batch {c.batch}: {shown(c)}" for c in self.levels]
        for b in self.boundaries:
            loss = "" if b.loss_at_low is None or b.loss_at_high is None else (
                f"; the wrong side loses {100 * b.loss_at_low:.1f} % at {b.low}, "
                f"{100 * b.loss_at_high:.1f} % at {b.high}")
            out.append(f"k {b.k_low} -> {b.k_high} from batch {b.threshold} (between levels "
                       f"{b.low} and {b.high}{loss})")
        return out


def check_levels(levels: Sequence[int]) -> list[int]:
    levels = list(levels)
    if len(levels) < 2:
        raise ValueError(f"levels={levels}: a per-batch-size schedule needs two or more levels")
    if levels != sorted(set(levels)) or levels[0] < 1:
        raise ValueError(f"levels={levels}: allowed are distinct ascending batch sizes >= 1")
    return levels


def from_winners(levels_to_k: Mapping[int, int], max_batch: int) -> Schedule:
    """The schedule of measured per-level winners (``{level: k}``, k = 0 where speculation lost
    to vanilla there): each level's k from that level up to the next one (the first from batch
    1, the last up to ``max_batch``); a measurement says nothing between levels, so each
    threshold is the upper level and no loss is known."""
    levels = check_levels(sorted(levels_to_k))
    picked = [LevelChoice(b, int(levels_to_k[b]), None) for b in levels]
    boundaries = tuple(Boundary(low.batch, high.batch, high.batch, low.k, high.k, None, None)
                       for low, high in zip(picked, picked[1:]) if low.k != high.k)
    return Schedule(tuple(picked), boundaries, max(max_batch, levels[-1]))


def plan(speedup: Callable[[int, int], float], ks: Sequence[int], levels: Sequence[int],
         max_batch: int | None = None, between: bool = True) -> Schedule:
    """The schedule of the module docstring. ``ks``: the k to choose from (0 is added);
    ``levels``: two or more ascending batch sizes; ``max_batch``: the largest batch the table
    covers (default the last level); ``between``: ``speedup`` is known between the levels too
    (a cost surface), else only at them (measurements: each threshold is the upper level)."""
    levels = check_levels(levels)
    max_batch = max(max_batch or levels[-1], levels[-1])
    choices = sorted({0, *ks})

    def value(k: int, batch: int) -> float:
        return 1.0 if k == 0 else speedup(k, batch)

    picked = []
    for batch in levels:
        best = max(choices, key=lambda k: (value(k, batch), -k))   # ties: the smaller k
        picked.append(LevelChoice(batch, best, value(best, batch)))
    best_at = {c.batch: value(c.k, c.batch) for c in picked}     # the speedups just picked
    boundaries = []
    for low, high in zip(picked, picked[1:]):
        if low.k == high.k:
            continue
        threshold = next((b for b in range(low.batch + 1, high.batch + 1)
                          if value(high.k, b) >= value(low.k, b)), high.batch) \
            if between else high.batch
        boundaries.append(Boundary(
            low.batch, high.batch, threshold, low.k, high.k,
            1.0 - value(high.k, low.batch) / best_at[low.batch],
            1.0 - value(low.k, high.batch) / best_at[high.batch]))
    return Schedule(tuple(picked), tuple(boundaries), max_batch)


@dataclass(frozen=True)
class LevelCheck:
    """One level of a predicted schedule against what was measured there."""

    batch: int
    k: int                       # the predicted best (0: speculation off)
    predicted: float             # its predicted speedup there
    measured: float | None       # its measured speedup there (1.0 for k = 0; None: not measured)
    best_k: int                  # the measured best there (0: speculation off)
    best: float                  # its measured speedup

    @property
    def confirmed(self) -> bool:
        return self.k == self.best_k

    @property
    def loss(self) -> float | None:
        """What the predicted choice loses there against the measured best."""
        return None if self.measured is None else 1.0 - self.measured / self.best

    def line(self) -> str:
        def named(k: int) -> str:
            return f"k={k}" if k else "speculation off"
        head = (f"batch {self.batch}: predicted {named(self.k)} ({self.predicted:.2f}x), "
                + ("not measured there" if self.measured is None else
                   f"measured {self.measured:.2f}x"))
        if self.confirmed:
            return head + " - confirmed, the measured best there"
        loss = "" if self.loss is None else f": the predicted choice loses {100 * self.loss:.1f} %"
        return head + f"; the measured best {named(self.best_k)} ({self.best:.2f}x){loss}"


def check(schedule: Schedule, measured: Callable[[int, int], float | None],
          ks: Sequence[int]) -> list[LevelCheck]:
    """Per level of ``schedule``: its k's measured speedup there and the measured best among
    ``ks`` and speculation off (``measured(k, batch)``: None where k was not measured there)."""
    out = []
    for choice in schedule.levels:
        if choice.speedup is None:
            raise ValueError(f"batch {choice.batch}: a schedule of measured winners "
                             "(from_winners) has no prediction to check")
        values = {0: 1.0, **{k: v for k in ks if (v := measured(k, choice.batch)) is not None}}
        best = max(values, key=lambda k: (values[k], -k))
        out.append(LevelCheck(choice.batch, choice.k, choice.speedup, values.get(choice.k),
                              best, values[best]))
    return out
