"""Every ``python -m tuner`` command in the README runs (CPU-runnable ones, shrunk to tiny models
and a tiny budget, MLflow tracking on), so an example cannot crash unnoticed. Commands that need
what this machine may lack are listed with the reason and checked elsewhere."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.conftest import ROOT, compose_cfg
from tests.services import require_llama_server, require_vllm

# what makes a README command small: appended after its own overrides, so these win
TINY = ["models=tiny", "task.n_prompts=1", "task.n_held_out=1", "task.max_new_tokens=4",
        "search.n_trials=2", "warmup_prompts=0", "contention=warn", "budget=full"]
ENGINE = ["models=smollm2", "engine.target_type=native", "task.n_prompts=1",
          "task.n_held_out=1", "task.max_new_tokens=8", "search.n_trials=2", "warmup_prompts=0",
          "contention=warn", "budget=full"]
VLLM = ["models=smollm2", "task.n_prompts=1", "task.n_held_out=1", "task.max_new_tokens=8",
        "search.n_trials=1", "warmup_prompts=0", "contention=warn", "budget=full",
        "engine.kv_cache_gib=1", "engine.ctx_per_slot=1024"]
ELSEWHERE = {   # (fragment of the command, why it is not run here)
    "models=llama_pair": "a hub model pair on a GPU (no hub access here)",
    "yuhuili/": "a hub EAGLE head (no hub access here)",
    "launcher=slurm": "submits Slurm jobs (tests/test_sweep.py runs the launcher)",
    "tracking=server": "needs an MLflow server (tests/test_storage_services.py)",
    "+best=": "replays a finished study (tests/test_readme.py::test_the_printed_replay_runs)",
}


def readme_commands() -> list[list[str]]:
    """The arguments of every ``python -m tuner`` line in the README's bash blocks."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("python -m tuner ") and "--help" not in line:
                commands.append(shlex.split(line, comments=True)[3:])
    return commands


COMMANDS = readme_commands()


def test_the_readme_has_tuner_examples():
    assert len(COMMANDS) >= 10 and any("engine=llamacpp" in c for c in COMMANDS)


@pytest.mark.parametrize("args", COMMANDS, ids=[" ".join(c)[:70] for c in COMMANDS])
def test_a_readme_example_runs(tmp_path, monkeypatch, args):
    line = " ".join(args)
    reason = next((why for part, why in ELSEWHERE.items() if part in line), None)
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    small = ENGINE if "engine=llamacpp" in args else VLLM if "engine=vllm" in args else TINY
    if "+task=cnndm" in args:   # its articles overflow the tiny model's byte-level 4096 positions
        small = [o for o in small if o != "models=tiny"]
    if "engine=llamacpp" in args:
        require_llama_server()
    if "engine=vllm" in args:
        require_vllm()
    from tuner.run import run
    result = run(compose_cfg(tmp_path, *args, *small, "tracking.experiment=readme", base=()))
    assert result.get("study_name")
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["readme"], output_format="list")
    assert runs and all(r.info.status == "FINISHED" for r in runs)


def test_the_printed_replay_runs(tmp_path, monkeypatch, capsys):
    """A tiny study's best YAML replays as printed (its models, sampling and budget), and the
    replay says it measures with the study's own budget."""
    monkeypatch.chdir(tmp_path)
    from tuner.run import run
    study = [*TINY, "task.max_new_tokens=6", "search=grid", "search.ranges=full",
             "method=speculative", "method.space.num_draft_tokens.high=2",
             "method.params.num_draft_tokens=2", "tracking=none", "study_name=r"]
    run(compose_cfg(tmp_path, "+task=gsm8k", *study, base=()))
    best = (tmp_path / "studies" / "best" / "r.yaml").read_text()
    printed = next(line for line in best.splitlines() if "python -m tuner" in line)
    args = shlex.split(printed.lstrip("# "))[3:]
    capsys.readouterr()
    result = run(compose_cfg(tmp_path, *args, "tracking=none", "contention=warn", base=()))
    out = capsys.readouterr().out
    assert "replay: the study's own budget: 1 held-out prompts x 6 new tokens" in out
    assert result["held_out_prompts"] == 1 and result["params"]["num_draft_tokens"] in (1, 2)
