"""Benchmark: token trees vs chains at equal draft tokens per target forward.

    python bench/trees.py [--prompts 3] [--max-new-tokens 48] [--models smollm2 tiny]

For each budget B of draft tokens verified per target forward: a chain (speculative, γ = B), an
EAGLE-2 dynamic tree (method=tree, total_tokens = B), a static tree of B tokens where one exists,
and SpecInfer (2 sampled drafts of B/2 tokens), all greedy, side by side on the same prompts after
one untimed warm-up prompt. Models: the embedded default (SmolLM2-135M fp32 target + int8 self-
draft, GSM8K prompts) and the tiny random pair ("related": the target's first layer as draft,
token-id prompts). Reported per configuration: mean accepted tokens per target forward (block
efficiency, bonus included), draft forwards per token, tokens/s, the ratio to vanilla, and whether
every output equals vanilla's.
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
from decoding.models import ModelPair, early_exit_draft, load_model

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [
    ("vanilla", "vanilla", {}),
    ("B=4 chain γ=4", "speculative", {"num_draft_tokens": 4}),
    ("B=4 tree dynamic w=2 d=3", "tree", {"total_tokens": 4, "depth": 3, "width": 2}),
    ("B=4 tree static 2-1 (4 tok)", "tree", {"shape": (2, 1)}),
    ("B=4 specinfer 2x2", "specinfer", {"num_drafts": 2, "num_draft_tokens": 2}),
    ("B=8 chain γ=8", "speculative", {"num_draft_tokens": 8}),
    ("B=8 tree dynamic w=3 d=5", "tree", {"total_tokens": 8, "depth": 5, "width": 3}),
    ("B=8 tree static 2-1-1-1 (8 tok)", "tree", {"shape": (2, 1, 1, 1)}),
    ("B=8 specinfer 2x4", "specinfer", {"num_drafts": 2, "num_draft_tokens": 4}),
]


def tiny_related() -> ModelPair:
    target = load_model({"kind": "tiny", "seed": 0})
    return ModelPair(target.model, early_exit_draft(target.model, 1), None, target.name,
                     "first layer")


def prompts_for(name: str, pair: ModelPair, count: int) -> list[list[int]]:
    if name == "tiny":
        return [[3 + i, 7 * i % 250 + 1, 42, 5 + 2 * i] for i in range(count + 1)]
    lines = (ROOT / "data" / "gsm8k" / "test_200.jsonl").read_text().splitlines()
    return [encode_prompt(pair.tokenizer, json.loads(line)["question"])
            for line in lines[: count + 1]]


def run(name: str, pair: ModelPair, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    warmup, prompts = prompts[0], prompts[1:]
    methods = []
    for label, method_name, kw in CONFIGS:
        method = build_method(method_name, pair, **kw)
        generate(method, warmup, 8)
        methods.append((label, method))
    totals = {label: {"tokens": 0, "seconds": 0.0, "steps": 0, "draft": 0, "same": 0}
              for label, _ in methods}
    for prompt in prompts:
        reference = None
        for label, method in methods:
            began = time.perf_counter()
            out = generate(method, prompt, max_new_tokens)
            row = totals[label]
            row["seconds"] += time.perf_counter() - began
            row["tokens"] += out.stats.new_tokens
            row["steps"] += out.stats.steps
            row["draft"] += out.stats.draft_forwards
            reference = out.tokens if reference is None else reference
            row["same"] += out.tokens == reference
    base = totals["vanilla"]["tokens"] / totals["vanilla"]["seconds"]
    table = []
    for label, _ in methods:
        row = totals[label]
        speed = row["tokens"] / row["seconds"]
        table.append({"models": name, "configuration": label, "tok_s": speed,
                      "ratio": speed / base,
                      "tokens_per_target_forward": row["tokens"] / row["steps"],
                      "draft_forwards_per_token": row["draft"] / row["tokens"],
                      "identical": f"{row['same']}/{len(prompts)}"})
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--models", nargs="+", default=["smollm2", "tiny"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; {args.prompts} prompts x {args.max_new_tokens} "
          "new tokens, greedy", flush=True)
    print(f"{'models':<8} {'configuration':<32} {'tok/fwd':>7} {'draft fwd/tok':>13} "
          f"{'tok/s':>7} {'vs vanilla':>10} {'= vanilla':>9}")
    table = []
    for name in args.models:
        pair = tiny_related() if name == "tiny" else load_pair(name)
        rows = run(name, pair, prompts_for(name, pair, args.prompts), args.max_new_tokens)
        for r in rows:
            print(f"{name:<8} {r['configuration']:<32} {r['tokens_per_target_forward']:7.2f} "
                  f"{r['draft_forwards_per_token']:13.2f} {r['tok_s']:7.2f} "
                  f"{r['ratio']:9.3f}x {r['identical']:>9}", flush=True)
        table += rows
    if args.out:
        args.out.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
