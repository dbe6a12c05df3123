"""Successive halving over prompts: the cheap fidelity of a ranking that needs untimed runs.

A method whose acceptance does not replay (Ouroboros, lookahead, SpecInfer, MJSD) is predicted
from one untimed generation per point and prompt. Most points are clearly behind after a prompt
or two, so the ranking runs every point on the first prompt, keeps the best fraction 1/η by the
prediction on the prompts seen, adds the next prompt for the survivors, and so on until the
survivors have seen every prompt (Jamieson & Talwalkar, AISTATS 2016; Li et al., JMLR 2018,
Hyperband's inner loop, with prompts as the resource). At T = 0 each untimed run's counts are
deterministic, so every cut is exact *for the prompts seen*; what it can miss is a point behind
on the first prompts and ahead on the later ones (``tests/test_racing.py`` measures how often
on per-prompt predictions resampled from a real study). A point cut after k prompts keeps its
prediction on those k (the ranking places it after every survivor).

**A floor** (a ranking across methods, ``tuner.predict.across``): where another method's point
(or vanilla, 1.00x) is already predicted on every prompt, a point whose prediction on the
prompts it has seen is below that leader / ``FLOOR_REACH`` is cut after the round, whatever
η keeps; a sweep whose stage leaves no point above the floor stops there. ``FLOOR_REACH`` is
the most a point's figure over every prompt was found to exceed its figure on one prompt, with
room: over the 880 (point, prompt) pairs (220 points, 9 tables) of per-prompt measured
speedups in ``bench/``'s results (4-prompt studies of the default pair, 2026-11), the geometric
mean over a point's prompts was at most 1.84x its figure on one prompt (99th percentile 1.48x;
median 1.00x). Measured figures carry timing noise on top of the prompts' own spread; a
prediction carries only the latter, so the bound is loose for predictions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

FLOOR_REACH = 2.0      # a point's figure on every prompt over its figure on the prompts seen


@dataclass(frozen=True)
class Round:
    """One round: the prompts seen after it, points run on its prompt, points kept."""

    prompts: int
    ran: int
    kept: int
    floored: int = 0                   # of those not kept, cut by the floor (not by η)


@dataclass(frozen=True)
class Halving:
    """What successive halving decided, per point (by index)."""

    values: tuple[float, ...]          # [point] prediction on the prompts it saw (-inf: failed)
    cut: tuple[int | None, ...]        # [point] prompts seen when cut; None: it saw every one
    rounds: tuple[Round, ...]

    def runs(self) -> int:
        """Untimed generations made (points × prompts run)."""
        return sum(r.ran for r in self.rounds)

    @property
    def floored(self) -> bool:
        """Every point still running was cut by the floor (none can beat the leader)."""
        return bool(self.rounds) and self.rounds[-1].kept == 0 and self.rounds[-1].floored > 0

    def line(self) -> str:
        kept = ", ".join(f"{r.ran} on prompt {r.prompts} kept {r.kept}" +
                         (f" ({r.floored} below the floor)" if r.floored else "")
                         for r in self.rounds)
        full = len(self.values) * (self.rounds[-1].prompts if self.rounds else 0)
        return (f"successive halving: {kept}; {self.runs()} untimed runs instead of {full}")


RunRound = Callable[[Sequence[int], int], None]


def one_by_one(run: Callable[[int, int], None]) -> RunRound:
    """A round's runs one after the other (what ``run_round`` defaults to)."""
    def run_round(points: Sequence[int], k: int) -> None:
        for i in points:
            run(i, k)
    return run_round


def successive_halving(n_points: int, n_prompts: int, run: Callable[[int, int], None],
                       score: Callable[[int, int], float], eta: int = 2,
                       keep_at_least: int = 3,
                       on_round: Callable[[Round], None] = lambda r: None,
                       run_round: RunRound | None = None,
                       floor: float = -math.inf) -> Halving:
    """``run(i, k)``: point i's untimed run on prompt k (0-based; prompts in order, each point's
    history continuing from its prompt k − 1); ``score(i, n)``: point i's prediction on its
    first n prompts (-inf where it failed). After each round but the last, the best
    ⌈alive/η⌉ (at least ``keep_at_least``) are kept; ties keep the grid's order; a point
    predicted below ``floor`` on the prompts it saw is not kept (module docstring: a floor).
    ``on_round``: after each round (progress). ``run_round(points, k)``: a round's runs at
    once (``tuner.predict.workers``: on every core), in place of ``run`` one by one."""
    run_round = run_round or one_by_one(run)
    if eta < 2:
        raise ValueError(f"eta={eta!r}: expected an integer >= 2")
    values = [-math.inf] * n_points
    cut: list[int | None] = [None] * n_points
    rounds: list[Round] = []
    alive = list(range(n_points))
    for k in range(n_prompts):
        run_round(list(alive), k)
        for i in alive:
            values[i] = score(i, k + 1)
        live = [i for i in alive if values[i] > -math.inf]
        floored = 0
        if k == n_prompts - 1:
            keep = live
        else:
            best_first = sorted(live, key=lambda i: -values[i])     # stable: grid order on ties
            keep = sorted(best_first[: max(keep_at_least, math.ceil(len(alive) / eta))])
            floored = sum(values[i] < floor for i in keep)
            keep = [i for i in keep if values[i] >= floor]
        for i in alive:
            if i not in keep:
                cut[i] = k + 1
        rounds.append(Round(k + 1, len(alive), len(keep), floored))
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


@dataclass(frozen=True)
class Sweep:
    """What the coordinate sweep decided, per point (by index): as ``Halving``, with the points
    it never reached cut at 0 prompts (no prediction: -inf), and its stages' halvings."""

    values: tuple[float, ...]
    cut: tuple[int | None, ...]
    stages: tuple[tuple[str, Halving], ...]    # (the parameter swept, its halving)

    def runs(self) -> int:
        return sum(h.runs() for _, h in self.stages)

    @property
    def floored(self) -> bool:
        """The sweep ended at a stage the floor cut whole."""
        return bool(self.stages) and self.stages[-1][1].floored

    def line(self, n_prompts: int, runs: str = "untimed runs") -> str:
        swept = ", ".join(f"{name} over {len(h.values)} values" for name, h in self.stages)
        end = "; stopped there: no point above the floor" if self.floored else ""
        return (f"Algorithm 1 sweep ({swept or 'one point'}), each stage by successive halving: "
                f"{sum(c != 0 for c in self.cut)} of {len(self.values)} points predicted, "
                f"{self.runs()} {runs} instead of {len(self.values) * n_prompts}{end}")


def swept(points: Sequence[Mapping[str, Any]]) -> list[str]:
    """The parameters a sweep over ``points`` sweeps: those that vary, in their key order."""
    return [k for k in (points[0] if points else {})
            if len({repr(p.get(k)) for p in points}) > 1]


def sweep_reach(points: Sequence[Mapping[str, Any]]) -> int:
    """How many of ``points`` a sweep predicts at most: one per value of each swept
    parameter (what a search's cost counts before the sweep runs)."""
    reach = sum(len({repr(p.get(k)) for p in points}) for k in swept(points))
    return min(len(points), reach or 1)


def coordinate_sweep(points: Sequence[Mapping[str, Any]], start: int, n_prompts: int,
                     run: Callable[[int, int], None], score: Callable[[int, int], float],
                     eta: int = 2, keep_at_least: int = 2,
                     on_stage: Callable[[str, Halving], None] = lambda name, h: None,
                     run_round: RunRound | None = None, floor: float = -math.inf) -> Sweep:
    """Ouroboros Appendix B.2's Algorithm 1 on predictions: from point ``start``, each
    parameter that varies over ``points`` (in their key order) is swept over the points that
    differ from the current one in it alone, by successive halving over the prompts; the best
    becomes the current point before the next parameter. ``run(i, k)`` must be idempotent (a
    point run on prompt k already is not run again: the current point's runs carry over to
    the next stage). A point no stage reached is cut at 0 prompts (-inf). Coordinate descent:
    a joint optimum the sweep does not pass through is missed, as the paper's heuristic does.
    ``run_round(points, k)``: a round's runs at once (as ``successive_halving``'s). ``floor``:
    each stage's (``successive_halving``); a stage that leaves no point above it ends the
    sweep (``Sweep.floored``: the later stages' points are cut at 0 prompts)."""
    run_round = run_round or one_by_one(run)
    names = swept(points)
    values = [-math.inf] * len(points)
    cut: list[int | None] = [0] * len(points)
    stages: list[tuple[str, Halving]] = []
    current = start
    for name in names:
        here = points[current]
        group = [i for i, p in enumerate(points)
                 if all(repr(p.get(k)) == repr(here.get(k)) for k in names if k != name)]
        if len(group) < 2:
            continue
        halving = successive_halving(
            len(group), n_prompts, lambda j, k: run(group[j], k),
            lambda j, n: score(group[j], n), eta, keep_at_least,
            run_round=lambda js, k, group=group: run_round([group[j] for j in js], k),
            floor=floor)
        for j, i in enumerate(group):
            if cut[i] is None and halving.cut[j] is not None:
                continue                    # seen in full in an earlier stage: kept so
            values[i], cut[i] = halving.values[j], halving.cut[j]
        whole = [j for j in range(len(group)) if halving.cut[j] is None and
                 halving.values[j] > -math.inf]
        if whole:
            current = group[max(whole, key=lambda j: (halving.values[j], group[j] == current))]
        stages.append((name, halving))
        on_stage(name, halving)
        if halving.floored:
            break
    if not stages and points:               # nothing varies: the one point, in full
        halving = successive_halving(1, n_prompts, lambda j, k: run(start, k),
                                     lambda j, n: score(start, n), eta, keep_at_least,
                                     run_round=lambda js, k: run_round([start], k),
                                     floor=floor)
        values[start], cut[start] = halving.values[0], halving.cut[0]
        stages.append(("", halving))
    return Sweep(tuple(values), tuple(cut), tuple(stages))
