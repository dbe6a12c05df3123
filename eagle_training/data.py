"""Training text for an EAGLE head: the tasks this repo ships, minus every held-out prompt.

Each record of every benchmark task (``conf/task/*.yaml``, but not ``prompts``: a user's own file)
except the task's held-out slice (``Task.split``: the last ``n_held_out`` of its seeded shuffle;
the bench measures on those) becomes one chat: the task's prompt as the user turn and, where the
data has one, the reference answer as the assistant turn (GSM8K worked solution, CNN/DM highlights, HumanEval canonical solution, MBPP code, WMT16
reference translation); MT-bench and Spec-Bench questions have no reference and are used alone.
Records of one task that repeat another task's held-out prompt (Spec-Bench holds GSM8K questions
and CNN/DM articles) are dropped: a record sharing ≥ 3 word 8-grams with a held-out GSM8K question
or CNN/DM article is out.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any


from tuner.tasks.task import Prompt, Task, task_configs

GUARDED = ("gsm8k", "cnndm")          # the bench's tasks: their held-out text must never leak


def benchmark_configs() -> dict[str, dict]:
    """The shipped benchmark tasks (a task reading a user's prompt file, ``data.format`` set,
    is not training text: its file is whatever the user points it at)."""
    return {name: cfg for name, cfg in task_configs().items()
            if (cfg.get("data") or {}).get("format") is None}


@dataclass(frozen=True)
class Corpus:
    """Token sequences to train on and where they came from."""

    sequences: list[list[int]]
    counts: dict[str, int]             # records used per task
    dropped: int                       # records dropped for overlapping held-out text


def reference_answer(task: str, item: dict) -> str | None:
    if task == "gsm8k":
        return re.sub(r"<<.*?>>", "", item["answer"])
    if task == "cnndm":
        return item["highlights"]
    if task == "humaneval":
        return f"```python\n{item['prompt']}{item['canonical_solution']}```"
    if task == "mbpp":
        return f"```python\n{item['code']}\n```"
    if task == "wmt16":
        return item["translation"]["en"]
    return None


def _ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i: i + n]) for i in range(len(words) - n + 1)}


def held_out(cfg: dict) -> tuple[Task, list[Prompt], list[Prompt]]:
    """The task, its training prompts (all but the held-out slice) and its held-out prompts."""
    task = Task(cfg)
    n_held = int(cfg["n_held_out"])
    train, held = task.split(len(task.records) - n_held, n_held)
    return task, train, held


def guard_ngrams(configs: dict[str, dict]) -> set[tuple[str, ...]]:
    grams: set[tuple[str, ...]] = set()
    for name in GUARDED:
        _, _, held = held_out(configs[name])
        for prompt in held:
            grams |= _ngrams(prompt.item.get("question") or prompt.item.get("article") or "")
    return grams


def training_corpus(tokenizer: Any, max_len: int, seed: int = 0) -> Corpus:
    """Every task's training records as token sequences (last ``max_len`` tokens), shuffled."""
    configs = benchmark_configs()
    guard = guard_ngrams(configs)
    sequences, counts, dropped = [], {}, 0
    for name, cfg in configs.items():
        task, train, _ = held_out(cfg)
        counts[name] = 0
        for prompt in train:
            text = " ".join(c for _, c in prompt.messages)
            if len(_ngrams(text) & guard) >= 3:
                dropped += 1
                continue
            ids = task.encode(prompt, tokenizer, reference_answer(name, prompt.item))
            sequences.append(ids[-max_len:])
            counts[name] += 1
    random.Random(seed).shuffle(sequences)
    return Corpus(sequences, counts, dropped)


def held_out_sequences(tokenizer: Any, max_len: int, per_task: int) -> list[list[int]]:
    """The first held-out prompts of the bench's tasks with their references (evaluation only)."""
    configs = benchmark_configs()
    out = []
    for name in GUARDED:
        task, _, held = held_out(configs[name])
        for prompt in held[:per_task]:
            ids = task.encode(prompt, tokenizer, reference_answer(name, prompt.item))
            out.append(ids[-max_len:])
    return out
