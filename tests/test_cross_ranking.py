"""Every method's points ranked by one profile on one loaded pair (tuner.predict.across,
``Ranker.for_method``, ``rank_methods``): planted costs decide which method the ranking puts
first, "off" when every method is planted slower than vanilla, and a tie goes to the cheaper
deployment (tuner.search.racing.CHEAPER_DEPLOYMENT_FIRST). Predictions price deterministic
acceptance (the tiny pair, greedy) by planted surfaces: no timing, any machine."""

from __future__ import annotations

import pytest

from tests.conftest import compose_cfg
from tuner.predict.surface import CostSurface, HardwareProfile
from tuner.search.racing import CHEAPER_DEPLOYMENT_FIRST

METHODS = ("speculative", "block", "prompt_lookup", "lookahead")
DRAFT_FREE = {"prompt_lookup", "lookahead"}


def planted(target_s: tuple[float, float], draft_s: float, loop_s: float) -> HardwareProfile:
    """Target forwards of 1 and 256 rows at ``target_s`` (linear between), every draft forward
    ``draft_s``, every loop's own time ``loop_s`` a step (vanilla's: none)."""
    target = CostSurface((0, 4096), (1, 256), (target_s, target_s))
    draft = CostSurface((0, 4096), (1, 256), ((draft_s, draft_s), (draft_s, draft_s)))
    return HardwareProfile(kind="measured", machine="cpu: planted", engine="hf", build={},
                           threads=1, models={}, target=target, draft=draft,
                           step_overhead_s={"vanilla": 0.0, "loop": loop_s,
                                            "draft_loop": loop_s}, made="planted")


@pytest.fixture(scope="module")
def members_of():
    """(rank(profile, cheaper_first) -> CrossRanking) over METHODS on the tiny pair, their
    heuristic grids, 2 tuning prompts x 24 tokens; the models load once."""
    from tuner.engines.inprocess import HFEvaluator
    from tuner.measure.timing import time_generation
    from tuner.predict.across import rank_methods
    from tuner.search.plans import GridPlan
    from tuner.study.settings import StudySettings
    from tuner.study.union import method_union
    cfg = compose_cfg(None, "models=tiny", "task.n_prompts=2", "task.max_new_tokens=24")
    settings = StudySettings.from_config(cfg)
    evaluator = HFEvaluator(settings.measuring, time_generation, lambda line: None)
    evaluator.open()
    base = evaluator.ranker()
    union = method_union(cfg, METHODS)
    assert {m.name for m in union.members} == set(METHODS)

    def rank(profile, cheaper_first=CHEAPER_DEPLOYMENT_FIRST, rankers=None, say=None):
        members = {}
        for member in union.members:
            cfg_m = member.method
            ranker = base.for_method(cfg_m, lambda p, cfg_m=cfg_m: evaluator.build(cfg_m, p))
            ranker.profile = profile
            space = cfg_m.get("space") or {}
            default = {k: v for k, v in cfg_m["params"].items() if k in space}
            members[member.name] = (ranker, GridPlan(space, default, "heuristic",
                                                     settings.task.task_class).points)
            if rankers is not None:
                rankers[member.name] = ranker
        return rank_methods(members, list(settings.tuning), say or (lambda line: None),
                            cheaper_first)
    return rank, {m.name: m.method for m in union.members}


def test_an_expensive_draft_model_puts_a_draft_free_method_first(members_of):
    rank, methods = members_of
    ranking = rank(planted((0.010, 0.0101), 10.0, 0.0))     # a draft forward: 1000 target's
    top = ranking.methods[0]
    assert top.name in DRAFT_FREE and top.best_value > 1.0 and ranking.answer() == top.name
    assert all(m.best_value < 0.1 for m in ranking.methods if methods[m.name]["needs_draft"])
    assert all(m.predicted == len(m.points) for m in ranking.methods)


def test_every_method_planted_slower_answers_off(members_of):
    rank, _ = members_of
    # verifying k tokens costs k forwards, and every loop 1 ms a step: nothing beats vanilla
    ranking = rank(planted((0.010, 2.56), 0.001, 0.001))
    assert all(m.best_value < 1.0 for m in ranking.methods)
    assert ranking.answer() == "off"
    assert ranking.lines()[-1] == "  predicted answer: off"


def test_a_method_below_half_the_leader_on_its_first_prompt_stops_there(members_of,
                                                                        monkeypatch):
    """Wide forwards planted dear (k rows cost k forwards): lookahead, predicted from untimed
    runs, is ranked after the replayed methods and falls below the floor (the leader, vanilla
    1.00x at least, over FLOOR_REACH) on its first prompt: its sweep stops there, with fewer
    untimed runs than without the floor (FLOOR_REACH made infinite), and the same answer."""
    from tuner.predict.across import FLOOR_REACH
    rank, _ = members_of
    dear = planted((0.010, 2.56), 0.001, 0.0)
    lines, rankers = [], {}
    floored = rank(dear, rankers=rankers, say=lines.append)
    runs = rankers["lookahead"].untimed_runs
    said = [x.split("=")[1].split(":")[0] for x in lines if x.startswith("ranking method=")]
    assert said[-1] == "lookahead", said          # the only member needing untimed runs: last
    monkeypatch.setattr("tuner.predict.across.FLOOR_REACH", float("inf"))
    free_rankers = {}
    free = rank(dear, rankers=free_rankers)
    ahead = {m.name: m for m in floored.methods}["lookahead"]
    priced = [(c, v) for c, v in zip(ahead.cut, ahead.values) if v != float("-inf")]
    assert ahead.best is None and priced and all(c in (0, 1) for c, _ in priced), ahead.cut
    assert max(v for _, v in priced) < max(1.0, floored.methods[0].best_value) / FLOOR_REACH
    assert 0 < runs < free_rankers["lookahead"].untimed_runs, \
        (runs, free_rankers["lookahead"].untimed_runs)
    assert {m.name: m for m in free.methods}["lookahead"].best is not None
    assert floored.answer() == free.answer()


def test_a_free_draft_puts_a_draft_method_first_and_ties_go_to_the_cheaper_deployment(
        members_of):
    rank, methods = members_of
    free = planted((0.010, 0.030), 1e-9, 0.0)     # wide forwards dearer: lookahead pays
    ranking = rank(free)
    top = ranking.methods[0]
    assert methods[top.name]["needs_draft"] and top.best_value > 1.0
    # token and block verification accept alike at T = 0: equal predictions, so the order of
    # deployment decides (token verification first); stated otherwise, the other way round
    values = {m.name: m.best_value for m in ranking.methods}
    assert values["speculative"] == pytest.approx(values["block"], rel=1e-12)
    names = [m.name for m in ranking.methods]
    assert names.index("speculative") < names.index("block")
    swapped = [m.name for m in rank(free, ("block", "speculative")).methods]
    assert swapped.index("block") < swapped.index("speculative")


# -- untimed runs on every core (tuner.predict.workers) ------------------------------------------

OUROBOROS = ["method=ouroboros", "method.params.num_draft_tokens=2", "method.params.window=4",
             "method.params.phrase_length=3", "method.params.num_phrases=2",
             "method.params.reuse_history=true",     # its pool carries across prompts
             "method.space.num_draft_tokens.low=2", "method.space.num_draft_tokens.high=5",
             "method.space.window.low=4", "method.space.window.high=5",
             "method.space.phrase_length.low=3", "method.space.phrase_length.high=3",
             "method.space.num_phrases.low=2", "method.space.num_phrases.high=2"]


@pytest.fixture(scope="module")
def ouroboros_ranking():
    """(rank(workers, untimed) -> (values, cut, untimed runs, lines, ranker)) of Ouroboros's
    8-point full grid on the tiny pair, 3 tuning prompts x 24 tokens, by one planted profile;
    the points; the tuning prompts."""
    from dataclasses import replace
    from tuner.engines.inprocess import HFEvaluator
    from tuner.measure.timing import time_generation
    from tuner.search.plans import GridPlan
    from tuner.study.settings import StudySettings
    cfg = compose_cfg(None, "models=tiny", "task.n_prompts=3", "task.max_new_tokens=24",
                      *OUROBOROS, "search=grid", "search.ranges=full")
    settings = StudySettings.from_config(cfg)
    evaluator = HFEvaluator(settings.measuring, time_generation, lambda line: None)
    evaluator.open()
    points = GridPlan(settings.space, settings.default, "full", settings.task.task_class).points
    assert len(points) == 8

    def rank(workers, untimed="halving"):
        lines = []
        ranker = evaluator.ranker().for_method(
            settings.method, lambda p: evaluator.build(settings.method, p))
        ranker.settings = replace(ranker.settings, untimed_workers=workers, untimed=untimed)
        ranker.profile, ranker.say = planted((0.010, 0.030), 0.002, 0.0005), lines.append
        values, cut = ranker.rank_points(points, list(settings.tuning))
        return values, cut, ranker.untimed_runs, lines, ranker
    return rank, points, list(settings.tuning)


@pytest.mark.parametrize("untimed", ["halving", "sweep"])
def test_untimed_runs_on_two_workers_rank_as_one_process_does(ouroboros_ranking, untimed):
    """Two forked workers, a point pinned to one (its phrase pool carried across the prompts
    there, as in one process): every point's prediction, every cut and the count of untimed
    runs equal the ranking made in the study's own process, and the line says how they ran."""
    rank, _, _ = ouroboros_ranking
    alone, spread = rank(1, untimed), rank(2, untimed)
    assert spread[:3] == alone[:3]
    assert alone[2] >= 8 and any(c is not None for c in alone[1]) or untimed == "sweep"
    said = "  untimed runs on 2 worker processes, one thread each (the timed runs keep the " \
        "study's threads)"
    assert said in spread[3] and said not in alone[3]


def test_a_worker_that_dies_loses_its_points_only(ouroboros_ranking, monkeypatch):
    """A worker that ends in the middle of a ranking (planted: it exits on its first run of a
    W 4 point; the grid's W 4 points are the ones pinned to it) loses the predictions of its
    points, each with one line; the other worker's points are predicted as one process
    predicts them when the same points fail there, and the study's process goes on."""
    import os
    from tuner.predict.ranker import Ranker
    rank, points, _ = ouroboros_ranking
    parent, real = os.getpid(), Ranker.observe

    def failing(self, method, prompts, fresh=True, keep=False):
        if method.drafter.engine.window == 4:
            if os.getpid() != parent:
                os._exit(3)              # the worker ends
            raise RuntimeError("planted")
        return real(self, method, prompts, fresh, keep)
    monkeypatch.setattr(Ranker, "observe", failing)
    alone, (values, cut, _, lines, _) = rank(1), rank(2)
    assert {j % 2 for j, p in enumerate(points) if p["window"] == 4} == {0}
    for j, point in enumerate(points):
        if point["window"] == 4:
            assert values[j] == alone[0][j] == float("-inf")
        else:
            assert values[j] == alone[0][j] > float("-inf") and cut[j] == alone[1][j]
    assert sum("not predicted (its untimed worker ended early)" in line for line in lines) == 4
    assert sum("not predicted (RuntimeError: planted)" in line for line in alone[3]) == 4


def test_a_trial_pruned_after_its_first_prompts_reads_the_rankings_run(ouroboros_ranking):
    """A trial the race prunes after its first prompts is predicted on those alone: it reads
    the ranking's untimed run on them (a survivor's, or a point the halving cut after one
    prompt) and makes none of its own; what it reads equals a fresh run of the point on those
    prompts (Ouroboros's pool carries across prompts: a run's first prompts are a fresh run's).
    A prompt that did not open the run is run anew."""
    rank, points, prompts = ouroboros_ranking
    _, cut, _, _, ranker = rank(1)
    survivor = cut.index(None)
    once = cut.index(1)

    def shape(generations):
        return [(g.new_tokens, g.steps, g.accepted, g.forwards) for g in generations]
    for j, n in ((survivor, 2), (survivor, 1), (once, 1)):
        params = {**ranker.settings.default, **points[j]}
        method = ranker.build(params)
        before = ranker.untimed_runs
        got = ranker.acceptance(method, prompts[:n], params)
        assert ranker.untimed_runs == before and len(got) == n
        assert shape(got) == shape(ranker.observe(method, prompts[:n]))
    before = ranker.untimed_runs
    ranker.acceptance(method, [prompts[1]], params)       # the cut point's second prompt
    assert ranker.untimed_runs == before + 1
