"""Many methods' points ranked by one profile on one loaded pair: the cross-method ranking
(``method=auto`` or a list of methods, ``tuner.config.union``).

Each method keeps its own ``tuner.predict.ranker.Ranker`` (``Ranker.for_method``: vanilla's
trajectories, the draft's agreements and the profile are shared, so nothing is measured twice
across methods) and ranks its own points by its own means (replay, successive halving, two
fidelities). ``UnionRanker`` stands where a study expects one ranker: each point of the union
goes to its member's ranker, and the profile's check and vanilla's price are the members'
common ones. ``rank_methods`` ranks members outside a study and orders them (``CrossRanking``).

Both rank the members whose points need no untimed run (replayed, or a draft chain's two
fidelities: seconds) before those predicted from untimed runs (successive halving: minutes),
and give each of the latter a floor (``tuner.predict.halving``): the best prediction so far on
every prompt, vanilla's 1.00x included, over ``FLOOR_REACH``. A member whose points all fall
below it on the prompts they have seen stops there: it cannot be the answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from tuner.predict.halving import FLOOR_REACH

if TYPE_CHECKING:
    from tuner.measure.evaluator import Paired
    from tuner.predict.ranker import Ranker
    from tuner.tasks.task import Prompt


@dataclass(frozen=True)
class MethodRanking:
    """One method's points ranked by prediction (``rank_methods``)."""

    name: str                                   # the conf/method file
    points: tuple[Mapping[str, Any], ...]       # its searched points, as given
    values: tuple[float, ...]                   # predicted speedup per point (-inf: none)
    cut: tuple[int | None, ...]                 # prompts seen where halving cut it (None: all)
    seconds: float                              # the ranking's wall time for this method

    @property
    def predicted(self) -> int:
        """Points with a prediction."""
        return sum(v != float("-inf") for v in self.values)

    @property
    def best(self) -> int | None:
        """Index of the best point predicted on every prompt (None: none was)."""
        whole = [i for i, c in enumerate(self.cut) if c is None and
                 self.values[i] != float("-inf")]
        return max(whole, key=lambda i: self.values[i]) if whole else None

    @property
    def best_value(self) -> float:
        return float("-inf") if self.best is None else self.values[self.best]


@dataclass(frozen=True)
class CrossRanking:
    """Every method's ranking, best first; ties to the cheaper deployment (``cheaper_first``)."""

    methods: tuple[MethodRanking, ...]

    def answer(self) -> str:
        """The method predicted best, or ``off`` where none is predicted faster than vanilla
        (1.00x on the same profile)."""
        top = self.methods[0] if self.methods else None
        return top.name if top is not None and top.best_value > 1.0 else "off"

    def lines(self) -> list[str]:
        out = []
        for m in self.methods:
            best = "not predicted" if m.best is None else \
                f"{m.best_value:.3f}x at {dict(m.points[m.best])}"
            out.append(f"  {m.name:<14} {best} ({m.predicted} of {len(m.points)} points "
                       f"predicted, {m.seconds:.1f} s)")
        return out + [f"  predicted answer: {self.answer()}"]


def rank_member(name: str, ranker: Ranker, points: Sequence[Mapping[str, Any]],
                prompts: Sequence[Prompt],
                known: Mapping[int, tuple[float, int | None]] | None = None,
                on_point: Callable[[int, float, int | None], None] = lambda i, value, cut: None,
                leader: float = 1.0) -> MethodRanking:
    """One method's points ranked by its ranker (``Ranker.rank_points``), timed; a point
    predicted from untimed runs is cut once it falls below ``leader`` (the best so far on every
    prompt, vanilla 1.00x at least) / ``FLOOR_REACH`` on the prompts it has seen."""
    began = time.perf_counter()
    values, cut = ranker.rank_points(points, prompts, known, on_point,
                                     floor=max(1.0, leader) / FLOOR_REACH)
    return MethodRanking(name, tuple(dict(p) for p in points), tuple(values), tuple(cut),
                         time.perf_counter() - began)


def untimed_last(members: Mapping[str, tuple[Ranker, Sequence[Mapping[str, Any]]]]
                 ) -> list[str]:
    """The members' names, those whose points need no untimed run first (their order kept
    otherwise): they set the floor for the others."""
    return sorted(members, key=lambda name: members[name][0].needs_untimed(members[name][1]))


def rank_methods(members: Mapping[str, tuple[Ranker, Sequence[Mapping[str, Any]]]],
                 prompts: Sequence[Prompt], say: Callable[[str], None],
                 cheaper_first: Sequence[str] = ()) -> CrossRanking:
    """Every member's points ranked by one profile (each member's own ``Ranker.rank_points``:
    replay, halving, two fidelities), the methods ordered by their best prediction; equal
    predictions go to the method earlier in ``cheaper_first`` (the cheaper deployment), then
    by name. ``members``: {method name: (its ranker, its searched points)}."""
    order = {name: i for i, name in enumerate(cheaper_first)}
    ranked: list[MethodRanking] = []
    for name in untimed_last(members):
        ranker, points = members[name]
        say(f"ranking method={name}: {len(points)} points ...")
        leader = max([1.0] + [m.best_value for m in ranked])
        ranked.append(rank_member(name, ranker, points, prompts, leader=leader))
    ranked.sort(key=lambda m: (-m.best_value, order.get(m.name, len(order)), m.name))
    return CrossRanking(tuple(ranked))


class UnionRanker:
    """A union of methods' ranker (``tuner.config.union``): each point to its member's own
    ranker (``Ranker.for_method``: vanilla's trajectories, the draft's agreements and the
    profile shared); the profile's check and vanilla's price are the members' common ones."""

    def __init__(self, method: Mapping[str, Any], base: Ranker,
                 members: Mapping[str, Ranker]) -> None:
        self.method, self.base, self.members = method, base, dict(members)

    @property
    def profile(self) -> Any:
        return self.base.profile

    @profile.setter
    def profile(self, profile: Any) -> None:      # made again (search.profile=auto): for all
        for ranker in (self.base, *self.members.values()):
            ranker.profile = profile

    def refuse_profile(self, line: str) -> None:
        for ranker in (self.base, *self.members.values()):
            ranker.refuse_profile(line)

    def check_profile(self, pairs: Sequence[Paired]) -> Any:
        return self.base.check_profile(pairs)

    def confirm_profile(self, pairs: Sequence[Paired]) -> Any:
        return self.base.confirm_profile(pairs)

    def vanilla_price(self, profile: Any) -> list[float] | None:
        return self.base.vanilla_price(profile)

    def split(self, params: Mapping[str, Any]) -> tuple[Ranker, dict[str, Any]]:
        """The member's ranker and its own parameters of a union's point."""
        from tuner.config.union import member_of
        name, _, own = member_of(self.method, params)
        return self.members[name], own

    def trial_prediction(self, params: Mapping[str, Any], pairs: Sequence[Paired]
                         ) -> dict[str, float]:
        ranker, own = self.split(params)
        return ranker.trial_prediction(own, pairs)

    def rank_points(self, points: Sequence[Mapping[str, Any]], prompts: Sequence[Prompt],
                    known: Mapping[int, tuple[float, int | None]] | None = None,
                    on_point: Callable[[int, float, int | None], None] =
                    lambda i, value, cut: None) -> tuple[list[float], list[int | None]]:
        """Every member's points by its own ranker (``Ranker.rank_points``: replay, halving,
        two fidelities), members in the union's order with those needing untimed runs last,
        each given the floor of the best so far (module docstring) and said with its time; the
        values and cuts back in ``points``' order."""
        from tuner.config.union import METHOD, member_of
        known = dict(known or {})
        values: list[float] = [float("-inf")] * len(points)
        cut: list[int | None] = [None] * len(points)
        groups: dict[str, list[int]] = {}
        for i, point in enumerate(points):
            groups.setdefault(str(point[METHOD]), []).append(i)
        unpriced = [n for n in self.members if n in (self.method.get("unpriced") or ())]
        own = {name: (ranker, [member_of(self.method, points[i])[2]
                               for i in groups.get(name, [])])
               for name, ranker in self.members.items() if name not in unpriced}
        leader = 1.0
        for name in untimed_last(own) + unpriced:
            ranker, where = self.members[name], groups.get(name, [])
            if not where:
                continue
            if name in unpriced:                                  # an EAGLE head: measured
                for i in where:
                    on_point(i, float("-inf"), None)
                ranker.say(f"  method={name}: not ranked (no hardware profile prices its "
                           "drafts): measured at its heuristic start point")
                continue
            ranked = rank_member(
                name, ranker, own[name][1], prompts,
                {j: known[i] for j, i in enumerate(where) if i in known},
                lambda j, value, c, where=where: on_point(where[j], value, c), leader)
            for j, i in enumerate(where):
                values[i], cut[i] = ranked.values[j], ranked.cut[j]
            best = "none predicted" if ranked.best is None else \
                f"best {ranked.best_value:.3f}x"
            partial = [v for v in ranked.values if v != float("-inf")]
            if ranked.best is None and partial and max(partial) < leader / FLOOR_REACH:
                best += (f": every point fell below the floor {leader / FLOOR_REACH:.3f}x "
                         f"(the best so far, {leader:.3f}x, over {FLOOR_REACH:g}) on the "
                         "prompts it saw")
            ranker.say(f"  method={name}: {len(where)} points ranked in "
                       f"{ranked.seconds:.1f} s ({best})")
            leader = max(leader, ranked.best_value)
        return values, cut
