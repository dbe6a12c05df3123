"""Benchmark: drafters on the embedded default — vanilla, speculative (int8 draft), EAGLE-2 and EAGLE-3
heads, prompt lookup — on GSM8K and CNN/DM held-out prompts, greedy, in one run.

    python bench/drafters.py [--prompts 3] [--max-new-tokens 64] [--threads 1] [--out results.json]
        [--heads eagle2=smollm2-135m-instruct eagle3=smollm2-135m-instruct-eagle3 other=/dir]

``--heads``: label=reference pairs (default: every shipped head for SmolLM2). Each head runs as
a dynamic tree of 8 draft tokens (depth 4, top-k 4: EAGLE-2's total_token 9; for an EAGLE-3 head
SGLang's steps 4, topk 4, num_draft_tokens 9: the same tree) and as a chain of 4.

Prompts: the first ``--prompts`` of each task's held-out slice (``eagle_training.data.held_out``: the
same split the EAGLE head was trained without). CNN/DM twice: the repo's copy (``cnndm``: the
tokenised, lower-cased CoreNLP text, which a model writing natural text cannot copy n-grams from)
and natural text (``cnndm-natural``: Spec-Bench's held-out summarization items that share no word
8-gram with any ``cnndm`` record). Per prompt the methods run in a rotating order
after one untimed warm-up generation each. Reported per task and configuration: decode tokens/s
(after the first step, i.e. without the prompt's prefill, which every method pays alike), its ratio
to vanilla, the end-to-end ratio (prefill included), mean accepted tokens per target forward (bonus
included: vanilla = 1), and whether every output equals vanilla's. Each head's own record (training
time, held-out top-1 agreement = 0-α) is printed next to the EAGLE papers'.
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

from decoding.eagle_weights import head_version, read_config

BASELINES = [("vanilla", "vanilla", {}), ("speculative int8 γ=4", "speculative",
                                         {"num_draft_tokens": 4})]
LOOKUPS = [("prompt lookup n≤3 γ=10", "prompt_lookup", {}),
           ("prompt lookup n≤3 γ=4", "prompt_lookup", {"num_draft_tokens": 4})]
PAPER = ("EAGLE paper (Vicuna-7B, GSM8K, T=0, A100): speedup 3.01x, mean accepted tokens 4.00, "
         "0-α 0.79; heads trained 1-2 days on 4xA100 (70B) / an RTX 3090 node (7B-33B), 68k "
         "ShareGPT dialogues. EAGLE-3 paper: up to 6.5x, about 1.4x EAGLE-2; Spec-Bench "
         "(Vicuna-13B, A100): EAGLE-3 3.02x (mean accepted 5.71) vs EAGLE-2 2.46x")


def head_configs(heads: dict[str, str]) -> list[tuple[str, str, dict]]:
    """A dynamic tree (8 draft tokens, depth 4, top-k 4) and a chain of 4 per head."""
    out = []
    for label, reference in heads.items():
        method, tree = (("eagle3", {"num_draft_tokens": 9, "steps": 4, "topk": 4})
                        if head_version(reference) == 3 else
                        ("eagle", {"total_tokens": 8, "depth": 4, "width": 4}))
        out += [(f"{label} dynamic 8/4/4", method, {"head": reference, **tree}),
                (f"{label} chain4", method, {"head": reference, "shape": "chain4"})]
    return out


def head_record(reference: str) -> dict:
    return (read_config(reference) or {}).get("spectune", {})


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


def run_task(task: str, pair, prompts: list[list[int]], max_new_tokens: int,
             configs: list[tuple[str, str, dict]]) -> list[dict]:
    methods = [(label, build_method(name, pair, **kw)) for label, name, kw in configs]
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
    parser.add_argument("--heads", nargs="*", default=None, metavar="LABEL=REFERENCE",
                        help="EAGLE heads to compare (default: every shipped head)")
    args = parser.parse_args()
    heads = dict(h.split("=", 1) for h in args.heads) if args.heads is not None else \
        {f"eagle{head_version(name)}": name for name, folder in SHIPPED.items() if folder.is_dir()}
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    records = {label: head_record(reference) for label, reference in heads.items()}
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; {args.prompts} held-out prompts per task x "
          f"{args.max_new_tokens} new tokens, greedy", flush=True)
    for label, head in records.items():
        print(f"# {label} = {heads[label]}: EAGLE-{head_version(heads[label])}, "
              f"{head['parameters']:,} parameters; trained "
              f"{(head['extract_seconds'] + head['train_seconds']) / 60:.1f} min on "
              f"{head['hardware']} ({head.get('threads', '?')} threads; {head['tokens']} feature "
              f"tokens, {head['tokens_seen']} tokens seen); held-out top-1 agreement (0-α) "
              f"{head['held_out_top1']:.3f}", flush=True)
    print(f"# {PAPER}", flush=True)
    configs = BASELINES + head_configs(heads) + LOOKUPS
    pair = load_pair("smollm2")
    print(f"{'task':<13} {'configuration':<30} {'decode tok/s':>12} {'vs vanilla':>10} "
          f"{'end-to-end':>10} {'accepted/fwd':>12} {'= vanilla':>9}")
    table = []
    for name in ("gsm8k", "cnndm", "cnndm-natural"):
        task, held = bench_prompts(name)
        prompts = [task.encode(p, pair.tokenizer) for p in held[: args.prompts]]
        for r in run_task(name, pair, prompts, args.max_new_tokens, configs):
            print(f"{name:<13} {r['configuration']:<30} {r['decode_tok_s']:12.2f} "
                  f"{r['decode_ratio']:9.3f}x {r['total_ratio']:9.3f}x {r['mean_accepted']:12.2f}"
                  f" {r['identical']:>9}", flush=True)
            table.append(r)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"heads": {label: {"reference": heads[label], **records[label]}
                                 for label in heads}, "rows": table}, handle, indent=2)


if __name__ == "__main__":
    main()
