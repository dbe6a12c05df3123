"""Roofline estimates (tuner.predict.roofline): a forward's bound computed by hand for a known
shape, the shapes read off a real model (fp32, int8-dynamic, bf16 pricing), the comparison with a
measured surface, and the command's estimates, comparison and one-line refusals."""

from __future__ import annotations

import json

import pytest

from tuner.config.errors import ConfigError
from tuner.predict import roofline
from tuner.predict.surface import CostSurface, load_profile

# 1 GB of weights, 1e9 multiply-adds per token, 2 layers of width 100, 1 kB KV per token
SHAPE = roofline.ModelShape("m", 1e9, 10**9, 2, 100, 1000.0)
GPU = roofline.Machine("g", 1000.0, 100.0, "test")     # 1 TB/s, 100 TFLOPS


def test_a_forward_is_bound_by_bandwidth_until_its_flops_dominate():
    # 1 row, context 0: bytes 1e9 + 1e3 -> 1.000001 ms; flops 2e9 + 4*2*100*1*1 -> 0.02 ms
    assert roofline.step_seconds(SHAPE, GPU, 0, 1) == pytest.approx((1e9 + 1e3) / 1e12)
    # 100 rows after 1000 tokens, batch 2: bytes 1e9 + 2*1100*1e3; flops 2e9*200 + 4*2*100*100
    # *1100*2 = 4e11 + 1.76e8 -> 4.00176 ms > 1.0022 ms: compute-bound
    assert roofline.step_seconds(SHAPE, GPU, 1000, 100, batch=2) == \
        pytest.approx((4e11 + 1.76e8) / 1e14)
    surface = roofline.surface(SHAPE, GPU, (0, 1000), (1, 100), (50,))
    assert surface.step_s(1000, 100) == pytest.approx(roofline.step_seconds(SHAPE, GPU, 1000,
                                                                            100))
    assert surface.prefill_s(50) == pytest.approx(roofline.step_seconds(SHAPE, GPU, 0, 50))


def test_the_shapes_are_read_off_the_model_as_loaded_or_priced_for_a_gpu(tiny_pairs):
    import torch

    from decoding.models import int8_dynamic_draft
    target = tiny_pairs["unrelated"].target
    config = target.config
    linear = sum(m.weight.numel() for m in target.modules() if isinstance(m, torch.nn.Linear))
    fp32 = roofline.ModelShape.of(target, "tiny")
    assert fp32.matmul_params == linear and fp32.weight_bytes == 4 * linear
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // \
        config.num_attention_heads
    assert fp32.kv_bytes_per_token == 2 * config.num_hidden_layers * \
        config.num_key_value_heads * head_dim * 4
    bf16 = roofline.ModelShape.of(target, "tiny", bf16=True)
    assert bf16.weight_bytes == 2 * linear and bf16.kv_bytes_per_token == \
        fp32.kv_bytes_per_token / 2
    int8 = roofline.ModelShape.of(int8_dynamic_draft(target), "tiny int8", bf16=True)
    assert int8.matmul_params == linear and int8.weight_bytes == linear     # 1 byte each


def test_the_comparison_reports_each_cell_and_the_ratio_a_prediction_uses():
    measured = CostSurface((0,), (1, 4), ((0.010, 0.020),), ((16, 0.030),))
    estimate = CostSurface((0,), (1, 4), ((0.005, 0.005),), ((16, 0.015),))
    got = roofline.compare(estimate, measured)
    assert [round(c["error"], 3) for c in got["cells"]] == [-0.5, -0.75]
    assert got["median_abs_error"] == pytest.approx(0.625)
    # the 4-row/1-row ratio: 1.0 estimated vs 2.0 measured -> -50 % (the 1-row column, 0 by
    # construction, is not counted)
    assert got["median_abs_ratio_error"] == pytest.approx(0.5)
    assert got["median_abs_prefill_error"] == pytest.approx(0.5)


@pytest.mark.parametrize("name,key", [("H100", "H100"), ("rtx 4090", "RTX4090"),
                                      ("l40s", "L40S"), ("CPU", "cpu")])
def test_gpu_names_match_without_case_or_spaces(name, key):
    assert roofline.machine_named(name) == key


def test_the_command_writes_estimates_compares_and_refuses_bad_input(tmp_path, capsys):
    """A named GPU's estimate loads as a roofline profile of the tiny models; this CPU's, made
    on a measured profile's grid, is compared with it cell by cell; an unknown GPU, --compare
    without --roofline and a roofline profile to compare with are refused with one line each."""
    from tuner import profile as cli
    measured = tmp_path / "measured.json"
    assert cli.main(["--models", "tiny", "--repeats", "1", "--contexts", "8", "64",
                     "--rows", "1", "4", "--draft-rows", "1", "2", "--out", str(measured)]) == 0
    l4 = tmp_path / "l4.json"
    assert cli.main(["--models", "tiny", "--roofline", "L4", "--out", str(l4)]) == 0
    estimate = load_profile(l4, models=cli.preset_models("tiny"))
    assert estimate.kind == "roofline" and estimate.machine == "NVIDIA L4 24GB"
    assert "ESTIMATE" in estimate.note and "300 GB/s" in estimate.note
    assert estimate.step_overhead_s == {} and estimate.draft is not None
    assert "an ESTIMATE (roofline, not measured)" in capsys.readouterr().out
    compared = tmp_path / "compare.json"
    assert cli.main(["--models", "tiny", "--roofline", "cpu", "--compare", str(measured),
                     "--out", str(tmp_path / "cpu.json"), "--compare-json",
                     str(compared)]) == 0
    out = capsys.readouterr().out
    assert "target: roofline estimate / measured - 1 (median |error|" in out
    assert "| context | 1 rows | 4 rows |" in out and "| 64 |" in out
    report = json.loads(compared.read_text())
    assert [(c["context"], c["rows"]) for c in report["target"]["cells"]] == \
        [(8, 1), (8, 4), (64, 1), (64, 4)]
    assert "measured here with" in report["machine"] and "GB/s" in report["machine"]
    for bad, message in (
            (["--roofline", "B300"], "--roofline='B300' is not a GPU this roofline knows: "
                                     "allowed are ['A100', 'H100', 'H200', 'L4', 'L40S', "
                                     "'RTX4090', 'cpu']"),
            (["--compare", str(measured)], "needs --roofline"),
            (["--roofline", "h100", "--compare", str(l4)], "is a roofline profile: allowed is "
                                                           "a measured one")):
        assert cli.main(["--models", "tiny", *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("bad,message", [
    (["--engine", "sglang"], "--engine='sglang': its cost surface is not built yet; allowed "
                             "are ['hf', 'llamacpp', 'vllm']"),
    (["--engine", "llamacpp", "--synth-len", "half"], "--synth-len=half is invalid: allowed is "
                                                      "a mean accepted length >= 1"),
    (["--engine", "llamacpp", "--ks", "4", "2"], "--ks=[4, 2] is invalid: allowed are distinct "
                                                 "ascending integers >= 1"),
    (["--engine", "llamacpp", "--synth-len", "0.5"], "--synth-len=0.5 is invalid"),
    (["--engine", "llamacpp", "--roofline", "H100"], "estimates our own loops"),
    (["--roofline", "H100", "--batches", "8"], "--batches=[8] asks a per-batch-size schedule "
                                               "for one level only"),
    (["--batches", "1", "8"], "--batches=[1, 8] needs --roofline")])
def test_engine_and_batch_settings_are_refused_in_one_line_before_anything_loads(
        bad, message, capsys):
    from tuner import profile as cli
    assert cli.main(["--models", "tiny", *bad]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_an_unknown_name_is_one_config_error_line():
    with pytest.raises(ConfigError) as err:
        roofline.machine_named("H1OO")
    assert str(err.value).startswith("--roofline='H1OO' is not a GPU")
    assert "\n" not in str(err.value)
