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
  * ``PredictPlan`` (``search=predict``): a grid ranked by predicted speedup (``tuner.predict``).
    Raced (``search.race``, the default): the points are measured in order of prediction until
    no unmeasured point can beat the leader (``tuner.search.racing.stop_bound``), each trial
    dropped by the paired rule once it is behind; unraced: only the default, the best-predicted
    and a few calibration points are measured. The default is measured first, before any
    ranking (the profile is checked against it); the ranking is then stored in the study
    (``stored`` / ``restore``), so a resumed study or another worker measures what it chose
    without ranking again.
Samplers (TPE, random, NSGA, ...) are Optuna's own, built from the search config.
"""

from __future__ import annotations

import itertools
import random
from typing import Any, Callable, ClassVar, Collection, Hashable, Mapping, Sequence

from tuner.search.racing import Race, calibration, stop_bound
from tuner.search.space import canonical, is_active, search_values

Point = dict[str, Any]
WAIT = "wait"


def point_key(params: Mapping[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


def default_first(points: Sequence[Point], default: Mapping[str, Any]
                  ) -> tuple[list[Point], bool]:
    """``points`` with the default first where it is one of them, and whether it is."""
    first = [p for p in points if point_key(p) == point_key(default)]
    return first + [p for p in points if point_key(p) != point_key(default)], bool(first)


def launch_grouped(points: Sequence[Point], launch: Callable[[Point], Hashable]
                   ) -> tuple[list[Point], int]:
    """``points`` with those of one ``launch`` key together, the groups in the order their
    first point came (the first point stays first; within a group the order is kept), and how
    many keys there are."""
    keys = [launch(point) for point in points]
    groups: dict[Hashable, int] = {}
    for key in keys:
        groups.setdefault(key, len(groups))
    order = sorted(range(len(points)), key=lambda i: groups[keys[i]])
    return [points[i] for i in order], len(groups)


class Plan:
    """What the study asks of every plan. Its capabilities are the ``ClassVar``s, declared by
    each plan class in its own body and read, never probed (tests/test_capabilities.py)."""

    # its points need a prediction first (``ranked`` once made; the study ranks before
    # measuring past the default: tuner.search.ranking)
    needs_ranking: ClassVar[bool] = False
    holds_default: bool = False     # trial 0 (the method's default) is one of the plan's points
    stopped: str | None = None      # why it ended before its last point (a race's stop line)
    launches: int | None = None     # baseline servers its points launch (None: not counted)

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
                 default: Mapping[str, Any] | None = None,
                 project: Callable[[Point], Point] | None = None) -> None:
        """``project``: what a point holds of the values it was built from (a union of methods:
        ``method`` and its member's parameters, ``tuner.config.union.point_space``; None: all).
        A union's draw holds every member's start values: ``method`` is the first parameter
        swept, each member at its own start point, before the best one's parameters are."""
        from tuner.config.union import METHOD
        self.space, self.default = space, dict(default or {})
        self.values = search_values(space, "heuristic", task_class)
        rng = random.Random(seed)
        initial = {name: rng.choice(vals) for name, vals in self.values.items()}
        if project is not None and METHOD in self.default:    # no member's draw reset
            initial[METHOD] = self.default[METHOD]
        self.project = project or dict
        # every parameter's drawn start value, those that do not act at the draw too: a sweep
        # that turns one on (a categorical's choice, e.g. llama.cpp's spec_type) brings it in at
        # its start value inside the heuristic ranges, not at a default outside them
        self.drawn: Point = dict(initial)
        self.order = [name for name in space if len(self.values[name]) > 1]

    @property
    def initial(self) -> Point:
        """Algorithm 1's first point: the draw, its inactive parameters at their default."""
        return canonical(self.drawn, self.space, self.default)

    def next_point(self, results: Mapping[tuple, float], taken: Collection[tuple] = ()
                   ) -> tuple[Point, str] | str | None:
        """The next point nobody has evaluated or taken, WAIT, or None when the plan is done."""
        current = dict(self.drawn)          # every parameter's value, inactive ones at their draw
        for name in self.order:
            if not is_active(name, self.space[name], current):
                continue
            swept = [{**current, name: v} for v in self.values[name]]
            candidates = [canonical(c, self.space, self.default) for c in swept]
            held = [self.project(c) for c in candidates]      # what each trial would hold
            keys = [point_key(h) for h in held]
            for point, key in zip(held, keys):
                if key not in results and key not in taken:
                    return point, name
            if any(key not in results for key in keys):
                return WAIT
            incumbent = point_key(self.project(canonical(current, self.space, self.default)))
            best = max(range(len(keys)),     # every value dropped (-inf): keep the incumbent
                       key=lambda i: (results[keys[i]], keys[i] == incumbent))
            current = swept[best]
        if not self.order:
            held = self.project(canonical(current, self.space, self.default))
            if point_key(held) in results:
                return None
            return WAIT if point_key(held) in taken else (held, "fixed")
        return None

    def size(self) -> int:
        """Points it may measure: every swept value (a union: its members at their start
        points, then the largest member's sweeps; only the best member is swept)."""
        from tuner.config.union import METHOD, SEP
        if self.project is dict or METHOD not in self.order:
            return sum(len(self.values[name]) for name in self.order) or 1
        swept = {m: sum(len(self.values[n]) for n in self.order if n.startswith(f"{m}{SEP}"))
                 for m in self.values[METHOD]}
        return len(self.values[METHOD]) + max(swept.values())


class GridPlan(Plan):
    """``ranges``: ``heuristic`` (Table 10 ranges), ``full`` (the space) or a named grid."""

    needs_ranking = False

    def __init__(self, space: Mapping[str, Mapping[str, Any]], default: Mapping[str, Any],
                 ranges: str = "full", task_class: str | None = None,
                 launch: Callable[[Point], Hashable] | None = None) -> None:
        """``launch``: the baseline server a point is measured against (an engine server's:
        ``Engine.baseline_key``); the points are ordered so that each starts once."""
        values = search_values(space, ranges, task_class, default)
        points, seen = [], set()
        for combo in itertools.product(*values.values()):   # inactive parameters at their default
            point = canonical(dict(zip(values, combo)), space, default)
            if point_key(point) not in seen:
                seen.add(point_key(point))
                points.append(point)
        # trial 0 is one of the grid's points where it holds the default
        self.points, self.holds_default = default_first(points, default)
        if launch is not None:      # trial 0's baseline first, where it is not a grid point
            lead = [] if self.holds_default else [dict(default)]
            grouped, self.launches = launch_grouped(lead + self.points, launch)
            self.points = grouped[len(lead):]

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
                 ranges: str, task_class: str | None, top: int, spread: int,
                 race: Race | None = None, points: Sequence[Point] | None = None,
                 unpriced: Sequence[Point] = ()) -> None:
        """``points``: the grid given (a union of methods: its members' grids side by side,
        ``union_grid``), else ``space``'s grid over ``ranges``; ``unpriced``: points of it no
        profile prices, measured right after the default whatever the ranking (``unpriced``
        stage; a race never stops before them)."""
        if points is None:
            grid = GridPlan(space, default, ranges, task_class)
            self.points, self.holds_default = grid.points, grid.holds_default
        else:
            self.points, self.holds_default = default_first([dict(p) for p in points], default)
        self.default = dict(default)
        self.default_key = point_key(default)
        self.unpriced = [dict(p) for p in unpriced if point_key(p) != self.default_key]
        self.top, self.spread, self.race = top, spread, race
        self.chosen: list[tuple[Point, str]] | None = None
        self.predicted: dict[tuple, float] = {}
        self.cut: dict[tuple, int] = {}     # points successive halving cut: prompts they saw
        self.refused: str | None = None
        self.stopped: str | None = None     # raced: why the race stopped (a line), once it has

    @property
    def ranked(self) -> bool:
        """Ranked, or refused: nothing is left to decide before measuring."""
        return self.chosen is not None or self.refused is not None

    def rank(self, predicted: Sequence[float], cut: Sequence[int | None] | None = None
             ) -> list[tuple[Point, str]]:
        """``predicted[i]``: point i's predicted speedup (higher is better); ``cut[i]``: the
        prompts point i saw where successive halving cut it (its prediction is on those), None
        for a point predicted on every prompt. Cut points rank after every uncut one (the later
        the cut, the earlier), and a race never waits for them (``next_point``)."""
        if len(predicted) != len(self.points):
            raise ValueError(f"{len(predicted)} predictions for {len(self.points)} points")
        cut = list(cut) if cut is not None else [None] * len(self.points)
        self.predicted = {point_key(p): v for p, v in zip(self.points, predicted)}
        self.cut = {point_key(p): c for p, c in zip(self.points, cut) if c is not None}
        order = sorted(range(len(self.points)),
                       key=lambda i: (cut[i] is not None, -(cut[i] or 0), -predicted[i]))
        unpriced = {point_key(p) for p in self.unpriced}
        rest = [self.points[i] for i in order if point_key(self.points[i]) != self.default_key
                and predicted[i] > float("-inf")            # -inf: the method refuses it
                and point_key(self.points[i]) not in unpriced]
        chosen = [(self.default, "default")] + [(p, "unpriced") for p in self.unpriced]
        if self.race is not None:           # every point, in order; the race decides how far
            self.chosen = chosen + [(p, "race") for p in rest]
            return self.chosen
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
                "chosen": [[dict(p), stage] for p, stage in self.chosen],
                "cut": [[dict(p), self.cut[point_key(p)]] for p in self.points
                        if point_key(p) in self.cut]}

    def restore(self, stored: Mapping[str, Any]) -> None:
        """The ranking ``stored`` (by this plan's ``stored``, in this study)."""
        if "refused" in stored:
            self.refused = str(stored["refused"])
            return
        self.predicted = {point_key(p): (float("-inf") if v is None else float(v))
                          for p, v in stored["predicted"]}
        self.cut = {point_key(p): int(c) for p, c in stored.get("cut", [])}
        self.chosen = [(dict(p), str(stage)) for p, stage in stored["chosen"]]
        if self.race is not None and any(stage in ("top", "spread") for _, stage in self.chosen):
            # a ranking stored unraced (top + spread), resumed raced: the same predictions
            self.rank([self.predicted.get(point_key(p), float("-inf")) for p in self.points],
                      [self.cut.get(point_key(p)) for p in self.points])

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
        if self.race is not None:
            return self._race_next(results, taken)
        for point, stage in self.chosen:
            key = point_key(point)
            if key not in results and key not in taken:
                return point, stage
        return None

    def _race_next(self, results: Mapping[tuple, float], taken: Collection[tuple]
                   ) -> tuple[Point, str] | None:
        """Raced: the best-predicted point not measured or taken, unless the stop rule ends the
        race (``stopped`` says why; points cut by successive halving never hold it up)."""
        assert self.race is not None and self.chosen is not None
        finite = {k: v for k, v in results.items() if v > float("-inf")}
        leader = max(finite.values(), default=float("-inf"))
        pairs = [(v, self.predicted[k]) for k, v in finite.items()
                 if self.predicted.get(k, float("-inf")) > float("-inf")]
        finished = sum(1 for p, stage in self.chosen[1:] if point_key(p) in results)
        ahead = [(p, stage) for p, stage in self.chosen
                 if point_key(p) not in results and point_key(p) not in taken]
        unmeasured = [self.predicted.get(point_key(p), float("-inf")) for p, _ in ahead
                      if point_key(p) not in self.cut]
        if not ahead:
            return None
        if ahead[0][1] == "unpriced":       # no prediction to race it by: measured
            return ahead[0]
        if self.default_key in results:     # the default is measured first, never raced out
            why = "every point the ranking priced in full is measured" if not unmeasured else \
                stop_bound(self.race, leader, finished,
                           calibration(pairs, self.race.error_floor, self.race.miss),
                           unmeasured)
            if why is not None:
                self.stopped = why
                return None
        return ahead[0]

    def size(self) -> int:
        """Points of the grid measured: the top and the spread (fewer on a short grid), and the
        default where the grid holds it (``Points.limit`` adds it where it does not); raced,
        every ranked point at most."""
        rest = len(self.points) - (1 if self.holds_default else 0)
        if self.race is not None:
            return len(self.points)
        return (1 if self.holds_default else 0) + min(rest, self.top + self.spread)


def union_grid(method: Mapping[str, Any], ranges: str, task_class: str | None, seed: int
               ) -> tuple[list[Point], list[Point]]:
    """A union of methods' grid (``tuner.config.union``): each member's own grid over ``ranges``
    (its inactive parameters at its default), as points of the union, members in order; and
    the points measured unranked: an unpriced member's heuristic start point (Algorithm 1's
    first point, ``HeuristicPlan.initial``) as its only point."""
    from tuner.config.union import member_points
    points: list[Point] = []
    unpriced: list[Point] = []
    for name, member in method["members"].items():
        space, default = member.get("space") or {}, member.get("params") or {}
        if name in (method.get("unpriced") or ()):
            start = HeuristicPlan(space, task_class or "", seed, default).initial
            unpriced += member_points(name, [start])
            points += member_points(name, [start])
            continue
        points += member_points(name, GridPlan(space, default, ranges, task_class).points)
    return points, unpriced
