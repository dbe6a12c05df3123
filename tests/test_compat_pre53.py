"""Studies made before the change of issue #53 still replay and resume after it.

tests/fixtures/pre53/ holds what the code of commit 12e8f7b wrote for two small studies (its
README.md has the commands): an in-process study (engine=hf, tiny models) and an engine=llamacpp
study (prompt lookup at concurrency levels 1 and 2, a best YAML with a ``deploy:`` block). Each
best YAML replays with ``+best=<study>`` as it prints itself; each journal resumes with the
command that made it and one more trial: the old trials are kept as they were (not measured
again), the grid's remaining point is measured and the study finishes with a best YAML.

A resume compares the settings fingerprint key by key. Two keys describe the machine, not the
settings: ``hardware`` (the CPU's model name) and, for llama.cpp, the sha256 of the llama-server
built for this CPU. On the machine the fixtures were made on nothing differs and the resume is
the plain one (``resume=auto``); elsewhere every other key must still be equal, and the resume
goes on with ``resume=force`` past those two only.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from optuna.trial import TrialState

from tests.conftest import ENV, ROOT, SIDE_BY_SIDE, compose_cfg, load_study
from tests.helpers.services import require_llama_server

pytestmark = pytest.mark.usefixtures("in_tmp")

FIXTURES = ROOT / "tests" / "fixtures" / "pre53"
# the commands that made the fixtures (tests/fixtures/pre53/README.md), less `search.n_trials=2`
HF = ["+task=gsm8k", "method=speculative", "models=tiny", "task.n_prompts=2",
      "task.n_held_out=1", "task.max_new_tokens=6", "warmup_prompts=1", "contention=warn",
      "contention_window_s=0.1", "search=grid", "search.ranges=full",
      "method.space.num_draft_tokens.high=3", "method.params.num_draft_tokens=2",
      "tracking=none", "study_name=pre53-hf"]
LLAMACPP = ["+task=gsm8k", "engine=llamacpp", "models=smollm2", "engine.target_type=match_dtype",
            "engine.self_draft_type=Q4_0", "task.n_prompts=2", "task.n_held_out=1",
            "task.max_new_tokens=24", "warmup_prompts=1", "contention=warn",
            "contention_window_s=0.1", "method=prompt_lookup",
            "~engine.methods.prompt_lookup.space",
            "+engine.methods.prompt_lookup.space={size_n:{type:int,low:1,high:3}}",
            "engine.methods.prompt_lookup.params.size_n=2",
            "engine.methods.prompt_lookup.params.size_m=8", "budget.concurrency=[1,2]",
            "search.objectives=[throughput_ratio]", "search=grid", "search.ranges=full",
            "tracking=none", "study_name=pre53-llamacpp",
            "engine.baseline=plain"]   # the old study's vanilla: the plain server (the matched
                                       # default measures another vanilla, and is refused below)
OLD_TRIALS = 2              # both fixtures: search.n_trials=2 of a 3-point grid


def install(tmp_path: Path, study: str) -> Path:
    """The fixture's journal as ``studies/<study>.journal`` and its best YAML as
    ``studies/best/<study>.yaml`` under ``tmp_path`` (the test's working directory); returns the
    best YAML's path."""
    (tmp_path / "studies" / "best").mkdir(parents=True)
    shutil.copy(FIXTURES / f"{study}.journal", tmp_path / "studies" / f"{study}.journal")
    return Path(shutil.copy(FIXTURES / f"{study}.yaml", tmp_path / "studies" / "best"))


def printed_replay(best: Path) -> list[str]:
    """The arguments of the replay command the best YAML prints in its header."""
    line = next(line for line in best.read_text().splitlines() if "python -m tuner" in line)
    return shlex.split(line.lstrip("# "))[3:]


def frozen(trial) -> tuple:
    return (trial.number, trial.state, trial.params, trial.values, trial.datetime_start,
            trial.datetime_complete, trial.user_attrs)


def resume_mode(tmp_path: Path, stored: dict[str, str], overrides: list[str]) -> str:
    """``auto`` when the current code fingerprints the fixture's command exactly as the old code
    did; ``force`` when only the machine's keys differ (another CPU, another llama-server build)
    or, for llama.cpp at several levels, how a batch is sent (``batch``: one request with its
    prompts since this change, c connections before; ``LlamaCppEngine.identity``); any other
    difference fails."""
    from tuner.config.identity import differences
    from tuner.study.settings import StudySettings
    now = StudySettings.from_config(compose_cfg(tmp_path, *overrides, base=())).fingerprint
    diff = differences(stored, now)
    if "engine" in diff:           # the build's sha256 is the machine's; the rest is settings
        old, new = json.loads(stored["engine"]), json.loads(now["engine"])
        assert "batch" not in old and new.pop("batch") == "one request", (old, new)
        assert old.pop("binary_sha256") != new.pop("binary_sha256") and old == new, (old, new)
        diff.remove("engine")
    assert set(diff) <= {"hardware"}, \
        {k: (stored.get(k), now.get(k)) for k in diff if k != "hardware"}
    return "force" if differences(stored, now) else "auto"


def resume(tmp_path: Path, study: str, overrides: list[str], capsys) -> tuple[dict, str, list]:
    """Resume the fixture's journal with one more trial; the old trials first checked against
    what the old code wrote. Returns the result, what it printed and the old trials."""
    from tuner.measure.timing import time_generation
    from tuner.run import run
    before = load_study(tmp_path, study)
    old = [frozen(t) for t in before.trials]
    assert [t[1] for t in old] == [TrialState.COMPLETE] * OLD_TRIALS
    mode = resume_mode(tmp_path, before.user_attrs["fingerprint"], overrides)
    capsys.readouterr()
    result = run(compose_cfg(tmp_path, *overrides, f"search.n_trials={OLD_TRIALS + 1}",
                             f"resume={mode}", base=()), time_generation)
    out = capsys.readouterr().out
    after = load_study(tmp_path, study)
    assert [frozen(t) for t in after.trials[:OLD_TRIALS]] == old      # kept as they were
    assert len(after.trials) == OLD_TRIALS + 1
    assert after.trials[OLD_TRIALS].state == TrialState.COMPLETE
    measured = re.findall(r"^trial (\d+) \[", out, re.MULTILINE)        # trials started now
    assert measured == [str(OLD_TRIALS)], out[-3000:]
    assert result["study_name"] == study and result["trial"] in range(OLD_TRIALS + 1)
    return result, out, old


# ----------------------------------------------------------------------------------------------
# engine=hf (in process, tiny models)


def test_the_in_process_best_yaml_replays(tmp_path):
    """``python -m tuner +task=gsm8k method=speculative +best=pre53-hf`` as the old best YAML
    prints it: the recorded setting measured against vanilla on the study's own budget."""
    best = install(tmp_path, "pre53-hf")
    (tmp_path / "studies" / "pre53-hf.journal").unlink()         # a replay needs only the YAML
    recorded = yaml.safe_load(best.read_text())
    args = printed_replay(best)
    assert args == ["+task=gsm8k", "method=speculative", "+best=pre53-hf"]
    done = subprocess.run([sys.executable, "-m", "tuner", *args, "tracking=none",
                           *SIDE_BY_SIDE], cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert (f"replay of study pre53-hf trial {recorded['replay']['trial']} (recorded held-out "
            f"speedup {recorded['replay']['held_out_speedup']:.3f}x): "
            f"{recorded['method']['params']}") in out, out[-3000:]
    assert "replay: the study's own budget: 1 held-out prompts x 6 new tokens" in out
    speedup = re.search(r"^replay: held-out speedup ([0-9.]+)x", out, re.MULTILINE)
    assert speedup and float(speedup[1]) > 0, out[-3000:]
    assert not (tmp_path / "studies" / "pre53-hf.journal").exists()   # no study was made


def test_the_in_process_journal_resumes(tmp_path, capsys):
    """The old journal with search.n_trials=3: trials 0 and 1 are kept, the grid's last point
    (num_draft_tokens=3) is measured as trial 2, and a new best YAML is written."""
    install(tmp_path, "pre53-hf")
    (tmp_path / "studies" / "best" / "pre53-hf.yaml").unlink()       # written again by the finish
    result, _out, old = resume(tmp_path, "pre53-hf", HF, capsys)
    assert [t[2] for t in old] == [{"num_draft_tokens": 2}, {"num_draft_tokens": 1}]
    study = load_study(tmp_path, "pre53-hf")
    assert study.trials[OLD_TRIALS].params == {"num_draft_tokens": 3}
    best = yaml.safe_load((tmp_path / "studies" / "best" / "pre53-hf.yaml").read_text())
    assert best["replay"]["study"] == "pre53-hf" and best["replay"]["trial"] == result["trial"]
    assert best["method"]["params"] == study.trials[result["trial"]].params == result["params"]
    assert result["held_out_speedup"] > 0


# ----------------------------------------------------------------------------------------------
# engine=llamacpp (llama-server, the embedded SmolLM2 GGUF re-typed to F32)


def test_the_llamacpp_best_yaml_replays(tmp_path, capsys):
    """The old engine study's best YAML (its deploy block: launch line, request, build) replays
    as it prints itself, at both concurrency levels, losslessly."""
    require_llama_server()
    from tuner.run import run
    best = install(tmp_path, "pre53-llamacpp")
    (tmp_path / "studies" / "pre53-llamacpp.journal").unlink()   # a replay needs only the YAML
    recorded = yaml.safe_load(best.read_text())
    assert {"launch", "request", "build"} <= set(recorded["deploy"])   # the fixture's deploy block
    args = printed_replay(best)
    assert args == ["+task=gsm8k", "method=prompt_lookup", "+best=pre53-llamacpp"]
    capsys.readouterr()
    replayed = run(compose_cfg(tmp_path, *args, "tracking=none", *SIDE_BY_SIDE, base=()))
    out = capsys.readouterr().out
    assert "replay: the study's own budget: 1 held-out prompts x 24 new tokens" in out, out
    assert replayed["params"] == recorded["engine"]["methods"]["prompt_lookup"]["params"]
    assert replayed["held_out_speedup"] > 0
    assert all(replayed[f"held_out_throughput_ratio@c{level}"] > 0 for level in (1, 2))
    assert replayed["held_out_matches_vanilla"] == 1.0                # lossless at T=0
    assert not (tmp_path / "studies" / "pre53-llamacpp.journal").exists()


def recorded_request(tmp_path) -> str:
    return yaml.safe_load((FIXTURES / "pre53-llamacpp.yaml").read_text())["deploy"]["request"]


def test_the_llamacpp_journal_resumes(tmp_path, capsys):
    """The old engine study's journal with search.n_trials=3: trials 0 and 1 are kept, size_n=3
    is measured as trial 2 at both levels, and the new best YAML's deploy block is complete."""
    require_llama_server()
    best = install(tmp_path, "pre53-llamacpp")
    best.unlink()                                                     # written again by the finish
    # the default (matched) baseline is another vanilla: its fingerprint differs from the old one
    from tuner.config.identity import differences
    from tuner.study.settings import StudySettings
    stored = load_study(tmp_path, "pre53-llamacpp").user_attrs["fingerprint"]
    default = StudySettings.from_config(compose_cfg(tmp_path, *LLAMACPP[:-1], base=())).fingerprint
    assert "engine" in differences(stored, default)
    assert json.loads(default["engine"])["baseline"] == "matched"
    result, _out, old = resume(tmp_path, "pre53-llamacpp", LLAMACPP, capsys)
    assert [t[2]["size_n"] for t in old] == [2, 1]
    study = load_study(tmp_path, "pre53-llamacpp")
    assert study.trials[OLD_TRIALS].params["size_n"] == 3
    assert all(study.trials[OLD_TRIALS].user_attrs[f"throughput_ratio@c{level}"] > 0
               for level in (1, 2))
    written = yaml.safe_load(best.read_text())
    assert written["replay"]["study"] == "pre53-llamacpp"
    assert written["replay"]["trial"] == result["trial"]
    launch = written["deploy"]["launch"]
    assert launch.startswith("llama-server -m ") and "-np 2" in launch
    assert f"--spec-ngram-simple-size-n {result['params']['size_n']}" in launch
    # JSON text in the fixture (12e8f7b); the best YAML written on resuming holds a mapping
    assert isinstance(recorded_request(tmp_path), str)
    assert written["deploy"]["request"]["n_predict"] == 24
