"""Which point to evaluate next.

Plans are deterministic functions of what the study already holds, so a resumed study, or several
workers sharing one study, continue exactly where it stands:
  * ``results``: points with a final value (COMPLETE; FAIL counts as −inf);
  * ``taken``: points some worker is evaluating now or has queued (RUNNING, WAITING).
``next_point`` returns ``(point, stage)``, ``WAIT`` when every remaining point of the current stage
is being evaluated elsewhere (the next stage depends on their values), or None when the plan is done.

  * ``HeuristicPlan``: Ouroboros Appendix B.2 Algorithm 1, generalised. Every parameter first gets
    a value drawn once from its heuristic range for the task class (HH/LH, Table 10; a one-value
    range such as K = 3 stays fixed); then, in the space's declared order, each parameter is swept
    over its heuristic range with the others held, and the best value (max objective, first on
    ties) is kept before the next parameter is swept. A parameter whose ``active_when`` does not
    hold at that point (a dynamic tree's width under a static shape) is not swept; it stays at
    its default, so the point builds the same method as the one already measured.
  * ``GridPlan``: every point of a grid (the heuristic ranges, the whole space, or a named grid such
    as Ouroboros Table 9), the default first.
  * ``PredictPlan`` (``search=predict``): a grid ranked by predicted speedup (``tuner.predict``),
    of which only the default, the best-predicted and a few calibration points are measured. The
    default is measured first, before any ranking (the profile is checked against it); the
    ranking is then stored in the study (``stored`` / ``restore``), so a resumed study or another
    worker measures what it chose without ranking again.
Samplers (TPE, random, NSGA, ...) are Optuna's own, built from the search config.
"""

from __future__ import annotations

import itertools
import random
from typing import Any, ClassVar, Collection, Mapping, Sequence

from tuner.search.space import canonical, is_active, search_values

Point = dict[str, Any]
WAIT = "wait"


def point_key(params: Mapping[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


class Plan:
    """What the study asks of every plan. Its capabilities are the ``ClassVar``s, declared by
    each plan class in its own body and read, never probed (tests/test_capabilities.py)."""

    # its points need a prediction first (``ranked`` once made; the study ranks before
    # measuring past the default: tuner.study.ranking)
    needs_ranking: ClassVar[bool] = False
    holds_default: bool = False     # trial 0 (the method's default) is one of the plan's points

    def next_point(self, results: Mapping[tuple, float], taken: Collection[tuple] = ()
                   ) -> tuple[Point, str] | str | None:
        """The next point nobody has evaluated or taken, ``WAIT``, or None when it is done."""
        raise NotImplementedError

    def size(self) -> int:
        """How many points it may measure."""
        raise NotImplementedError


class HeuristicPlan(Plan):
    needs_ranking = False       # its points need no prediction first (PredictPlan's do)
    holds_default = False       # trial 0 (the method's default) comes on top of the plan's points

    def __init__(self, space: Mapping[str, Mapping[str, Any]], task_class: str, seed: int,
                 default: Mapping[str, Any] | None = None) -> None:
        self.space, self.default = space, dict(default or {})
        self.values = search_values(space, "heuristic", task_class)
        rng = random.Random(seed)
        initial = {name: rng.choice(vals) for name, vals in self.values.items()}
        self.initial: Point = canonical(initial, space, self.default)
        self.order = [name for name in space if len(self.values[name]) > 1]

    def next_point(self, results: Mapping[tuple, float], taken: Collection[tuple] = ()
                   ) -> tuple[Point, str] | str | None:
        """The next point nobody has evaluated or taken, WAIT, or None when the plan is done."""
        current = dict(self.initial)
        for name in self.order:
            if not is_active(name, self.space[name], current):
                continue
            candidates = [canonical({**current, name: v}, self.space, self.default)
                          for v in self.values[name]]
            for candidate in candidates:
                key = point_key(candidate)
                if key not in results and key not in taken:
                    return candidate, name
            if any(point_key(c) not in results for c in candidates):
                return WAIT
            current = max(candidates, key=lambda c: results[point_key(c)])
        if not self.order and point_key(current) not in results:
            return WAIT if point_key(current) in taken else (current, "fixed")
        return None

    def size(self) -> int:
        return sum(len(self.values[name]) for name in self.order) or 1


class GridPlan(Plan):
    """``ranges``: ``heuristic`` (Table 10 ranges), ``full`` (the space) or a named grid."""

    needs_ranking = False

    def __init__(self, space: Mapping[str, Mapping[str, Any]], default: Mapping[str, Any],
                 ranges: str = "full", task_class: str | None = None) -> None:
        values = search_values(space, ranges, task_class, default)
        points, seen = [], set()
        for combo in itertools.product(*values.values()):   # inactive parameters at their default
            point = canonical(dict(zip(values, combo)), space, default)
            if point_key(point) not in seen:
                seen.add(point_key(point))
                points.append(point)
        first = [p for p in points if point_key(p) == point_key(default)]
        self.points = first + [p for p in points if point_key(p) != point_key(default)]
        self.holds_default = bool(first)    # then trial 0 is one of the grid's points

    def next_point(self, results: Mapping[tuple, float], taken: Collection[tuple] = ()
                   ) -> tuple[Point, str] | None:
        for point in self.points:
            key = point_key(point)
            if key not in results and key not in taken:
                return point, "grid"
        return None

    def size(self) -> int:
        return len(self.points)


class PredictPlan(Plan):
    """``search=predict``: the grid's points ranked by predicted speedup (``rank``, once the
    default is measured), then measured: the default, the ``top`` best-predicted, and ``spread``
    points at even intervals over the rest of the ranking (to calibrate the prediction). Ties in
    prediction keep the grid's order, so every worker and a resumed study rank alike.

    Before the ranking the plan offers the default only (``WAIT`` while another worker measures
    it: that worker ranks; None once it is measured but nothing is ranked: the caller ranks);
    ``refuse(line)`` ends the plan instead (a profile that failed its check against the
    default, a ranking over the cost cap): ``refused`` holds the line."""

    needs_ranking = True        # ranked by predicted speedup once the default is measured

    def __init__(self, space: Mapping[str, Mapping[str, Any]], default: Mapping[str, Any],
                 ranges: str, task_class: str | None, top: int, spread: int) -> None:
        grid = GridPlan(space, default, ranges, task_class)
        self.points, self.holds_default = grid.points, grid.holds_default
        self.default = dict(default)
        self.default_key = point_key(default)
        self.top, self.spread = top, spread
        self.chosen: list[tuple[Point, str]] | None = None
        self.predicted: dict[tuple, float] = {}
        self.refused: str | None = None

    @property
    def ranked(self) -> bool:
        """Ranked, or refused: nothing is left to decide before measuring."""
        return self.chosen is not None or self.refused is not None

    def rank(self, predicted: Sequence[float]) -> list[tuple[Point, str]]:
        """``predicted[i]``: point i's predicted speedup (higher is better)."""
        if len(predicted) != len(self.points):
            raise ValueError(f"{len(predicted)} predictions for {len(self.points)} points")
        self.predicted = {point_key(p): v for p, v in zip(self.points, predicted)}
        order = sorted(range(len(self.points)), key=lambda i: -predicted[i])
        rest = [self.points[i] for i in order if point_key(self.points[i]) != self.default_key
                and predicted[i] > float("-inf")]           # -inf: the method refuses it
        chosen = [(self.default, "default")]
        chosen += [(p, "top") for p in rest[: self.top]]
        remaining = rest[self.top:]
        last = len(remaining) - 1           # at even quantiles of the rest, its ends excluded
        picks: list[int] = []
        for k in range(min(self.spread, len(remaining))):
            i = round((k + 1) * last / (self.spread + 1))
            while i in picks:               # a collision on a short rest: the next free one
                i = (i + 1) % len(remaining)
            picks.append(i)
        picks.sort()
        chosen += [(remaining[i], "spread") for i in picks]
        self.chosen = chosen
        return chosen

    def refuse(self, line: str) -> None:
        self.refused = line

    def stored(self) -> dict[str, Any]:
        """What the study keeps (a study user attribute: plain JSON)."""
        if self.refused is not None:
            return {"refused": self.refused}
        if self.chosen is None:
            raise RuntimeError("search=predict: nothing ranked to store")
        return {"predicted": [[dict(p), self.predicted.get(point_key(p))] for p in self.points],
                "chosen": [[dict(p), stage] for p, stage in self.chosen]}

    def restore(self, stored: Mapping[str, Any]) -> None:
        """The ranking ``stored`` (by this plan's ``stored``, in this study)."""
        if "refused" in stored:
            self.refused = str(stored["refused"])
            return
        self.predicted = {point_key(p): (float("-inf") if v is None else float(v))
                          for p, v in stored["predicted"]}
        self.chosen = [(dict(p), str(stage)) for p, stage in stored["chosen"]]

    def next_point(self, results: Mapping[tuple, float], taken: Collection[tuple] = ()
                   ) -> tuple[Point, str] | str | None:
        if self.refused is not None:
            return None
        if self.chosen is None:             # before the ranking: the default, then wait for it
            if self.default_key in results:     # measured, yet not ranked: the caller ranks
                return None
            if self.default_key not in taken:
                return self.default, "default"
            return WAIT
        for point, stage in self.chosen:
            key = point_key(point)
            if key not in results and key not in taken:
                return point, stage
        return None

    def size(self) -> int:
        """Points of the grid measured: the top and the spread (fewer on a short grid), and the
        default where the grid holds it (``Points.limit`` adds it where it does not)."""
        rest = len(self.points) - (1 if self.holds_default else 0)
        return (1 if self.holds_default else 0) + min(rest, self.top + self.spread)
