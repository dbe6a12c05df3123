"""bench/profile_loops.py runs and writes its table (small, on tiny models; no timing assertions:
its figures live in docs/performance.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import profile_loops  # noqa: E402


def test_the_profile_script_writes_one_row_per_method(tmp_path):
    methods = ["vanilla", "speculative", "eagle", "eagle3", "prompt_lookup"]
    profile_loops.main(["--models", "tiny", "--prompts", "2", "--max-new-tokens", "12",
                        "--methods", *methods, "--threads", "1",
                        "--out", str(tmp_path / "t.md"), "--json", str(tmp_path / "t.json")])
    rows = {r["method"]: r for r in json.loads((tmp_path / "t.json").read_text())}
    assert list(rows) == methods
    table = (tmp_path / "t.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in table if line.startswith("| ")][1:] == methods
    for row in rows.values():
        assert 0.0 < row["outside_share"] < 1.0
        assert row["aten_outside_us_per_step"] > 0 and row["host_syncs_per_step"] >= 0
    # the hooks count outermost forwards: vanilla makes exactly one target forward per token, a
    # draft model's γ forwards come on top of the target's, prompt lookup drafts without a model
    assert rows["vanilla"]["forwards_per_step"] == 1.0
    assert rows["vanilla"]["steps_per_generation"] == 12
    assert rows["speculative"]["forwards_per_step"] > 2.0
    assert rows["prompt_lookup"]["forwards_per_step"] == 1.0
    assert rows["eagle"]["forwards_per_step"] > 2.0             # the head's forwards and LM head
    assert rows["eagle3"]["forwards_per_step"] > 2.0


def test_nested_forwards_are_counted_once():
    import torch

    inner = torch.nn.Linear(3, 3)
    outer = torch.nn.Sequential(inner, torch.nn.ReLU())
    hooks = profile_loops.ForwardHooks()
    hooks.attach([outer, inner, inner])
    outer(torch.ones(1, 3))
    inner(torch.ones(1, 3))
    hooks.detach()
    outer(torch.ones(1, 3))
    assert hooks.calls == 2 and hooks.seconds > 0


@pytest.mark.parametrize("bad", [["--methods", "warp"], ["--models", "huge"]])
def test_bad_arguments_are_named(bad, capsys):
    with pytest.raises(SystemExit):
        profile_loops.main(bad)
    assert "invalid choice" in capsys.readouterr().err
