"""Checks that need an NVIDIA GPU (marked ``gpu``; deselected by default: ``pytest -m gpu``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from decoding import build_method, generate
from decoding.clock import PhaseClock
from decoding.models import ModelPair, early_exit_draft, load_model
from tuner.measure.energy import EnergyMeter

pytestmark = pytest.mark.gpu
CONF = Path(__file__).resolve().parents[1] / "conf" / "method"
LOSSLESS = sorted(p.stem for p in CONF.glob("*.yaml")
                  if p.stem != "vanilla" and yaml.safe_load(p.read_text()).get("lossless"))


@pytest.fixture(scope="module")
def cuda_pair():
    if not torch.cuda.is_available():
        pytest.fail("marked gpu but no CUDA device is available")
    target = load_model({"kind": "tiny", "seed": 0, "num_hidden_layers": 4,
                         "device": "cuda"}).model
    return ModelPair(target, early_exit_draft(target, 2), None, "tiny-cuda", "early-exit-2")


@pytest.mark.parametrize("name", LOSSLESS)
def test_greedy_equals_vanilla_on_cuda(cuda_pair, name):
    reference = generate(build_method("vanilla", cuda_pair), list(range(5, 30)), 48).tokens
    assert generate(build_method(name, cuda_pair), list(range(5, 30)), 48).tokens == reference


def test_phase_clock_uses_events_and_syncs_once(cuda_pair, monkeypatch):
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (calls.append(1), real(*a)))
    clock = PhaseClock("cuda")
    steps = list(build_method("speculative", cuda_pair).stream(torch.arange(5, 30), 48, clock))
    assert calls == [] and steps
    totals = clock.totals()
    assert calls == [1] and totals["draft"] > 0 and totals["verify"] > 0


def test_nvml_energy_counter_reads_positive_joules(cuda_pair):
    meter = EnergyMeter()
    assert meter.available, meter.reason
    with meter:
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(200):
            x = x @ x
            x = x / x.norm()
        torch.cuda.synchronize()
    assert meter.reading.joules and meter.reading.joules > 0
