"""A task: its prompts (offline by default), how they are rendered, and how outputs are scored.

Built from a plain mapping (a ``conf/task/*.yaml``)::

    name: gsm8k
    task_class: LH                      # Ouroboros B.1: HH (high draft/target homogeneity) or LH
    data: {local: data/gsm8k/test_200.jsonl, hub: {path: openai/gsm8k, name: main, split: test},
           source: auto}                # auto: the shipped file, else the hub; or local / hub
    template: chat                      # see TEMPLATES[name]
    max_new_tokens: 256
    n_prompts: 20                       # tuning prompts
    n_held_out: 20                      # never used by the search; confirms the winner
    split_seed: 0

Records are loaded through ``datasets`` (``json`` builder for the shipped file). The tuning and
held-out prompts are disjoint slices of one seeded shuffle.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from decoding.api import encode_prompt
from tuner.tasks import metrics
from tuner.tasks.prompts import file_sha256, read_prompts

ROOT = Path(__file__).resolve().parents[2]


def task_configs() -> dict[str, dict]:
    """Every ``conf/task/*.yaml`` as plain dicts, by task name (scripts outside Hydra)."""
    return {p.stem: yaml.safe_load(p.read_text())
            for p in sorted((ROOT / "conf" / "task").glob("*.yaml"))}


Messages = tuple[tuple[str, str], ...]   # ((role, content), ...)


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task, with what scoring needs."""

    id: str
    messages: Messages
    item: dict = field(repr=False, compare=False)
    category: str = ""


# --------------------------------------------------------------------------------------------
# Templates: item -> messages


def _gsm8k_shots() -> list[tuple[str, str]]:
    shots = read_json_lines(ROOT / "data/gsm8k/train_8shot.jsonl")
    return [(s["question"], re.sub(r"<<.*?>>", "", s["answer"])) for s in shots]


GSM8K_INSTRUCTION = ("Solve the problem step by step. End with the final answer on its own line "
                     "as '#### <number>'.")


def gsm8k_chat(item: dict) -> Messages:
    return (("user", f"{item['question']}\n{GSM8K_INSTRUCTION}"),)


def gsm8k_8shot(item: dict) -> Messages:
    turns: list[tuple[str, str]] = []
    for question, answer in _gsm8k_shots():
        turns += [("user", f"{question}\n{GSM8K_INSTRUCTION}"), ("assistant", answer)]
    return (*turns, ("user", f"{item['question']}\n{GSM8K_INSTRUCTION}"))


def humaneval_chat(item: dict) -> Messages:
    return (("user", "Complete the following Python function. Reply with the complete function "
                     f"in one ```python code block.\n\n```python\n{item['prompt']}```"),)


def humaneval_completion(item: dict) -> Messages:
    return (("user", item["prompt"]),)


def mbpp_chat(item: dict) -> Messages:
    tests = "\n".join(item["test_list"])
    return (("user", f"You are an expert Python programmer, and here is your task: {item['text']} "
                     f"Your code should pass these tests:\n\n{tests}\n\nReply with the code in one "
                     "```python code block."),)


def cnndm_chat(item: dict) -> Messages:
    return (("user", f"Summarize the following news article in three sentences.\n\n"
                     f"Article: {item['article']}"),)


def wmt16_chat(item: dict) -> Messages:
    return (("user", f"Translate German to English: {item['translation']['de']}"),)


def first_turn(item: dict) -> Messages:
    return (("user", item["turns"][0]),)


def messages(item: dict) -> Messages:
    """A user's prompt as read by ``tuner.tasks.prompts`` (ends with the turn to answer)."""
    return tuple((role, content) for role, content in item["messages"])


TEMPLATES: dict[str, Callable[[dict], Messages]] = {
    "gsm8k_chat": gsm8k_chat, "gsm8k_8shot": gsm8k_8shot, "humaneval_chat": humaneval_chat,
    "humaneval_completion": humaneval_completion, "mbpp_chat": mbpp_chat,
    "cnndm_chat": cnndm_chat, "wmt16_chat": wmt16_chat, "first_turn": first_turn,
    "messages": messages,
}


# --------------------------------------------------------------------------------------------
# Metrics: (prompts, completions) -> {metric: value}; per-prompt scores for the tuner


def _score_gsm8k(prompts, completions):
    correct = [metrics.gsm8k_correct(c, p.item["answer"]) for p, c in zip(prompts, completions)]
    return {"accuracy": sum(correct) / len(correct)}, [float(x) for x in correct]


def _score_code(program: Callable[[dict, str], str]):
    def score(prompts, completions):
        passed = [metrics.passes(program(p.item, c)) for p, c in zip(prompts, completions)]
        return {"pass@1": sum(passed) / len(passed)}, [float(x) for x in passed]
    return score


def _score_rouge(prompts, completions):
    return metrics.rouge(completions, [p.item["highlights"] for p in prompts]), None


def _score_bleu(prompts, completions):
    refs = [p.item["translation"]["en"] for p in prompts]
    return {"bleu": metrics.bleu(completions, refs)}, None


def _speed_only(prompts, completions):
    return {}, None


METRICS = {"gsm8k_exact_match": _score_gsm8k, "humaneval_pass_at_1":
           _score_code(metrics.humaneval_program), "mbpp_pass_at_1":
           _score_code(metrics.mbpp_program), "rouge": _score_rouge, "bleu": _score_bleu,
           "none": _speed_only}


# --------------------------------------------------------------------------------------------


def data_path(local: str) -> Path:
    """Where ``data.local`` points: an absolute path; else relative to the working directory
    when the file is there (a user's own file), else to the repository (the shipped files)."""
    path = Path(local).expanduser()
    if path.is_absolute() or path.is_file():
        return path.resolve()
    return ROOT / local


def read_json_lines(path: Path) -> list[dict]:
    """A JSON Lines file's records (or one JSON array of them), every record with every key of
    the file (absent: None), as ``datasets``' json loader gives them, but with each value as the
    file writes it. The tuner refuses a malformed file before this runs
    (``tuner.config.task.check_data_file``: one line naming the file and line)."""
    text = path.read_text(encoding="utf-8")
    rows = json.loads(text) if text.lstrip().startswith("[") else \
        [json.loads(line) for line in text.splitlines() if line.strip()]
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return [{key: row.get(key) for key in keys} for row in rows]


def load_records(name: str, data: Mapping[str, Any]) -> list[dict]:
    """The task's records: a user's prompt file (``data.format`` set: ``tuner.tasks.prompts``),
    the shipped file (JSON Lines, read here: no ``datasets`` needed), or a hub dataset; the error
    says what was tried."""
    if data.get("format") is not None:
        return read_prompts(data_path(str(data.get("local") or "")), str(data["format"]),
                            f"task.data.local={data.get('local')!r}")
    source = data.get("source", "auto")
    if source not in ("auto", "local", "hub"):
        raise ValueError(f"task {name}: data.source={source!r} is invalid: allowed are auto, "
                         "local, hub")
    tried = []
    local = data.get("local")
    if local and source in ("auto", "local"):
        path = data_path(local)
        if path.is_file():
            return read_json_lines(path)
        tried.append(f"shipped file {path} (missing)")
    hub = data.get("hub")
    if hub and source in ("auto", "hub"):
        try:
            from datasets import disable_progress_bars, load_dataset
            disable_progress_bars()
            return list(load_dataset(hub["path"], hub.get("name"), split=hub.get("split", "test")))
        except Exception as err:   # noqa: BLE001 - any hub failure: report it with the rest
            tried.append(f"hub dataset {hub['path']} ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:160]})")
    raise FileNotFoundError(f"task {name}: no data available; tried: " + "; ".join(tried or
                            ["nothing (data.local and data.hub are both empty)"]))


class Task:
    """Prompts, rendering and scoring for one task config."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.name = str(cfg["name"])
        self.task_class = str(cfg.get("task_class", "LH"))
        if self.task_class not in ("HH", "LH"):
            raise ValueError(f"task {self.name}: task_class={self.task_class!r} is invalid: "
                             "allowed are HH, LH")
        template = cfg.get("template")
        if template not in TEMPLATES:
            raise ValueError(f"task {self.name}: template={template!r} is unknown: allowed are "
                             f"{sorted(TEMPLATES)}")
        metric = cfg.get("metric", "none")
        if metric not in METRICS:
            raise ValueError(f"task {self.name}: metric={metric!r} is unknown: allowed are "
                             f"{sorted(METRICS)}")
        self.render, self.metric = TEMPLATES[template], METRICS[metric]
        self.max_new_tokens = int(cfg["max_new_tokens"])
        self.chat = bool(cfg.get("chat", True))
        self.id_field = cfg.get("id_field")
        self.category_field = cfg.get("category_field")
        data = cfg.get("data") or {}
        self.records = load_records(self.name, data)
        # a user's file is identified by its content (its records' ids are line numbers)
        self.data_sha256 = file_sha256(data_path(str(data["local"]))) \
            if data.get("format") is not None else None
        order = list(range(len(self.records)))
        random.Random(cfg.get("split_seed", 0)).shuffle(order)
        categories = cfg.get("categories")
        if categories:                  # e.g. Spec-Bench's summarization items only
            if not self.category_field:
                raise ValueError(f"task {self.name}: categories={list(categories)} needs a task "
                                 "with category_field (specbench, mtbench)")
            found = {str(r[self.category_field]) for r in self.records}
            unknown = sorted(set(categories) - found)
            if unknown:
                raise ValueError(f"task {self.name}: categories={list(categories)}: "
                                 f"{unknown} are not categories of it: allowed are "
                                 f"{sorted(found)}")
            order = [i for i in order
                     if str(self.records[i][self.category_field]) in categories]
        self.order = order

    def _prompt(self, index: int) -> Prompt:
        item = self.records[index]
        pid = str(item[self.id_field]) if self.id_field else str(index)
        category = str(item[self.category_field]) if self.category_field else ""
        return Prompt(id=pid, messages=self.render(item), item=item, category=category)

    def split(self, n_tuning: int, n_held_out: int) -> tuple[list[Prompt], list[Prompt]]:
        """Disjoint tuning and held-out prompts (held-out = the end of the seeded shuffle)."""
        if n_tuning < 1 or n_held_out < 0 or n_tuning + n_held_out > len(self.order):
            raise ValueError(f"task {self.name}: n_prompts={n_tuning} and n_held_out={n_held_out}"
                             f" do not fit its {len(self.order)} prompts (need n_prompts >= 1 "
                             "and n_prompts + n_held_out <= the total)")
        held = self.order[len(self.order) - n_held_out:] if n_held_out else []
        return [self._prompt(i) for i in self.order[:n_tuning]], [self._prompt(i) for i in held]

    def encode(self, prompt: Prompt, tokenizer: Any, answer: str | None = None) -> list[int]:
        """Token ids (``decoding.api.encode_prompt``): the tokenizer's chat template when it has
        one, else plain text.

        ``answer``: appended as the assistant's turn (training text, e.g. an EAGLE head's);
        None: the prompt ends with the generation prompt, as the tuner feeds it.
        """
        messages = [{"role": r, "content": c} for r, c in prompt.messages]
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
        return encode_prompt(tokenizer, messages, self.chat, add_generation_prompt=answer is None)

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str]
              ) -> tuple[dict[str, float], list[float] | None]:
        """Task metrics over the outputs, and per-prompt scores where the metric has them."""
        if not prompts:
            return {}, None
        return self.metric(prompts, completions)
