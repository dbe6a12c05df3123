"""Benchmark: MJSD vs speculative sampling vs vanilla at T = 1, top-k 20, top-p 0.9 (MJSD's warping).

    python bench/mjsd.py [--task gsm8k] [--prompts 4] [--max-new-tokens 96] [--seeds 1]

On the embedded default pair (SmolLM2-135M-Instruct fp32 target + its int8 dynamic self-draft),
the same prompts for every method, interleaved per prompt after one untimed warm-up prompt:
tokens/s (wall-clock; the authors time CPU time with time.process_time_ns), the ratio to vanilla,
mean accepted tokens per target forward (bonus included), output perplexity under the unwarped
target (tuner.measure.quality, the paper's measure, computed outside the timed window), the task's quality
metric, and J/token from NVML's energy counter where an NVIDIA GPU exists (the authors sum
nvidia-smi power polled at 1 Hz; on a CPU it is reported unavailable with the reason).

The paper's claim, for comparison (Llama-2 / OPT 13B targets with 68M / 125M drafts, L40 GPU,
ChatGPT-Prompts / ChatAlpaca / CNN-DM): arXiv 2407.09722 Table 2, MJSD vs vanilla speculative
decoding: 1.49x speed, 1.62x less energy, perplexity 21.2 % lower than BiLD's (the abstract says
"than greedy decoding"); the ICLR 2025 version: -21.2 % perplexity, 1.42x speed, 1.54x less energy.

Result on the development machine (2-core AMD EPYC shared with other jobs, load average 4-6, no
GPU, fp32), ``--prompts 3 --max-new-tokens 64``, GSM8K, one seed (discussion in docs/benchmarks.md):

| method (T 1, top-k 20, top-p 0.9) | tok/s | vs vanilla | mean accepted tokens | perplexity | GSM8K accuracy | J/token |
|---|---|---|---|---|---|---|
| vanilla | 1.80 | 1.000× | 1.00 | 2.479 | 0.000 | unavailable (CPU) |
| speculative sampling γ=4 | 1.06 | 0.588× | 3.05 | 2.479 | 0.000 | unavailable (CPU) |
| MJSD γ=4 M=8 W=1 τ=0.9 (the paper's setting) | 0.59 | 0.327× | 2.37 | 2.380 | 0.000 | unavailable (CPU) |
| MJSD γ=4 M=4 W=2 τ=0.5 | 0.63 | 0.353× | 4.00 | 1.699 | 0.000 | unavailable (CPU) |
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
import transformers

from decoding import build_method, generate, load_pair
from tuner.measure.energy import EnergyMeter
from tuner.measure.quality import mean_log_prob, perplexity
from tuner.tasks.task import Task, task_configs

WARP = {"temperature": 1.0, "top_k": 20, "top_p": 0.9}          # conf/sampling/mjsd_paper.yaml
CONFIGS = [
    ("vanilla", "vanilla", {}),
    ("speculative sampling γ=4", "speculative", {"num_draft_tokens": 4}),
    ("MJSD γ=4 M=8 W=1 τ=0.9 (paper)", "mjsd",
     {"num_draft_tokens": 4, "num_beams": 8, "width": 1, "tau": 0.9}),
    ("MJSD γ=4 M=4 W=2 τ=0.5", "mjsd",
     {"num_draft_tokens": 4, "num_beams": 4, "width": 2, "tau": 0.5}),
]


def run(pair, task: Task, prompts: list, max_new_tokens: int, seeds: int) -> list[dict]:
    ids = {p.id: task.encode(p, pair.tokenizer) for p in prompts}
    meter = EnergyMeter(pair.device)
    methods = [(label, build_method(name, pair, **kw, **WARP)) for label, name, kw in CONFIGS]
    for _, method in methods:                                   # untimed warm-up
        generate(method, ids[prompts[0].id], 8)
    measured = prompts[1:]
    rows = {label: {"tokens": 0, "seconds": 0.0, "steps": 0, "accepted": 0, "joules": 0.0,
                    "log_probs": [], "texts": [], "prompts": []} for label, _ in methods}
    for seed in range(seeds):
        for prompt in measured:
            for label, method in methods:
                method.seed = seed
                with meter:
                    began = time.perf_counter()
                    out = generate(method, ids[prompt.id], max_new_tokens)
                    seconds = time.perf_counter() - began
                row = rows[label]
                row["tokens"] += out.stats.new_tokens
                row["seconds"] += seconds
                row["steps"] += out.stats.steps
                row["accepted"] += out.stats.accepted
                if meter.reading.available:
                    row["joules"] += meter.reading.joules
                row["log_probs"].append(mean_log_prob(pair.target, ids[prompt.id], out.tokens))
                row["texts"].append(pair.tokenizer.decode(out.tokens, skip_special_tokens=True))
                row["prompts"].append(prompt)
    base = rows["vanilla"]["tokens"] / rows["vanilla"]["seconds"]
    table = []
    for label, _ in methods:
        row = rows[label]
        quality, _ = task.score(row["prompts"], row["texts"])
        speed = row["tokens"] / row["seconds"]
        table.append({"method": label, "tok_s": speed, "ratio": speed / base,
                      "mean_accepted_tokens": 1 + row["accepted"] / row["steps"],
                      "perplexity": perplexity(row["log_probs"]), "quality": quality,
                      "j_per_token": row["joules"] / row["tokens"] if meter.available else None})
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="gsm8k")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    pair = load_pair("smollm2")
    task = Task(task_configs()[args.task])
    prompts, _ = task.split(args.prompts + 1, 0)
    meter = EnergyMeter(pair.device)
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, device {pair.device}; task {args.task}: "
          f"{args.prompts} prompts x {args.max_new_tokens} new tokens x {args.seeds} seed(s); "
          f"T=1 top-k 20 top-p 0.9; energy: {meter.reason or 'NVML total-energy counter'}",
          flush=True)
    table = run(pair, task, prompts, args.max_new_tokens, args.seeds)
    print(f"| method | tok/s | vs vanilla | mean accepted tokens | perplexity | "
          f"{args.task} quality | J/token |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        quality = ", ".join(f"{k} {v:.3f}" for k, v in r["quality"].items()) or "-"
        energy = f"{r['j_per_token']:.3f}" if r["j_per_token"] is not None else "unavailable"
        print(f"| {r['method']} | {r['tok_s']:.2f} | {r['ratio']:.3f}x | "
              f"{r['mean_accepted_tokens']:.2f} | {r['perplexity']:.3f} | {quality} | {energy} |")
    if args.out:
        args.out.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
