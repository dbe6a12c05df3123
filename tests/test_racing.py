"""Racing (tuner/search/racing.py) and successive halving (tuner/predict/halving.py), checked on
the per-prompt paired speedups the search benchmark measured (bench/results_search_*_cpu.json)
and on plans fed known results."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from pathlib import Path

import optuna
import pytest

from tuner.predict.halving import FLOOR_REACH, coordinate_sweep, successive_halving
from tuner.search.plans import PredictPlan, point_key
from tuner.search.pruners import PairedPruner
from tuner.search.racing import Race, calibration, stop_bound, tie_break

ROOT = Path(__file__).resolve().parents[1]
TABLES = [ROOT / "bench" / f"results_search_{m}_cpu.json"
          for m in ("ouroboros", "speculative", "prompt_lookup")]
DIST = optuna.distributions.IntDistribution(0, 10_000)
RETEST_SD = 0.03          # per-prompt test-retest spread of a paired speedup measured here


def tables() -> dict[str, list[dict[int, float]]]:
    out = {}
    for path in TABLES:
        data = json.loads(path.read_text())
        out[path.stem] = [{int(k): float(v) for k, v in p["per_prompt"].items()}
                          for p in data["points"] if p.get("per_prompt")]
    return out


def geomean(values) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def race(points: list[dict[int, float]], rng: random.Random, pruner: PairedPruner
         ) -> list[tuple[float, int | None]]:
    """One bootstrapped race: the table's prompts resampled with replacement (paired across
    points), each observation with fresh test-retest noise, the points measured one after
    another in a random order, each prompt by prompt with the drop rule asked after every
    prompt but the last (as tuner.study.objective asks it). Returns, per point measured after
    the first, (its true ratio to the best point measured before it, prompt it was dropped at
    or None)."""
    steps = sorted(points[0])
    drawn = [rng.choice(steps) for _ in steps]
    truth = [geomean([p[s] for s in drawn]) for p in points]
    study = optuna.create_study(direction="maximize", pruner=pruner)
    out = []
    for index in rng.sample(range(len(points)), len(points)):
        study.enqueue_trial({"point": index})
        trial = study.ask({"point": DIST})
        dropped, observed = None, []
        for n, step in enumerate(drawn):
            observed.append(points[index][step] * math.exp(rng.gauss(0.0, RETEST_SD)))
            trial.report(observed[-1], n)
            if n + 1 < len(drawn) and trial.should_prune():
                dropped = n + 1
                break
        done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if done:
            leader = max(truth[t.params["point"]] for t in done)
            out.append((truth[index] / leader, dropped))
        if dropped:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, geomean(observed))
    return out


def races(pruner: PairedPruner, n: int, seed: int = 0) -> list[tuple[float, int | None]]:
    rng = random.Random(seed)
    every = []
    for points in tables().values():
        for _ in range(n):
            every += race(points, rng, pruner)
    return every


def upper_wilson(k: int, n: int, z: float = 2.58) -> float:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    return centre + z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)


def lower_wilson(k: int, n: int, z: float = 2.58) -> float:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    return centre - z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)


def rates(got: list[tuple[float, int | None]]) -> tuple[int, int, int, int]:
    """(best dropped, best measured, clearly worse dropped within 2 prompts, clearly worse)."""
    best = [n for r, n in got if r >= 1.0]
    worse = [n for r, n in got if r <= 0.75]
    return (sum(n is not None for n in best), len(best),
            sum(n is not None and n <= 2 for n in worse), len(worse))


def test_bootstrapped_races_drop_the_best_within_the_stated_error_and_the_worst_early():
    """Thousands of races (150 per table: ~5,000 candidates) on the committed per-prompt tables
    of three grids (Ouroboros 16 points, speculative 8, prompt lookup 30; 4 prompts each),
    resampled with test-retest noise: the race's drop rule (δ 2 %, α 0.025) drops a point that
    is in fact the best so far no more often than its stated error, (4 − 1)·α = 7.5 % (99 %
    Wilson bound; measured 1.1 %), and drops a point at most 0.75x the leader within two
    prompts in most races (measured 75 %; the rest mostly at the third: the pooled spread is
    still wide early in a race). A wrong rule (α = 0.3 per look, while 0.025 is stated) drops
    the best more often than stated, and a timid one (α = 1e-4) loses the early drops: both
    fail the same bounds."""
    stated = Race().looks_error(4)
    assert stated == pytest.approx(0.075)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    dropped, best, early, worse = rates(races(PairedPruner(0.02, 0.025), 150))
    assert best > 500 and worse > 500
    assert upper_wilson(dropped, best) <= stated, (dropped, best)
    assert lower_wilson(early, worse) >= 0.65, (early, worse)
    dropped, best, _, _ = rates(races(PairedPruner(0.02, 0.3), 150, seed=1))
    assert lower_wilson(dropped, best) > stated, (dropped, best)      # the wrong rule is caught
    _, _, early, worse = rates(races(PairedPruner(0.02, 1e-4), 150, seed=2))
    assert lower_wilson(early, worse) < 0.65, (early, worse)


RACE = Race(margin=0.02, alpha=0.025, error_floor=0.05, min_measured=2)


def ranked_plan(predicted: list[float], cut=None) -> PredictPlan:
    space = {"num_draft_tokens": {"type": "int", "low": 1, "high": len(predicted)}}
    plan = PredictPlan(space, {"num_draft_tokens": 1}, "full", None, top=3, spread=2, race=RACE)
    plan.rank(predicted, cut)
    return plan


def key(g: int) -> tuple:
    return point_key({"num_draft_tokens": g})


def test_the_race_measures_in_order_of_prediction_and_stops_when_nothing_left_can_win():
    """γ 1..8 predicted 1.0, 1.6, 1.5, 1.2, 1.1, 0.9, 0.8, 0.7. The default (γ 1) first, then
    γ 2, γ 3; measured 0.8x the prediction each (no spread: the floor 0.05), so γ 4's bound
    1.2·0.8·e^0.05 = 1.01 < leader 1.28·1.02: the race stops after 3 of 8 points, says why."""
    plan = ranked_plan([1.0, 1.6, 1.5, 1.2, 1.1, 0.9, 0.8, 0.7])
    assert plan.next_point({})[0] == {"num_draft_tokens": 1}
    results = {key(1): 0.8}
    assert plan.next_point(results)[0] == {"num_draft_tokens": 2}
    results[key(2)] = 1.28
    assert plan.next_point(results)[0] == {"num_draft_tokens": 3}    # min_measured = 2
    results[key(3)] = 1.2
    assert plan.next_point(results) is None
    assert "no unmeasured point can beat the leader (1.280x) by more than 2%" in plan.stopped
    # a calibration that says the prediction is far too low keeps the race going
    plan = ranked_plan([1.0, 1.6, 1.5, 1.2, 1.1, 0.9, 0.8, 0.7])
    assert plan.next_point({key(1): 1.5, key(2): 1.6, key(3): 2.4}) is not None


def test_points_cut_by_successive_halving_never_hold_the_race_up():
    """Cut points rank after the survivors and do not count as contenders: once both survivors
    are measured the race stops, even though a cut point's partial prediction is high."""
    plan = ranked_plan([1.0, 1.3, 1.2, 1.5], cut=[None, None, None, 1])
    assert [p["num_draft_tokens"] for p, _ in plan.chosen] == [1, 2, 3, 4]
    results = {key(1): 1.0, key(2): 1.3, key(3): 1.2}
    assert plan.next_point(results) is None
    assert plan.stopped == "every point the ranking priced in full is measured"
    stored = plan.stored()
    again = PredictPlan({"num_draft_tokens": {"type": "int", "low": 1, "high": 4}},
                        {"num_draft_tokens": 1}, "full", None, 3, 2, RACE)
    again.restore(stored)
    assert again.cut == {key(4): 1} and again.next_point(results) is None


def test_ties_within_the_margin_go_to_the_smaller_draft():
    finished = [("a", {"num_draft_tokens": 9}, 1.165), ("b", {"num_draft_tokens": 7}, 1.150),
                ("c", {"num_draft_tokens": 4}, 1.10)]
    size = lambda params: params["num_draft_tokens"]       # noqa: E731
    assert tie_break(finished, 0.02, size) == "b"    # 1.150 >= 0.98 * 1.165; 1.10 is not
    assert tie_break(finished, 0.0, size) == "a"
    # a size not declared ranks after every declared one of the class, then by value
    assert tie_break(finished, 0.02, lambda p: None if p["num_draft_tokens"] == 7 else 9) == "a"


def test_draft_sizes_are_what_each_method_and_engine_declares():
    """Read from the declaration (``Engine.draft_size``), never guessed from a name: SpecInfer's
    drafts x gamma, a prompt-lookup trie's matches x gamma, a dynamic tree's size (a static
    shape's is not declared), llama.cpp's n_max / an n-gram type's size_m / ngram-mod's
    mod_n_max (inactive knobs do not count; ngram-cache declares none), vLLM's
    num_speculative_tokens."""
    import yaml

    from tuner.engines import engine_named
    conf = ROOT / "conf"

    def method(name):
        return yaml.safe_load((conf / "method" / f"{name}.yaml").read_text())
    hf = engine_named("hf")
    assert hf.draft_size(method("specinfer"), {"num_drafts": 3, "num_draft_tokens": 4}) == 12
    assert hf.draft_size(method("prompt_lookup"), {"num_draft_tokens": 5, "num_matches": 2}) == 10
    assert hf.draft_size(method("speculative"), {"num_draft_tokens": 6}) == 6
    assert hf.draft_size(method("tree"), {"shape": "dynamic", "total_tokens": 8}) == 8
    assert hf.draft_size(method("tree"), {"shape": "2-2", "total_tokens": 8}) is None
    assert hf.draft_size(method("vanilla"), {}) is None
    engine = yaml.safe_load((conf / "engine" / "llamacpp.yaml").read_text())["methods"]
    llama = engine_named("llamacpp")
    lookup = engine["prompt_lookup"]
    base = dict(lookup["params"])
    assert llama.draft_size(engine["speculative"], {"n_max": 5, "n_min": 0}) == 5
    assert llama.draft_size(lookup, {**base, "spec_type": "ngram-simple", "size_m": 6}) == 6
    assert llama.draft_size(lookup, {**base, "spec_type": "ngram-mod", "mod_n_max": 16}) == 16
    assert llama.draft_size(lookup, {**base, "spec_type": "ngram-cache"}) is None
    vllm = yaml.safe_load((conf / "engine" / "vllm.yaml").read_text())["methods"]
    assert engine_named("vllm").draft_size(vllm["prompt_lookup"],
                                           {"num_speculative_tokens": 4}) == 4


def test_a_raced_llamacpp_study_breaks_ties_by_the_ngram_draft_length(tmp_path):
    """The race's tie-break in a llama.cpp prompt-lookup study: of two trials within the margin,
    the shorter size_m wins (a name list that knew only draft_max gave every point size 0, and
    the faster, longer draft won)."""
    from tests.conftest import compose_cfg
    from tests.helpers.services import require_llama_server
    from tuner.answer.finish import tie
    from tuner.study.settings import StudySettings
    require_llama_server()
    settings = StudySettings.from_config(compose_cfg(
        tmp_path, "engine=llamacpp", "models=smollm2", "method=prompt_lookup", "search=grid",
        "+search.race={margin: 0.02}", "tracking=none"))
    assert settings.race is not None
    dist = {"size_m": optuna.distributions.IntDistribution(1, 48)}
    trials = [optuna.trial.create_trial(params={"size_m": m}, distributions=dist, values=[v])
              for m, v in ((12, 1.16), (6, 1.15), (2, 1.05))]
    value = {i: t.values[0] for i, t in enumerate(trials)}
    for i, t in enumerate(trials):
        t.number = i
    assert tie(settings, trials, value).params["size_m"] == 6


def test_the_stop_bound_needs_finished_points_and_a_calibration():
    """The calibration is a one-sided prediction interval of one more residual: mean + t·s·
    √(1 + 1/n) of ln(measured / predicted); none from fewer than 3 points; the floor holds where
    the residuals agree."""
    from scipy.stats import t as student_t
    assert calibration([(1.0, 1.0), (0.9, 1.0)], 0.05) is None
    pairs = [(1.0, 1.0), (0.9, 1.0), (1.1, 1.0), (0.95, 1.0)]
    calib = calibration(pairs, 0.0, miss=0.1)
    residuals = [math.log(m) for m, _ in pairs]
    assert calib.centre == pytest.approx(statistics.fmean(residuals))
    assert calib.error == pytest.approx(student_t.ppf(0.9, 3) * statistics.stdev(residuals) *
                                        math.sqrt(1 + 1 / 4))
    assert calibration([(0.8, 1.0)] * 3, 0.05).error == 0.05
    assert stop_bound(RACE, 1.0, 1, calib, [0.5]) is None          # too few finished
    assert stop_bound(RACE, 1.0, 2, None, [0.5]) is None           # nothing to calibrate by
    assert stop_bound(RACE, 1.0, 2, calib, [0.5]) is not None
    assert stop_bound(RACE, 1.0, 2, calib, [1.2]) is None


def test_successive_halving_keeps_the_best_point_of_a_real_study():
    """Per-prompt paired speedups of the committed grids (Ouroboros 16 points, prompt lookup 30;
    4 prompts) resampled 1,000 times each (prompts drawn with replacement; no noise added: at
    T = 0 an untimed run's counts are deterministic), scored on the prompts seen by their
    geometric mean as a prediction averages them: η = 2 (at least 3 kept) keeps the point best
    over all four prompts to the end in 87 % of draws (Ouroboros 79 %: its leaders are within
    7 % and swap by prompt; prompt lookup 95 %); what it misses is still raced after the
    survivors unless the stop rule rules it out. Cutting to one point after the first prompt (η = 16, the wrong variant) keeps it in
    under 60 %."""
    data = {k: v for k, v in tables().items() if k != "results_search_speculative_cpu"}
    rng = random.Random(3)

    def trial(points, eta, keep_at_least):
        steps = sorted(points[0])
        drawn = [rng.choice(steps) for _ in steps]
        seen = [[p[s] for s in drawn] for p in points]
        full = [geomean(v) for v in seen]
        halving = successive_halving(len(points), len(drawn), lambda i, k: None,
                                     lambda i, n: geomean(seen[i][:n]), eta, keep_at_least)
        kept = [i for i, c in enumerate(halving.cut) if c is None]
        return max(range(len(points)), key=lambda i: full[i]) in kept

    for eta, keep_at_least, low, high in ((2, 3, 0.82, 1.0), (16, 1, 0.0, 0.6)):
        got = {name: sum(trial(points, eta, keep_at_least) for _ in range(1000)) / 1000
               for name, points in data.items()}
        overall = statistics.fmean(got.values())
        assert low <= overall <= high, (eta, got)
    assert got["results_search_prompt_lookup_cpu"] < 0.6


def per_prompt_tables() -> dict[str, list[dict[str, float]]]:
    """Every committed results table of bench/ with per-prompt paired speedups of its points
    (the points measured on the same prompts)."""
    out = {}
    for path in sorted((ROOT / "bench").glob("results_*.json")):
        data = json.loads(path.read_text())
        points = data.get("points") if isinstance(data, dict) else None
        table = [{k: float(v) for k, v in p["per_prompt"].items()} for p in points or []
                 if isinstance(p, dict) and isinstance(p.get("per_prompt"), dict)
                 and len(p["per_prompt"]) >= 3]
        table = [t for t in table if table and sorted(t) == sorted(table[0])]
        if len(table) >= 3:
            out[path.stem] = table
    return out


def floor_cuts(table: list[dict[str, float]], reach: float) -> list[float]:
    """Each point's figure over every prompt / the leader's (the table's best, vanilla's 1.00x
    at least), once for every prompt order and every k < all where the point's figure on its
    first k prompts lies below the leader / ``reach`` (where the floor would cut it)."""
    leader = max([1.0] + [geomean(t.values()) for t in table])
    out = []
    for point in table:
        full = geomean(point.values())
        for order in itertools.permutations(sorted(point)):
            out += [full / leader for k in range(1, len(order))
                    if geomean([point[x] for x in order[:k]]) < leader / reach]
    return out


def test_the_floor_cuts_no_point_of_a_real_study_that_comes_near_the_leader():
    """FLOOR_REACH on the committed per-prompt tables (9 grids of 8-30 points on 4 prompts):
    in every prompt order, a point whose figure on its first prompts is below the leader over
    FLOOR_REACH ends, over every prompt, at most 0.63x the leader (bound asserted: 0.8x), in
    thousands of such cuts. The wrong variant, a reach of 1.2, cuts the best point itself."""
    tables = per_prompt_tables()
    assert len(tables) >= 6, sorted(tables)
    cuts = [r for table in tables.values() for r in floor_cuts(table, FLOOR_REACH)]
    assert len(cuts) > 1000 and max(cuts) < 0.8, (len(cuts), max(cuts))
    wrong = [r for table in tables.values() for r in floor_cuts(table, 1.2)]
    assert max(wrong) == pytest.approx(1.0)


def test_halving_under_a_floor_keeps_only_points_above_it():
    """30 points scored i % 7 on 4 prompts: a floor of 5.5 keeps the 4 points scored 6 after
    the first prompt (η alone kept 15); one above every score cuts all after the first prompt
    and says so; one below every score changes nothing."""
    score = lambda i, n: float(i % 7)                                   # noqa: E731
    halving = successive_halving(30, 4, lambda i, k: None, score, floor=5.5)
    assert [(r.ran, r.kept, r.floored) for r in halving.rounds] == \
        [(30, 4, 11), (4, 3, 0), (3, 3, 0), (3, 3, 0)]
    assert [i for i, c in enumerate(halving.cut) if c is None] == [6, 13, 20]
    assert not halving.floored and "(11 below the floor)" in halving.line()
    none = successive_halving(30, 4, lambda i, k: None, score, floor=7.0)
    assert none.floored and none.runs() == 30 and all(c == 1 for c in none.cut)
    assert successive_halving(30, 4, lambda i, k: None, score, floor=-1.0) == \
        successive_halving(30, 4, lambda i, k: None, score)


def test_a_sweep_whose_stage_falls_below_the_floor_stops_there():
    """Algorithm 1 over a (3 values) x b (2 values): with every point below the floor, the
    sweep of a runs each of its 3 points on the first prompt and stops: b is never swept, its
    point cut at 0 prompts. Without the floor both parameters are swept."""
    points = [{"a": a, "b": b} for a in range(3) for b in range(2)]
    ran: list[tuple[int, int]] = []

    def run(i, k):
        if (i, k) not in ran:
            ran.append((i, k))
    score = lambda i, n: 0.1 * (1 + i)                                  # noqa: E731
    sweep = coordinate_sweep(points, 0, 3, run, score, floor=1.0)
    assert sweep.floored and [name for name, _ in sweep.stages] == ["a"]
    assert sorted(ran) == [(0, 0), (2, 0), (4, 0)] and sweep.cut[1] == 0
    assert sweep.line(3).endswith("3 untimed runs instead of 18; stopped there: no point "
                                  "above the floor")
    ran.clear()
    free = coordinate_sweep(points, 0, 3, run, score)
    assert [name for name, _ in free.stages] == ["a", "b"] and not free.floored


def test_halving_rounds_are_said():
    """30 points on 4 prompts keep 15, 8, 4: 57 untimed runs instead of 120."""
    halving = successive_halving(30, 4, lambda i, k: None, lambda i, n: float(i % 7))
    assert [(r.ran, r.kept) for r in halving.rounds] == [(30, 15), (15, 8), (8, 4), (4, 4)]
    assert halving.runs() == 57
    assert halving.line().endswith("57 untimed runs instead of 120")
    assert sum(c is None for c in halving.cut) == 4


def test_the_exact_fidelity_reorders_what_the_approximate_one_misorders():
    """Six points whose approximate prices put point 1 above point 0, the exact ones the other
    way round: both are in the best half, so the exact fidelity stands for them and orders them
    rightly; points outside the best half keep their approximate price, labelled."""
    from tuner.predict.halving import approximate_then_exact
    approximate = [1.20, 1.25, 1.10, 0.90, 0.80, 0.70]
    exact = [1.30, 1.15, 1.05, 0.95, 0.85, 0.75]
    calls = []

    def exactly(i):
        calls.append(i)
        return exact[i]
    two = approximate_then_exact(6, approximate.__getitem__, exactly)
    assert sorted(calls) == [0, 1, 2] and two.exact == (True, True, True, False, False, False)
    assert max(range(6), key=lambda i: two.values[i]) == 0
    assert two.values[3:] == tuple(approximate[3:])


def test_approximate_then_exact_keeps_the_exact_rankings_best_on_the_default_pair(
        default_pair, gsm8k_questions):
    """On the embedded default pair (the int8-dynamic self-draft, whose teacher-forced argmax is
    not always the loop's), every γ 1..8 priced approximately (``chain_steps``) and the best
    half exactly (``drafter_steps``), each by tokens per step over a stated cost (1 + 0.25 per
    drafted token: a draft forward a quarter of a step): the point the exact replay of every
    γ ranks first is among those priced exactly, with its exact value."""
    import torch

    from decoding import build_method
    from decoding.api import encode_prompt
    from decoding.replay import chain_steps, draft_agreement, drafter_steps, trajectory
    from tuner.predict.halving import approximate_then_exact
    pair = default_pair
    budget = 24
    prompts = [torch.as_tensor(encode_prompt(pair.tokenizer, q, True))
               for q in gsm8k_questions[:2]]
    tokens = [trajectory(pair.target, ids, budget) for ids in prompts]
    agree = [draft_agreement(pair.draft, ids, t) for ids, t in zip(prompts, tokens)]

    def worth(runs):
        return statistics.fmean(sum(s.committed for s in steps) /
                                sum(1 + 0.25 * s.drafted for s in steps) for steps in runs)

    def approximate(i):
        return worth([chain_steps(a, t, len(ids), i + 1, budget)
                      for a, t, ids in zip(agree, tokens, prompts)])

    def exact(i):
        method = build_method("speculative", pair, num_draft_tokens=i + 1)
        return worth([drafter_steps(method.drafter, ids, t, budget)
                      for t, ids in zip(tokens, prompts)])
    every = [exact(i) for i in range(8)]
    two = approximate_then_exact(8, approximate, exact)
    best = max(range(8), key=every.__getitem__)
    assert two.exact[best] and two.values[best] == every[best], (every, two)


@pytest.mark.parametrize("race,message", [
    ({"margin": 1.5}, "search.race.margin=1.5 is invalid: allowed is a fraction in [0, 1)"),
    ({"alpha": 0}, "search.race.alpha=0 is invalid: allowed is a probability in (0, 0.5)"),
    ({"miss": 0.7}, "search.race.miss=0.7 is invalid"),
    ({"min_measured": 0}, "search.race.min_measured=0"),
    ({"margins": 0.02}, "search.race={'margins': 0.02} is invalid: allowed is null"),
    ("fast", "search.race='fast' is invalid"),
])
def test_bad_race_settings_get_one_line(race, message):
    from tuner.config.errors import ConfigError
    from tuner.config.search import check_race
    with pytest.raises(ConfigError) as err:
        check_race(race)
    assert message in str(err.value) and "\n" not in str(err.value)
    check_race(None)
    check_race({"margin": 0.02, "alpha": 0.025, "error_floor": 0.05, "min_measured": 2,
                "miss": 0.1})
