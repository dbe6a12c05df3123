"""A per-batch-size speculation schedule from predicted speedups, in each engine's own form.

Given ``speedup(k, batch)`` (the predicted paired speedup of k drafted tokens per step at a batch
size; k = 0 is speculation off, 1.0 by definition) and the levels where it was predicted, the
best k per level (0 where no k beats vanilla) and, between two levels whose best k differ, the
threshold where the two predictions cross, with the loss of the wrong side at each level shown
(a threshold on the wrong side of a level costs that much there). Written as:
  * vLLM: ``num_speculative_tokens_per_batch_size`` ([start, end, k] inclusive ranges from 1
    to the largest batch; ``num_speculative_tokens`` the largest k, as vLLM caps the table at it);
  * SGLang: ``--speculative-adaptive-config`` tiers ({"<batch>": {"candidate_steps": [...]}},
    the best k and its neighbours, at least 1, from each tier's first batch size; its adaptive
    mode cannot switch speculation off, so an off tier gets its fewest steps, [1]) — written
    from a prediction, never run here: labelled untested;
  * llama.cpp: one setting per deployment (it takes no schedule): per level, the k to launch
    with (``--spec-draft-n-max``), or speculation off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class LevelChoice:
    batch: int
    k: int                       # 0: speculation off
    speedup: float               # predicted, of k (1.0 for k = 0)


@dataclass(frozen=True)
class Boundary:
    """Between levels ``low`` < ``high`` whose best k differ."""

    low: int
    high: int
    threshold: int               # first batch size of the upper k
    k_low: int
    k_high: int
    loss_at_low: float           # 1 − speedup(k_high, low) / speedup(k_low, low)
    loss_at_high: float          # 1 − speedup(k_low, high) / speedup(k_high, high)


@dataclass(frozen=True)
class Schedule:
    levels: tuple[LevelChoice, ...]
    boundaries: tuple[Boundary, ...]
    max_batch: int

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

    def vllm(self) -> dict | None:
        """vLLM's speculative-config keys; None where speculation is off at every level."""
        top = max(c.k for c in self.levels)
        if top == 0:
            return None
        return {"num_speculative_tokens": top,
                "num_speculative_tokens_per_batch_size": self.ranges()}

    def sglang(self) -> dict:
        """SGLang's adaptive-config tiers (untested: written from a prediction)."""
        top = max(c.k for c in self.levels)
        return {str(start): {"candidate_steps": sorted({max(k - 1, 1), k, min(k + 1, top)})
                             if k else [1]} for start, _, k in self.ranges()}

    def llamacpp(self) -> dict[int, str]:
        """Per level, the single setting to launch llama-server with."""
        return {c.batch: (f"--spec-draft-n-max {c.k}" if c.k else "speculation off")
                for c in self.levels}

    def lines(self) -> list[str]:
        out = [f"batch {c.batch}: " + (f"k={c.k} ({c.speedup:.2f}x predicted)" if c.k else
                                        "speculation off (no k beats vanilla)")
               for c in self.levels]
        for b in self.boundaries:
            out.append(f"k {b.k_low} -> {b.k_high} from batch {b.threshold} (between levels "
                       f"{b.low} and {b.high}; the wrong side loses {100 * b.loss_at_low:.1f} % "
                       f"at {b.low}, {100 * b.loss_at_high:.1f} % at {b.high})")
        return out


def plan(speedup: Callable[[int, int], float], ks: Sequence[int], levels: Sequence[int],
         max_batch: int | None = None, between: bool = True) -> Schedule:
    """The schedule of the module docstring. ``ks``: the k to choose from (0 is added);
    ``levels``: two or more ascending batch sizes; ``max_batch``: the largest batch the table
    covers (default the last level); ``between``: ``speedup`` is known between the levels too
    (a cost surface), else only at them (measurements: each threshold is the upper level)."""
    levels = list(levels)
    if len(levels) < 2:
        raise ValueError(f"levels={levels}: a per-batch-size schedule needs two or more levels")
    if levels != sorted(set(levels)) or levels[0] < 1:
        raise ValueError(f"levels={levels}: allowed are distinct ascending batch sizes >= 1")
    max_batch = max(max_batch or levels[-1], levels[-1])
    choices = sorted({0, *ks})

    def value(k: int, batch: int) -> float:
        return 1.0 if k == 0 else speedup(k, batch)

    picked = []
    for batch in levels:
        best = max(choices, key=lambda k: (value(k, batch), -k))   # ties: the smaller k
        picked.append(LevelChoice(batch, best, value(best, batch)))
    boundaries = []
    for low, high in zip(picked, picked[1:]):
        if low.k == high.k:
            continue
        threshold = next((b for b in range(low.batch + 1, high.batch + 1)
                          if value(high.k, b) >= value(low.k, b)), high.batch) \
            if between else high.batch
        boundaries.append(Boundary(
            low.batch, high.batch, threshold, low.k, high.k,
            1.0 - value(high.k, low.batch) / low.speedup,
            1.0 - value(low.k, high.batch) / high.speedup))
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
        values = {0: 1.0, **{k: v for k in ks if (v := measured(k, choice.batch)) is not None}}
        best = max(values, key=lambda k: (values[k], -k))
        out.append(LevelCheck(choice.batch, choice.k, choice.speedup, values.get(choice.k),
                              best, values[best]))
    return out
