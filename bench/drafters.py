"""Benchmark: drafters on the embedded default — vanilla, speculative (int8 draft), EAGLE (the shipped
head), prompt lookup — on GSM8K and CNN/DM held-out prompts, greedy, in one run.

    python bench/drafters.py [--prompts 3] [--max-new-tokens 64] [--threads 1] [--out results.json]

Prompts: the first ``--prompts`` of each task's held-out slice (``eagle_training.data.held_out``: the
same split the EAGLE head was trained without). CNN/DM twice: the repo's copy (``cnndm``: the
tokenised, lower-cased CoreNLP text, which a model writing natural text cannot copy n-grams from)
and natural text (``cnndm-natural``: Spec-Bench's held-out summarization items that share no word
8-gram with any ``cnndm`` record). Per prompt the methods run in a rotating order
after one untimed warm-up generation each. Reported per task and configuration: decode tokens/s
(after the first step, i.e. without the prompt's prefill, which every method pays alike), its ratio
to vanilla, the end-to-end ratio (prefill included), mean accepted tokens per target forward (bonus
included: vanilla = 1), and whether every output equals vanilla's. The head's own record (training
time, held-out top-1 agreement) is printed next to the EAGLE paper's.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
import transformers

from decoding import build_method, load_pair
from decoding.eagle_weights import SHIPPED

CONFIGS = [
    ("vanilla", "vanilla", {}),
    ("speculative int8 γ=4", "speculative", {"num_draft_tokens": 4}),
    ("eagle dynamic 8/4/4", "eagle", {"head": "smollm2-135m-instruct"}),
    ("eagle chain4", "eagle", {"head": "smollm2-135m-instruct", "shape": "chain4"}),
    ("eagle dynamic 4/3/2", "eagle", {"head": "smollm2-135m-instruct", "total_tokens": 4,
                                      "depth": 3, "width": 2}),
    ("prompt lookup n≤3 γ=10", "prompt_lookup", {}),
    ("prompt lookup n≤3 γ=4", "prompt_lookup", {"num_draft_tokens": 4}),
]
PAPER = ("EAGLE paper (Vicuna-7B, GSM8K, T=0, A100): speedup 3.01x, mean accepted tokens 4.00, "
         "0-α 0.79; heads trained 1-2 days on 4xA100 (70B) / an RTX 3090 node (7B-33B), 68k "
         "ShareGPT dialogues")


def timed(method, prompt: list[int], max_new_tokens: int) -> dict:
    """Wall time of the first step (prefill) and of the rest; tokens and target forwards."""
    began = time.perf_counter()
    steps, first = [], None
    for step in method.stream(torch.tensor(prompt), max_new_tokens):
        steps.append(step)
        first = first or time.perf_counter()
    end = time.perf_counter()
    tokens = [t for s in steps for t in s.tokens]
    return {"tokens": tokens, "first_s": first - began, "rest_s": end - first,
            "rest_tokens": len(tokens) - len(steps[0].tokens), "steps": len(steps),
            "accepted": sum(s.accepted for s in steps)}


def run_task(task: str, pair, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    methods = [(label, build_method(name, pair, **kw)) for label, name, kw in CONFIGS]
    for _, method in methods:
        timed(method, prompts[0][:64], 8)                              # warm-up, untimed
    rows = {label: [] for label, _ in methods}
    for i, prompt in enumerate(prompts):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        for label, method in order:
            rows[label].append(timed(method, prompt, max_new_tokens))
    base = rows["vanilla"]
    table = []
    for label, runs in rows.items():
        decode = sum(r["rest_tokens"] for r in runs) / sum(r["rest_s"] for r in runs)
        total = sum(len(r["tokens"]) for r in runs) / sum(r["first_s"] + r["rest_s"] for r in runs)
        table.append({"task": task, "configuration": label, "decode_tok_s": decode,
                      "total_tok_s": total,
                      "mean_accepted": sum(len(r["tokens"]) for r in runs)
                      / sum(r["steps"] for r in runs),
                      "identical": f"{sum(r['tokens'] == b['tokens'] for r, b in zip(runs, base))}"
                                   f"/{len(runs)}"})
    for row in table:
        ref = table[0]
        row["decode_ratio"] = row["decode_tok_s"] / ref["decode_tok_s"]
        row["total_ratio"] = row["total_tok_s"] / ref["total_tok_s"]
    return table


def bench_prompts(name: str):
    """(task, held-out prompts) of a bench task (see the module docstring)."""
    from eagle_training.data import _ngrams, held_out, task_configs
    configs = task_configs()
    if name != "cnndm-natural":
        task, _, held = held_out(configs[name])
        return task, held
    task, _, held = held_out(configs["specbench"])
    _, train, cn_held = held_out(configs["cnndm"])
    seen = set().union(*(_ngrams(p.item["article"]) for p in train + cn_held))
    return task, [p for p in held if p.category == "summarization"
                  and not _ngrams(" ".join(c for _, c in p.messages)) & seen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 resists neighbours on a shared CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    head = json.loads((SHIPPED["smollm2-135m-instruct"] / "config.json").read_text())["spectune"]
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; {args.prompts} held-out prompts per task x "
          f"{args.max_new_tokens} new tokens, greedy", flush=True)
    print(f"# shipped head: {head['parameters']:,} parameters; trained "
          f"{(head['extract_seconds'] + head['train_seconds']) / 60:.1f} min on {head['hardware']}"
          f" ({head['tokens']} feature tokens, {head['tokens_seen']} tokens seen); held-out "
          f"top-1 agreement {head['held_out_top1']:.3f}\n# {PAPER}", flush=True)
    pair = load_pair("smollm2")
    print(f"{'task':<13} {'configuration':<24} {'decode tok/s':>12} {'vs vanilla':>10} "
          f"{'end-to-end':>10} {'accepted/fwd':>12} {'= vanilla':>9}")
    table = []
    for name in ("gsm8k", "cnndm", "cnndm-natural"):
        task, held = bench_prompts(name)
        prompts = [task.encode(p, pair.tokenizer) for p in held[: args.prompts]]
        for r in run_task(name, pair, prompts, args.max_new_tokens):
            print(f"{name:<13} {r['configuration']:<24} {r['decode_tok_s']:12.2f} "
                  f"{r['decode_ratio']:9.3f}x {r['total_ratio']:9.3f}x {r['mean_accepted']:12.2f}"
                  f" {r['identical']:>9}", flush=True)
            table.append(r)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"head": head, "rows": table}, handle, indent=2)


if __name__ == "__main__":
    main()
