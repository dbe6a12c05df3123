"""Shared fixtures: seeded tiny random models (no download) and the embedded default pair."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from decoding.models import LoadedModel, ModelPair, early_exit_draft, load_model, load_pair

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(2)


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
    from tests.services import require_postgres
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
