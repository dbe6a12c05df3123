"""Benchmark: our loops on the compiled static-shape target vs eager, and HF generate both ways.

    python bench/compiled.py [--prompts 6] [--max-new-tokens 64] [--buckets 1 2 4 8 16]
                             [--gammas 4] [--tree-sizes 8] [--out bench/results_compiled_cpu.json]
                             [--model smollm2|7b|1b|135m|tiny] [--device cpu|cuda] [--dtype fp32]

On the embedded default pair (SmolLM2-135M-Instruct fp32 target, int8-dynamic self-draft),
greedy, GSM8K prompts; or (``--model`` a shape of bench/random_models.py, e.g. on a GPU machine
that cannot hold the default's weights) a random-weight model of that shape with an early-exit
draft of 1/8 of its layers, on seeded random token prompts. On CUDA the compiled target runs in
``reduce-overhead`` mode (CUDA graphs):
  * compile time of every shape bucket (``CompiledTarget.warm``), measured before any timing;
  * per method (vanilla; speculative at each ``--gammas``; tree at each ``--tree-sizes``): eager vs
    compiled tokens/s, interleaved per prompt (eager, compiled, eager, ...) after one warm-up
    prompt, tokens compared (they must be identical);
  * transformers' own ``generate``: dynamic cache eager vs ``cache_implementation="static"`` with
    its compile config (``_compile_all_devices`` so it compiles on a CPU too), so the comparison
    with the framework's own compiled path stays fair.
Ratios are total tokens / total time; the draft model stays eager (only the target is compiled).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers import CompileConfig, StaticCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decoding_vs_hf import gsm8k_prompts, hf_generate, timed  # noqa: E402
from bench.random_models import SHAPES, random_pair, random_prompts  # noqa: E402
from decoding import build_method, generate, load_pair  # noqa: E402
from decoding.models import resolve_device, resolve_dtype  # noqa: E402
from decoding.compiled import CompiledTarget  # noqa: E402
from decoding.hardware import hardware  # noqa: E402
from decoding.runtime import cache_argument  # noqa: E402


def side_by_side(name, eager, compiled, prompts) -> dict:
    """Interleaved runs of two callables returning token tuples; prompts[0] warms both up."""
    eager(prompts[0]), compiled(prompts[0])
    prompts = prompts[1:]
    totals = {"eager": [0, 0.0], "compiled": [0, 0.0]}
    identical = 0
    for k, prompt in enumerate(prompts):
        order = [("eager", eager), ("compiled", compiled)]
        outputs = {}
        for side, fn in (order if k % 2 == 0 else order[::-1]):
            tokens, seconds = timed(lambda: fn(prompt))
            outputs[side] = tokens
            totals[side][0] += len(tokens)
            totals[side][1] += seconds
        identical += outputs["eager"] == outputs["compiled"]
    eager_rate = totals["eager"][0] / totals["eager"][1]
    compiled_rate = totals["compiled"][0] / totals["compiled"][1]
    row = {"comparison": name, "eager_tok_s": eager_rate, "compiled_tok_s": compiled_rate,
           "speedup": compiled_rate / eager_rate, "identical": f"{identical}/{len(prompts)}"}
    print(f"{name:<28} eager {eager_rate:6.2f} tok/s   compiled {compiled_rate:6.2f} tok/s   "
          f"×{row['speedup']:.3f}   identical {row['identical']}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--gammas", type=int, nargs="*", default=[4])
    parser.add_argument("--tree-sizes", type=int, nargs="*", default=[8],
                        help="method=tree total_tokens values (dynamic shape, depth 4, width 4)")
    parser.add_argument("--no-vanilla", action="store_true")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' generate rows")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--model", default="smollm2", choices=["smollm2", *sorted(SHAPES)],
                        help="the embedded default pair, or a random-weight model of this shape")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="random shapes: where the model runs")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="random shapes: the weights' dtype")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    if args.model == "smollm2":
        pair = load_pair("smollm2")
        prompts = gsm8k_prompts(pair.tokenizer, args.prompts + 1)
    else:
        pair = random_pair(args.model, resolve_device(args.device), resolve_dtype(args.dtype))
        prompts = random_prompts(args.prompts + 1, 64, pair.target.config.vocab_size)
    print(f"# {pair.target_name} + {pair.draft_name} on {pair.device}, torch "
          f"{torch.__version__}", flush=True)
    longest = max(len(p) for p in prompts)
    capacity = -(-(longest + args.max_new_tokens + max(args.buckets) + 64) // 64) * 64
    compiled = CompiledTarget(pair.target, capacity=capacity, buckets=args.buckets)
    began = time.perf_counter()
    compile_s = compiled.warm()
    total_compile = time.perf_counter() - began
    print(f"compiled buckets {args.buckets} (capacity {capacity}) in {total_compile:.1f} s: "
          + ", ".join(f"{b}: {s:.1f} s" for b, s in compile_s.items()), flush=True)

    def runner(name, **params):
        method = build_method(name, pair, **params)

        def run(use, prompt):
            method.use_compiled(compiled if use else None)
            return generate(method, prompt, args.max_new_tokens).tokens
        return (lambda p: run(False, p)), (lambda p: run(True, p))

    rows = [] if args.no_vanilla else [side_by_side("vanilla", *runner("vanilla"), prompts)]
    for gamma in args.gammas:
        rows.append(side_by_side(f"speculative γ={gamma}",
                                 *runner("speculative", num_draft_tokens=gamma), prompts))
    for size in args.tree_sizes:
        rows.append(side_by_side(f"tree total_tokens={size}",
                                 *runner("tree", total_tokens=size), prompts))
    if not args.no_hf:
        model = pair.target
        config = CompileConfig()
        config._compile_all_devices = True   # its documented switch to compile off-GPU too
        # one static cache of our capacity for every prompt (generate's own would be sized per
        # prompt, a new shape, so a recompile, for each one)
        cache = StaticCache(config=model.config, max_cache_len=capacity)

        def hf_static(prompt):
            cache.reset()
            return hf_generate(model, prompt, args.max_new_tokens, compile_config=config,
                               **cache_argument(model, cache))
        _, hf_compile = timed(lambda: hf_static(prompts[0]))
        print(f"HF generate static+compile: first call (compiles) {hf_compile:.1f} s", flush=True)
        hf = side_by_side("HF generate", lambda p: hf_generate(model, p, args.max_new_tokens),
                          hf_static, prompts)
        hf["first_call_s"] = hf_compile
        rows.append(hf)
    print(f"eager forwards (longer than the largest bucket: prefills, big trees): "
          f"{compiled.eager_forwards}")
    if args.out:
        args.out.write_text(json.dumps({
            "machine": platform.processor() or platform.machine(), "threads": args.threads,
            "device": hardware(pair.device), "mode": compiled.mode,
            "target": pair.target_name, "draft": pair.draft_name,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
            "buckets": args.buckets, "capacity": capacity,
            "compile_s": {str(b): s for b, s in compile_s.items()},
            "compile_total_s": total_compile, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
