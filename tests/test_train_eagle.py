"""``python -m eagle_training`` on a tiny target for a few steps: the loss falls, the checkpoint
loads through the EAGLE loader and decodes losslessly; the training text keeps the held-out split."""

from __future__ import annotations

import json

from decoding import build_method, generate
from tests.conftest import tiny_pair
from eagle_training.data import _ngrams, guard_ngrams, held_out, task_configs, training_corpus
from eagle_training.train import main


def test_a_few_steps_lower_the_loss_and_write_a_loadable_head(tmp_path):
    out = tmp_path / "head"
    record = main(["--models", "tiny", "--steps", "30", "--max-len", "48", "--max-sequences",
                   "24", "--held-out", "1", "--lr", "3e-3", "--out", str(out)])
    history = json.loads((out / "history.json").read_text())
    first = sum(h["loss"] for h in history[:5]) / 5
    last = sum(h["loss"] for h in history[-5:]) / 5
    assert record["steps"] == 30 and last < 0.9 * first, (first, last)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["spectune"]["steps"] == 30
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()
    pair = tiny_pair("related")                  # the same seeded tiny target as --models tiny
    method = build_method("eagle", pair, head=str(out))
    vanilla = generate(build_method("vanilla", pair), [3, 4, 5, 6], 16).tokens
    assert generate(method, [3, 4, 5, 6], 16).tokens == vanilla


class Bytes:
    chat_template = None

    def __call__(self, text):
        return {"input_ids": list(text.encode())}


def test_training_text_never_holds_a_held_out_bench_prompt():
    configs = task_configs()
    corpus = training_corpus(Bytes(), max_len=10 ** 6)
    held = {p.id for name in ("gsm8k", "cnndm") for p in held_out(configs[name])[2]}
    trained = {p.id for name in ("gsm8k", "cnndm") for p in held_out(configs[name])[1]}
    assert held and trained          # both slices non-empty; the split itself: tests/test_tasks.py
    guard = guard_ngrams(configs)
    texts = [bytes(ids).decode(errors="ignore") for ids in corpus.sequences]
    assert not [t for t in texts if len(_ngrams(t) & guard) >= 3]
    assert corpus.dropped > 0 and sum(corpus.counts.values()) == len(corpus.sequences)
