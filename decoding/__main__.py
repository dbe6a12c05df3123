"""A short generation demo on the embedded default pair (offline).

    python -m decoding [--prompts 2] [--max-new-tokens 48] [--gamma 4]

Runs vanilla, speculative (token verification) and block verification on GSM8K questions with
SmolLM2-135M-Instruct (fp32) and its int8-dynamic self-draft, checks that greedy outputs are
identical, and prints tokens/s and acceptance statistics. Each method is warmed up once (untimed)
and timed over ``--repeats`` passes (the median is shown): a single cold pass measures the
first-call allocations, not the method. Paired, interleaved measurements are the tuner's job.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

from decoding import build_method, encode_prompt, generate, load_pair
from decoding.acceptance import total

DATA = Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "test_200.jsonl"
HONESTY = ("Note: on a small CPU a 135M target is overhead-bound (verifying 5 tokens costs ~1.8x "
           "one), so speculative decoding cannot show a real speedup here; this demo shows the "
           "pipeline and its losslessness. Speedups need a >=1B target or a GPU.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print("loading the embedded default pair (first run converts the GGUF once, ~30 s) ...",
          flush=True)
    pair = load_pair("smollm2")
    print(f"target: {pair.target_name}   draft: {pair.draft_name}   device: {pair.device}")
    questions = [json.loads(line)["question"] for line in DATA.read_text().splitlines()]
    prompts = [encode_prompt(pair.tokenizer, q) for q in questions[: args.prompts]]
    reference = None
    for name in ("vanilla", "speculative", "block"):
        kw = {} if name == "vanilla" else {"num_draft_tokens": args.gamma}
        method = build_method(name, pair, **kw)
        generate(method, prompts[0], args.max_new_tokens)          # warm-up, untimed
        passes = []
        for _ in range(max(args.repeats, 1)):
            began = time.perf_counter()
            outs = [generate(method, p, args.max_new_tokens, tokenizer=pair.tokenizer)
                    for p in prompts]
            passes.append(time.perf_counter() - began)
        seconds = sorted(passes)[len(passes) // 2]
        tokens = sum(o.stats.new_tokens for o in outs)
        counts = total([o.stats.counts for o in outs])
        same = "reference" if reference is None else \
            f"identical to vanilla: {sum(o.tokens == r for o, r in zip(outs, reference))}/" \
            f"{len(outs)}"
        reference = reference or [o.tokens for o in outs]
        rate = f"{counts.acceptance_rate:.2f}" if counts.drafted else "-"
        print(f"{name:<12} {tokens / seconds:6.2f} tok/s   {tokens} tokens in {counts.steps} "
              f"target forwards (mean accepted {counts.tokens_per_forward:.2f}, acceptance "
              f"{rate})   {same}",
              flush=True)
    print(f"\nsample output: {outs[0].text!r}\n")
    print(f"tok/s: the median of {max(args.repeats, 1)} passes after one untimed warm-up, one "
          "method after the other (not interleaved: for paired speedups use the tuner)")
    print(HONESTY)


if __name__ == "__main__":
    main()
