"""Every method's points ranked by one profile on one loaded pair (tuner.predict.ranker:
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
    from tuner.predict.ranker import rank_methods
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

    def rank(profile, cheaper_first=CHEAPER_DEPLOYMENT_FIRST):
        members = {}
        for member in union.members:
            cfg_m = member.method
            ranker = base.for_method(cfg_m, lambda p, cfg_m=cfg_m: evaluator.build(cfg_m, p))
            ranker.profile = profile
            space = cfg_m.get("space") or {}
            default = {k: v for k, v in cfg_m["params"].items() if k in space}
            members[member.name] = (ranker, GridPlan(space, default, "heuristic",
                                                     settings.task.task_class).points)
        return rank_methods(members, list(settings.tuning), lambda line: None, cheaper_first)
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
