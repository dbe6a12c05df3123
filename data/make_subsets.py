"""Regenerate the shipped task data from the full upstream files (deterministic, seed recorded).

    python data/make_subsets.py --source ../shared/data

Protocol of the Ouroboros paper: 100 random GSM8K test items (200 shipped: 100 more are the
held-out confirmation set), 100 CNN/DM, 100 WMT16 de→en; all
164 HumanEval; the MBPP validation split (task ids 511–600, 90 items) plus its prompt split (1–10,
few-shot exemplars); the first 8 GSM8K train items as 8-shot exemplars; MT-bench and Spec-Bench whole.
Random subsets use ``random.Random(SEED).sample`` over the file's line order; each item keeps its
upstream index so it can be traced back.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

SEED = 20240229
HERE = Path(__file__).resolve().parent


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")


def sample(rows: list[dict], k: int, salt: str) -> list[dict]:
    indices = random.Random(f"{SEED}-{salt}").sample(range(len(rows)), k)
    return [{"upstream_index": i, **rows[i]} for i in indices]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", type=Path, required=True)
    src = parser.parse_args().source
    gsm8k = read_jsonl(src / "gsm8k/test.jsonl")   # 100 to tune on (the paper's count) + 100 held out
    write_jsonl(HERE / "gsm8k" / "test_200.jsonl", sample(gsm8k, 200, "gsm8k"))
    write_jsonl(HERE / "gsm8k" / "train_8shot.jsonl", read_jsonl(src / "gsm8k/train.jsonl")[:8])
    mbpp = read_jsonl(src / "mbpp/mbpp.jsonl")
    write_jsonl(HERE / "mbpp" / "validation.jsonl", [r for r in mbpp if 511 <= r["task_id"] <= 600])
    write_jsonl(HERE / "mbpp" / "prompt.jsonl", [r for r in mbpp if 1 <= r["task_id"] <= 10])
    write_jsonl(HERE / "cnndm" / "test_100.jsonl", sample(
        read_jsonl(src / "cnn_dailymail/test_see2017_tokenized_first1000.jsonl"), 100, "cnndm"))
    write_jsonl(HERE / "wmt16" / "test_100.jsonl", sample(read_jsonl(src / "wmt16_de_en/test.jsonl"), 100, "wmt16"))
    for folder, name, file in [("humaneval", "humaneval", "HumanEval.jsonl"),    # byte-for-byte
                               ("mtbench", "mt_bench", "question.jsonl"),
                               ("specbench", "spec_bench", "question.jsonl")]:
        shutil.copy(src / name / file, HERE / folder / file)
    for folder, name in [("gsm8k", "gsm8k"), ("humaneval", "humaneval"), ("mtbench", "mt_bench"),
                         ("specbench", "spec_bench")]:
        shutil.copy(src / name / "LICENSE.txt", HERE / folder / "LICENSE.txt")


if __name__ == "__main__":
    main()
