"""Tasks: offline loading, templates, metrics on known inputs, and the code sandbox."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import yaml

from tuner.tasks import metrics
from tuner.tasks.sandbox import Limits, run_program
from tuner.tasks.task import Task, load_records

CONF = Path(__file__).resolve().parents[1] / "conf" / "task"
EXPECTED = {"gsm8k": 200, "humaneval": 164, "mbpp": 90, "cnndm": 100, "wmt16": 100,
            "mtbench": 80, "specbench": 480, "prompts": 40}


def task_cfg(name: str) -> dict:
    return yaml.safe_load((CONF / f"{name}.yaml").read_text())


@pytest.fixture(scope="module")
def tasks() -> dict[str, Task]:
    return {name: Task(task_cfg(name)) for name in EXPECTED}


def test_every_task_config_is_covered():
    assert sorted(p.stem for p in CONF.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_task_loads_offline_with_expected_count(tasks, name):
    task = tasks[name]
    assert len(task.records) == EXPECTED[name]
    tuning, held_out = task.split(task_cfg(name)["n_prompts"], task_cfg(name)["n_held_out"])
    assert len(tuning) == task_cfg(name)["n_prompts"] and held_out
    assert not {p.id for p in tuning} & {p.id for p in held_out}, "splits must be disjoint"
    again, _ = Task(task_cfg(name)).split(len(tuning), len(held_out))
    assert [p.id for p in again] == [p.id for p in tuning], "the split is seeded"


@pytest.mark.real_model
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_templates_render_with_the_default_tokenizer(tasks, default_pair, name):
    task = tasks[name]
    prompt = task.split(1, 0)[0][0]
    ids = task.encode(prompt, default_pair.tokenizer)
    text = default_pair.tokenizer.decode(ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    assert prompt.messages[-1][1][:40] in text


def test_specbench_prompts_carry_categories(tasks):
    categories = {p.category for p in tasks["specbench"].split(480, 0)[0]}
    assert {"translation", "summarization", "qa", "math_reasoning", "rag", "writing"} <= categories


def test_gsm8k_8shot_template_has_eight_exemplars():
    task = Task({**task_cfg("gsm8k"), "template": "gsm8k_8shot"})
    messages = task.split(1, 0)[0][0].messages
    assert [r for r, _ in messages] == ["user", "assistant"] * 8 + ["user"]
    assert "<<" not in messages[1][1] and "####" in messages[1][1]


def test_bad_task_settings_and_missing_data_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"template='nope' is unknown: allowed are"):
        Task({**task_cfg("gsm8k"), "template": "nope"})
    with pytest.raises(ValueError, match="task_class='XX' is invalid: allowed are HH, LH"):
        Task({**task_cfg("gsm8k"), "task_class": "XX"})
    with pytest.raises(FileNotFoundError, match=r"task gsm8k: no data available; tried: shipped "
                                                r"file .*missing\.jsonl \(missing\)"):
        load_records("gsm8k", {"local": str(tmp_path / "missing.jsonl"), "source": "local"})
    task = Task(task_cfg("wmt16"))
    with pytest.raises(ValueError, match="n_prompts=90 and n_held_out=20 do not fit its 100"):
        task.split(90, 20)


# ----------------------------------------------------------------------------------------------
# Metrics on known inputs


@pytest.mark.parametrize("text,expected", [
    ("She sold 48 + 24 = 72 clips.\n#### 72", 72.0),
    ("#### 1,234", 1234.0),
    ("The answer is $18.", 18.0),
    ("Step 1: 3 apples, step 2: 5 pears. #### -4", -4.0),
    ("In 2021 there were 12 cats; 3 left, so 9 remain.", 9.0),
    ("no number here", None),
])
def test_gsm8k_extractor(text, expected):
    assert metrics.extract_gsm8k_answer(text) == expected


def test_gsm8k_exact_match_ignores_distractors():
    reference = "48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert metrics.gsm8k_correct("In April 48, in May 24, so 72 in total.\n#### 72", reference)
    assert not metrics.gsm8k_correct("#### 72 is wrong; #### 71", reference)
    assert not metrics.gsm8k_correct("I sold 72 clips? Not sure. #### 70", reference)


def test_bleu_and_rouge_of_identical_text():
    refs = ["The cat sat on the mat .", "Obama receives Netanyahu in Washington ."]
    assert metrics.bleu(refs, refs) == pytest.approx(100.0)
    assert metrics.bleu(["completely different words here"], refs[:1]) < 10
    scores = metrics.rouge(refs, refs)
    assert scores == {"rouge1": pytest.approx(1.0), "rouge2": pytest.approx(1.0),
                      "rougeL": pytest.approx(1.0)}


def test_canonical_solutions_pass_and_wrong_ones_fail(tasks):
    humaneval = tasks["humaneval"].records[::16]           # 11 problems across the set
    assert all(metrics.passes(metrics.humaneval_program(p, p["canonical_solution"]))
               for p in humaneval)
    wrong = "    return None\n"
    assert not any(metrics.passes(metrics.humaneval_program(p, wrong)) for p in humaneval[:3])
    whole = f"```python\n{humaneval[0]['prompt']}{humaneval[0]['canonical_solution']}```"
    assert metrics.passes(metrics.humaneval_program(humaneval[0], whole))
    mbpp = tasks["mbpp"].records[::9]                      # 10 problems
    assert all(metrics.passes(metrics.mbpp_program(p, p["code"])) for p in mbpp)
    assert not metrics.passes(metrics.mbpp_program(mbpp[0], "def f():\n    return 0\n"))


def test_pass_at_1_through_the_task_scorer(tasks):
    task = tasks["mbpp"]
    prompts, _ = task.split(4, 0)
    completions = [f"```python\n{p.item['code']}\n```" for p in prompts[:3]] + ["pass"]
    summary, per_prompt = task.score(prompts, completions)
    assert summary == {"pass@1": 0.75} and per_prompt == [1.0, 1.0, 1.0, 0.0]


# ----------------------------------------------------------------------------------------------
# The sandbox


@pytest.mark.parametrize("program,reason", [
    ("while True:\n    pass\n", "timeout"),
    ("import os\nwhile True:\n    os.fork()\n", "os.fork is not allowed"),
    ("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\n", "not allowed"),
    ("x = bytearray(8 << 30)\n", "MemoryError"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\n", "not allowed"),
    ("open('/tmp/spectune-escape.txt', 'w').write('x')\n", "outside the sandbox"),
    ("import os\nos.remove(os.path.expanduser('~/.bashrc'))\n", "outside the sandbox"),
    ("import ctypes\nctypes.CDLL(None).system(b'true')\n", "not allowed"),
])
def test_sandbox_contains_hostile_code(program, reason, tmp_path, monkeypatch):
    # the sandbox's folder in this test's own temporary directory, not the machine's /tmp, where
    # other processes (the other test worker's humaneval studies) make and remove theirs
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    outcome = run_program(program, Limits(timeout_s=2.0))
    assert not outcome.passed and reason in outcome.reason
    assert not os.path.exists("/tmp/spectune-escape.txt")
    assert list(tmp_path.iterdir()) == []                 # nothing left behind


def test_sandbox_allows_ordinary_code_and_its_own_files():
    program = "open('scratch.txt', 'w').write('ok')\nassert open('scratch.txt').read() == 'ok'\n"
    assert run_program(program).passed
    assert run_program("import math\nassert math.factorial(5) == 120\n").passed


# moved from tests/test_study.py (its small correctness fixes)
def test_the_sandbox_fails_a_program_that_exits_early():
    from tuner.tasks.sandbox import run_program
    assert run_program("assert 1 + 1 == 2").passed
    assert not run_program("import sys\nsys.exit(0)\nassert 1 + 1 == 3").passed
    assert not run_program("import os\nos._exit(0)\nassert 1 + 1 == 3").passed
