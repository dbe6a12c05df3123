"""Which point to evaluate next.

Plans (deterministic functions of the finished results, so a resumed study continues exactly):
  * ``HeuristicPlan``: Ouroboros Appendix B.2 Algorithm 1, generalised. Every parameter first gets
    a value drawn once from its heuristic range for the task class (HH/LH, Table 10; a one-value
    range such as K = 3 stays fixed); then, in the space's declared order, each parameter is swept
    over its heuristic range with the others held, and the best value (max objective, first on
    ties) is kept before the next parameter is swept.
  * ``GridPlan``: every point of a grid (the heuristic ranges, Table 9 style, or the whole space),
    the default first.
Samplers (TPE, random, NSGA, ...) are Optuna's own, built from the search config.
"""

from __future__ import annotations

import itertools
import random
from typing import Any, Mapping

from tuner.space import search_values

Point = dict[str, Any]


def point_key(params: Mapping[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


class HeuristicPlan:
    def __init__(self, space: Mapping[str, Mapping[str, Any]], task_class: str, seed: int) -> None:
        self.values = search_values(space, task_class)
        rng = random.Random(seed)
        self.initial: Point = {name: rng.choice(vals) for name, vals in self.values.items()}
        self.order = [name for name in space if len(self.values[name]) > 1]

    def next_point(self, results: Mapping[tuple, float]) -> tuple[Point, str] | None:
        """The next unevaluated point and its stage, or None when the plan is done."""
        current = dict(self.initial)
        for name in self.order:
            candidates = [{**current, name: v} for v in self.values[name]]
            for candidate in candidates:
                if point_key(candidate) not in results:
                    return candidate, name
            current = max(candidates, key=lambda c: results[point_key(c)])
        if not self.order and point_key(current) not in results:
            return current, "fixed"
        return None

    def size(self) -> int:
        return sum(len(self.values[name]) for name in self.order) or 1


class GridPlan:
    """``task_class`` given: the grid of the heuristic ranges (Table 9 style); None: the full space."""

    def __init__(self, space: Mapping[str, Mapping[str, Any]], default: Mapping[str, Any],
                 task_class: str | None = None) -> None:
        values = search_values(space, task_class)
        points = [dict(zip(values, combo)) for combo in itertools.product(*values.values())]
        first = [p for p in points if point_key(p) == point_key(default)]
        self.points = first + [p for p in points if point_key(p) != point_key(default)]

    def next_point(self, results: Mapping[tuple, float]) -> tuple[Point, str] | None:
        for point in self.points:
            if point_key(point) not in results:
                return point, "grid"
        return None

    def size(self) -> int:
        return len(self.points)
