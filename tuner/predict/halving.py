"""Successive halving over prompts: the cheap fidelity of a ranking that needs untimed runs.

A method whose acceptance does not replay (Ouroboros, lookahead, SpecInfer, MJSD) is predicted
from one untimed generation per point and prompt. Most points are clearly behind after a prompt
or two, so the ranking runs every point on the first prompt, keeps the best fraction 1/η by the
prediction on the prompts seen, adds the next prompt for the survivors, and so on until the
survivors have seen every prompt (Jamieson & Talwalkar, AISTATS 2016; Li et al., JMLR 2018,
Hyperband's inner loop, with prompts as the resource). At T = 0 each untimed run's counts are
deterministic, so every cut is exact *for the prompts seen*; what it can miss is a point behind
on the first prompts and ahead on the later ones (``tests/test_halving.py`` measures how often
on per-prompt predictions resampled from a real study). A point cut after k prompts keeps its
prediction on those k (the ranking places it after every survivor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Round:
    """One round: the prompts seen after it, points run on its prompt, points kept."""

    prompts: int
    ran: int
    kept: int


@dataclass(frozen=True)
class Halving:
    """What successive halving decided, per point (by index)."""

    values: tuple[float, ...]          # [point] prediction on the prompts it saw (-inf: failed)
    cut: tuple[int | None, ...]        # [point] prompts seen when cut; None: it saw every one
    rounds: tuple[Round, ...]

    def runs(self) -> int:
        """Untimed generations made (points × prompts run)."""
        return sum(r.ran for r in self.rounds)

    def line(self) -> str:
        kept = ", ".join(f"{r.ran} on prompt {r.prompts} kept {r.kept}" for r in self.rounds)
        full = len(self.values) * (self.rounds[-1].prompts if self.rounds else 0)
        return (f"successive halving: {kept}; {self.runs()} untimed runs instead of {full}")


def successive_halving(n_points: int, n_prompts: int, run: Callable[[int, int], None],
                       score: Callable[[int, int], float], eta: int = 2,
                       keep_at_least: int = 3,
                       on_round: Callable[[Round], None] = lambda r: None) -> Halving:
    """``run(i, k)``: point i's untimed run on prompt k (0-based; prompts in order, each point's
    history continuing from its prompt k − 1); ``score(i, n)``: point i's prediction on its
    first n prompts (-inf where it failed). After each round but the last, the best
    ⌈alive/η⌉ (at least ``keep_at_least``) are kept; ties keep the grid's order.
    ``on_round``: after each round (progress)."""
    if eta < 2:
        raise ValueError(f"eta={eta!r}: expected an integer >= 2")
    values = [-math.inf] * n_points
    cut: list[int | None] = [None] * n_points
    rounds: list[Round] = []
    alive = list(range(n_points))
    for k in range(n_prompts):
        for i in alive:
            run(i, k)
        for i in alive:
            values[i] = score(i, k + 1)
        live = [i for i in alive if values[i] > -math.inf]
        if k == n_prompts - 1:
            keep = live
        else:
            best_first = sorted(live, key=lambda i: -values[i])     # stable: grid order on ties
            keep = sorted(best_first[: max(keep_at_least, math.ceil(len(alive) / eta))])
        for i in alive:
            if i not in keep:
                cut[i] = k + 1
        rounds.append(Round(k + 1, len(alive), len(keep)))
        on_round(rounds[-1])
        alive = keep
        if not alive:
            break
    return Halving(tuple(values), tuple(cut), tuple(rounds))


@dataclass(frozen=True)
class TwoFidelity:
    """An approximate prediction for every point, the exact one for the best of them."""

    values: tuple[float, ...]          # [point] exact where ``exact[i]``, else approximate
    exact: tuple[bool, ...]

    def line(self) -> str:
        return (f"approximate (one teacher-forced draft pass per prompt, every γ at once) for "
                f"{len(self.values)} points, exact replay for the {sum(self.exact)} best")


def approximate_then_exact(n_points: int, approximate: Callable[[int], float],
                           exact: Callable[[int], float], eta: int = 2,
                           keep_at_least: int = 3) -> TwoFidelity:
    """Every point priced by ``approximate(i)``; the best ⌈n/η⌉ (at least ``keep_at_least``)
    priced again by ``exact(i)``, which then stands for them (so a pair the approximation
    misorders among the kept is ordered by the exact fidelity). Ties keep the grid's order."""
    first = [approximate(i) for i in range(n_points)]
    live = sorted((i for i in range(n_points) if first[i] > -math.inf), key=lambda i: -first[i])
    kept = set(live[: max(keep_at_least, math.ceil(n_points / eta))])
    values = [exact(i) if i in kept else first[i] for i in range(n_points)]
    return TwoFidelity(tuple(values), tuple(i in kept for i in range(n_points)))
