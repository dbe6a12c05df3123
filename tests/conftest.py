"""Shared fixtures and helpers: seeded tiny random models (no download), the embedded default pair,
Hydra composition of the tuner's config, and a tmp working directory for studies."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from decoding.models import LoadedModel, ModelPair, early_exit_draft, load_model, load_pair
from tests.helpers.work_units import group_by_shared_fixtures, slow_units_first

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}   # tuner subprocesses
# tests measure bookkeeping, not speed, and several of them run workers side by side on 2 cores:
# contention is reported (warn), never waited for, and sampled for 0.1 s before each pair, not
# 0.3 s (a third of the sleeping: 53 s of the 176 s that test_study, test_tuner and test_readme
# took on two workers went to 0.3 s samples)
SIDE_BY_SIDE = ["contention=warn", "contention_window_s=0.1",
                "bound_slack=1"]   # beside another worker a 1.00-per-step trial read 1.36x twice:
#                                    the physical bound is tested in test_bounds.py, not here
# a fast tuner study on the tiny models
FAST = ["method=speculative", "models=tiny", "task.n_prompts=2", "task.n_held_out=2",
        "task.max_new_tokens=6", "warmup_prompts=1", *SIDE_BY_SIDE]
# `make test` runs the tests marked `parallel` on two pytest-xdist workers, each pinned to a CPU of
# its own (its torch, its subprocesses and the CPUs its studies sample for contention: that one),
# then the rest one at a time. The parallel tests are those bound by one core: in-process tests on
# the tiny models (one core's Python: 211 -> 134 s for test_methods' law tests on two workers),
# studies, CLI runs and scripts on them (one core's Python and imports; some wait on locks), the
# default model (memory-bound: 40 tokens took 4.5 s at two threads alone, 5.1 and 5.4 s at one
# thread each in two processes pinned side by side; its greedy tests pass at one thread) and vLLM
# (a server's start is three processes importing vLLM one after another, ~50 s on one CPU), and
# llama.cpp's own tests (263 s pinned to one CPU beside a matmul loop on the other, ~185 s alone:
# one worker's share of that is less than the whole). The README's llama.cpp example (`alone`), services, Slurm fleets, timing and hygiene
# checks use both cores or the whole machine: they run alone.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
PARALLEL_MODULES = {"test_methods", "test_phrases", "test_verify", "test_trees", "test_mjsd",
                    "test_eagle3", "test_eagle", "test_prompt_lookup", "test_sampling",
                    "test_layout", "test_levels", "test_record", "test_train_eagle",
                    "test_reserved_cache", "test_study", "test_tuner", "test_gpu_kit",
                    "test_readme", "test_validate", "test_profile", "test_quality", "test_tasks",
                    "test_models", "test_decode_phase", "test_prompts", "test_imports",
                    "test_report", "test_server_groups", "test_real_model", "test_compiled",
                    "test_vllm", "test_work_units", "test_engines", "test_pruner",
                    "test_search_cost", "test_outcome", "test_compat_pre53", "test_figures",
                    "test_capabilities", "test_racing", "test_watch", "test_union",
                    "test_cross_ranking", "test_across"}
SERIAL_FIXTURES = {"mlflow_url"}    # one server per session


def pin_worker(worker: str) -> None:
    """Pin an xdist worker (``gw<i>``) to the i-th of the CPUs it may use (where the OS can)."""
    from tuner.measure.hygiene import allowed_cpus
    cpus = allowed_cpus()
    if len(cpus) > 1 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpus[int(worker.removeprefix("gw")) % len(cpus)]})


if XDIST_WORKER:
    pin_worker(XDIST_WORKER)
torch.set_num_threads(1 if XDIST_WORKER else 2)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark ``parallel`` the tests of PARALLEL_MODULES that are not ``alone`` and use none of
    SERIAL_FIXTURES, and give the parallel pass its work units (``--dist loadgroup``,
    tests/helpers/work_units.py): a test that uses a module-scoped fixture runs on the worker
    that holds its module's fixture; any other test is a unit of its own. The slow units (vLLM
    and llama.cpp servers, the default model) go first, so the two workers end together."""
    for item in items:
        if (item.path.stem in PARALLEL_MODULES
                and item.get_closest_marker("alone") is None
                and not SERIAL_FIXTURES & set(item.fixturenames)):
            item.add_marker(pytest.mark.parallel)
            group_by_shared_fixtures(item)
    slow_units_first(items, ("test_vllm", "test_engines"), ("real_model", "slow"))


def compose_cfg(tmp_path: Path | None, *overrides: str, base: tuple[str, ...] | None = None):
    """The tuner's config as ``python -m tuner +task=gsm8k <FAST> study_name=t <overrides>``
    would compose it (``base`` replaces the FAST defaults); studies/ and mlruns/ are relative
    paths, so every test runs in its own tmp_path (the ``in_tmp`` fixture)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    GlobalHydra.instance().clear()
    defaults = ["+task=gsm8k", *FAST, "study_name=t"] if base is None else list(base)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*defaults, *overrides], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def run_study(tmp_path: Path, *overrides: str, timer=None):
    """``tuner.run.run`` in process on ``compose_cfg(tmp_path, *overrides)``."""
    from tuner.measure.timing import time_generation
    from tuner.run import run
    return run(compose_cfg(tmp_path, *overrides), timer or time_generation)


def load_study(tmp_path: Path, name: str = "t"):
    import optuna
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(tmp_path / "studies" / f"{name}.journal")))
    return optuna.load_study(study_name=name, storage=storage)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the test in its own empty working directory (studies/, mlruns/ land there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def tiny_profile(tmp_path):
    """A hardware profile of the tiny pair on a small grid, one round (``python -m
    tuner.profile``; a few seconds)."""
    from tuner import profile as cli
    path = tmp_path / "tiny.json"
    assert cli.main(["--models", "tiny", "--repeats", "1", "--contexts", "8", "128",
                     "--rows", "1", "4", "8", "--draft-rows", "1", "2", "--out", str(path)]) == 0
    return path


def tiny_pair(kind: str, **target_opts) -> ModelPair:
    """Tiny fp32 pairs: ``same`` (draft is the target), ``unrelated`` (another seed),
    ``related`` (the target's first layer: partial agreement)."""
    target = load_model({"kind": "tiny", "seed": 0, **target_opts})
    if kind == "same":
        draft = target.model
    elif kind == "unrelated":
        draft = load_model({"kind": "tiny", "seed": 1, **target_opts}).model
    elif kind == "related":
        draft = early_exit_draft(target.model, 1)
    else:
        raise ValueError(kind)
    return ModelPair(target.model, draft, None, target.name, kind)


def vanilla(pair: ModelPair, prompt, max_new_tokens: int, **kw) -> tuple[int, ...]:
    """The reference: vanilla decoding's tokens (every lossless method must equal them at T=0)."""
    from decoding import build_method, generate
    return generate(build_method("vanilla", pair, **kw), prompt, max_new_tokens).tokens


@pytest.fixture(scope="session")
def tiny_pairs() -> dict[str, ModelPair]:
    return {kind: tiny_pair(kind) for kind in ("same", "unrelated", "related")}


@pytest.fixture(scope="session")
def default_pair() -> ModelPair:
    """The embedded default: SmolLM2-135M-Instruct fp32 + its int8-dynamic self-draft."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_pair("smollm2")


@pytest.fixture(scope="session")
def gsm8k_questions() -> list[str]:
    lines = (ROOT / "data" / "gsm8k" / "test_200.jsonl").read_text().splitlines()
    return [json.loads(line)["question"] for line in lines]


@pytest.fixture(scope="session")
def mlflow_url(tmp_path_factory):
    """One ``mlflow server`` (PostgreSQL backend, 1 worker) per test session: starts in 6-12 s."""
    from tests.helpers.services import require_postgres
    from tuner.tracking import server as mlflow_server
    require_postgres()
    settings = mlflow_server.ServerSettings(
        artifacts_destination=str(tmp_path_factory.mktemp("mlflow") / "artifacts"),
        port=int(os.environ.get("SPECTUNE_TEST_MLFLOW_PORT", "5057")), workers=1)
    url, proc = mlflow_server.ensure_server(settings)
    yield url
    if proc is not None:
        mlflow_server.stop_server(proc)


__all__ = ["LoadedModel", "tiny_pair"]
