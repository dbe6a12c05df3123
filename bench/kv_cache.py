"""Benchmark: the reserved in-place KV cache vs transformers' ``DynamicCache``, side by side.

    python bench/kv_cache.py [--lengths 128 512 1024 1536] [--rows 1 5] [--blocks 6] [--out FILE]

For each cached context length L and each number of fed rows q, the embedded default target
(SmolLM2-135M-Instruct fp32) runs forwards of q tokens after L cached positions, each followed by a
rollback to L (so every forward sees the same context), over each cache: blocks of 10 forwards,
alternating which cache goes first, after a warm-up. q = 1 is a decode step (``vanilla``); q = 5
is a verification of γ = 4 drafts whose rejected rows are cropped. The context is GSM8K questions,
concatenated and cut to L tokens. Each row gives ms per forward for both caches, their ratio and
the largest logit difference between them (the rows must hold the same keys and values).
``decoding.reserved_cache`` says what differs.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

from decoding import load_pair
from decoding.runtime import crop_cache, forward_logits, new_cache

ROOT = Path(__file__).resolve().parents[1]
PER_BLOCK = 10


def context(tokenizer, length: int) -> torch.Tensor:
    """[length] ids: GSM8K questions one after another, cut to ``length`` tokens."""
    lines = (ROOT / "data" / "gsm8k" / "test_200.jsonl").read_text().splitlines()
    text = "\n\n".join(json.loads(line)["question"] for line in lines)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    return ids[:length]                  # the 200 questions are ~12k tokens: longer than the context


@torch.inference_mode()
def block(model, cache, fed: torch.Tensor, length: int) -> tuple[float, torch.Tensor]:
    """PER_BLOCK forwards of ``fed`` ([1, q]) after ``length`` cached rows; seconds, last logits."""
    began = time.perf_counter()
    for _ in range(PER_BLOCK):
        logits = forward_logits(model, fed, cache, length, fed.shape[1])         # [q, V]
        crop_cache(cache, length)
    return time.perf_counter() - began, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 1536])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--blocks", type=int, default=6, help="blocks of 10 forwards per cache")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)

    pair = load_pair("smollm2", {"kind": "none"})
    model = pair.target
    limit = model.config.max_position_embeddings
    for length in args.lengths:
        if length < 1 or length + max(args.rows) > limit:
            raise SystemExit(f"--lengths {length} is invalid: allowed is 1 to "
                             f"{limit - max(args.rows)} (the model's context of {limit} minus "
                             f"the largest --rows)")
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {args.threads} threads; SmolLM2-135M fp32; "
          f"{args.blocks} x {PER_BLOCK} forwards per cache and row", flush=True)
    rows = []
    for length in args.lengths:
        prompt = context(pair.tokenizer, length)
        caches = {"reserved": new_cache(model, length + max(args.rows)),
                  "DynamicCache": DynamicCache(config=model.config)}
        with torch.inference_mode():
            for cache in caches.values():
                forward_logits(model, prompt[None], cache, 0, 1)
        for q in args.rows:
            fed = prompt[-q:][None]                      # any q real tokens                [1, q]
            seconds, logits = dict.fromkeys(caches, 0.0), {}
            for cache in caches.values():
                block(model, cache, fed, length)         # warm-up
            for index in range(args.blocks):
                order = list(caches) if index % 2 == 0 else list(caches)[::-1]
                for name in order:
                    took, logits[name] = block(model, caches[name], fed, length)
                    seconds[name] += took
            count = args.blocks * PER_BLOCK
            row = {"context": length, "fed_rows": q,
                   "reserved_ms": 1000 * seconds["reserved"] / count,
                   "dynamic_cache_ms": 1000 * seconds["DynamicCache"] / count,
                   "speedup": seconds["DynamicCache"] / seconds["reserved"],
                   "max_logit_diff": float((logits["reserved"] - logits["DynamicCache"])
                                           .abs().max())}
            rows.append(row)
            print(f"L={length:<5} q={q}  reserved {row['reserved_ms']:7.2f} ms   DynamicCache "
                  f"{row['dynamic_cache_ms']:7.2f} ms   speedup {row['speedup']:.3f}   "
                  f"max |logit diff| {row['max_logit_diff']:.1e}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                        "torch": torch.__version__,
                                        "transformers": transformers.__version__,
                                        "threads": args.threads, "blocks": args.blocks,
                                        "forwards_per_block": PER_BLOCK, "rows": rows},
                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
