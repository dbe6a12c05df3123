"""Benchmark: vanilla, speculative, lookahead, Ouroboros and the Ouroboros ablation ladder.

    python bench/phrase_methods.py [--prompts 5] [--max-new-tokens 64]

On GSM8K prompts with the embedded default pair (SmolLM2-135M fp32 target, int8 self-draft),
greedy, at the paper's GSM8K settings (Ouroboros Table 11, Yi-34B/6B row): speculative γ=7;
lookahead W=15, N=6 (G=W); Ouroboros γ=4, W=15, β=7, K=3 — plus Table 4's ladder: speculative
baseline → + accelerating drafting via phrases → + lengthening drafts → + phrases from
verification → + history reuse. All configurations run side by side in one process, interleaved
per prompt (each method object keeps its state across prompts, so history reuse is real), after one
untimed warm-up prompt (pools reset afterwards). Reported: tokens/s, the ratio to vanilla, mean
accepted tokens per target forward (block efficiency, bonus included), draft forwards per token,
and whether every output equals vanilla's.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
import transformers

from decoding import build_method, encode_prompt, generate, load_pair

ROOT = Path(__file__).resolve().parents[1]
OURO = dict(num_draft_tokens=4, window=15, phrase_length=7, num_phrases=3)
OFF = dict(draft_lookahead=False, lengthen_drafts=False, verification_phrases=False,
           reuse_history=False)
CONFIGS = [
    ("vanilla", "vanilla", {}),
    ("speculative γ=7", "speculative", {"num_draft_tokens": 7}),
    ("lookahead W=15 N=6", "lookahead", {"window": 15, "ngram": 6, "guess_set": 15}),
    ("ouroboros γ=4 W=15 β=7 K=3", "ouroboros", OURO),
    ("ladder 0: speculative γ=4", "ouroboros", {**OURO, **OFF}),
    ("ladder 1: + phrase drafting", "ouroboros", {**OURO, **OFF, "draft_lookahead": True}),
    ("ladder 2: + lengthening", "ouroboros", {**OURO, **OFF, "draft_lookahead": True,
                                               "lengthen_drafts": True}),
    ("ladder 3: + verification phrases", "ouroboros", {**OURO, "reuse_history": False}),
    ("ladder 4: + history (= full)", "ouroboros", OURO),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    pair = load_pair("smollm2")
    lines = (ROOT / "data" / "gsm8k" / "test_200.jsonl").read_text().splitlines()
    questions = [json.loads(line)["question"] for line in lines[: args.prompts + 1]]
    prompts = [encode_prompt(pair.tokenizer, q) for q in questions]
    warmup, prompts = prompts[0], prompts[1:]
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; {pair.target_name} + {pair.draft_name}; "
          f"{len(prompts)} GSM8K prompts, {args.max_new_tokens} new tokens, greedy", flush=True)
    methods = []
    for label, name, kw in CONFIGS:
        method = build_method(name, pair, **kw)
        generate(method, warmup, 16)
        if hasattr(method, "reset"):
            method.reset()
        methods.append((label, method))
    totals = {label: {"tokens": 0, "seconds": 0.0, "steps": 0, "draft": 0, "same": 0}
              for label, _ in methods}
    for prompt in prompts:
        reference = None
        for label, method in methods:
            began = time.perf_counter()
            out = generate(method, prompt, args.max_new_tokens)
            row = totals[label]
            row["seconds"] += time.perf_counter() - began
            row["tokens"] += out.stats.new_tokens
            row["steps"] += out.stats.steps
            row["draft"] += out.stats.draft_forwards
            reference = out.tokens if reference is None else reference
            row["same"] += out.tokens == reference
    base = totals["vanilla"]["tokens"] / totals["vanilla"]["seconds"]
    print(f"{'configuration':<34} {'tok/s':>7} {'vs vanilla':>10} {'tokens/target fwd':>18} "
          f"{'draft fwd/token':>16} {'= vanilla':>9}")
    table = []
    for label, _ in methods:
        row = totals[label]
        speed = row["tokens"] / row["seconds"]
        table.append({"configuration": label, "tok_s": speed, "ratio": speed / base,
                      "tokens_per_target_forward": row["tokens"] / row["steps"],
                      "draft_forwards_per_token": row["draft"] / row["tokens"],
                      "identical": f"{row['same']}/{len(prompts)}"})
        print(f"{label:<34} {speed:7.2f} {speed / base:9.3f}x {row['tokens'] / row['steps']:18.2f}"
              f" {row['draft'] / row['tokens']:16.2f} {row['same']:>5}/{len(prompts)}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
