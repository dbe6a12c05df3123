"""GPU figures (H100/H200): what verification costs, what each method gains, and bf16 losslessness.

    python bench/gpu.py cost methods --out gpu.json        # 7B-shaped bf16 target built from a config

Sections:
  * ``cost``: one target forward of n new tokens after a 512-token cached context, for a chain
    (causal) and for a token tree (4D mask), n = 1..128, CUDA-event timing (median of 10 after 3
    warm-ups), as a ratio to n = 1. This is the number that decides how wide a tree may be.
  * ``methods``: every decoding method on the same 7B-shaped bf16 target (Llama-2-7B shapes,
    random weights, seed 0) with a draft derived from it (its first 4 layers + the target's LM head:
    ``early_exit``), greedy, same prompts (seeded random token ids), side by side: tokens/s, ratio to
    vanilla, tokens per target forward, output = vanilla's, and J/token from NVML's energy counter.
    Random weights make acceptance a property of this construction, not of a trained pair: read the
    per-forward costs and the loop overhead from it, not the speed-ups a real pair would get.
bf16 losslessness (where outputs first differ, and by how much) is bench/near_ties.py (any device).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
import transformers

from decoding import build_method, generate
from decoding.models import ModelPair, early_exit_draft
from decoding.runtime import crop_cache, forward_logits, new_cache
from decoding.tree import tree_forward
from tuner.measure.energy import EnergyMeter

SEVEN_B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
           "max_position_embeddings": 4096, "initializer_range": 0.02}


def seven_b(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A Llama-2-7B-shaped model with seeded random weights, built on the GPU from a config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("llama", bos_token_id=None, pad_token_id=None, eos_token_id=None,
                                  tie_word_embeddings=False, **SEVEN_B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def cuda_ms(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def balanced_parents(n: int, width: int = 4) -> list[int]:
    """A tree of n nodes: ``width`` children per level-1 node, then chains (EAGLE-like)."""
    parents = [-1] * min(width, n)
    while len(parents) < n:
        parents.append(len(parents) - width)
    return parents


@torch.inference_mode()
def section_cost(model: torch.nn.Module, context: int = 512) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=gen).cuda()
    cache = new_cache(model)
    forward_logits(model, prompt, cache, 0, 1)
    rows = []
    base = None
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).cuda()

        def chain():
            forward_logits(model, ids, cache, context, n)
            crop_cache(cache, context)

        parents = balanced_parents(n)
        tokens = ids[0].tolist()

        def tree():
            tree_forward(model, tokens, parents, cache, list(range(n)))
            crop_cache(cache, context)

        chain_ms, tree_ms = cuda_ms(chain), cuda_ms(tree)
        base = base or chain_ms
        rows.append({"n": n, "chain_ms": chain_ms, "tree_ms": tree_ms,
                     "chain_ratio": chain_ms / base, "tree_ratio": tree_ms / base})
        print(f"cost  n={n:<4} chain {chain_ms:7.2f} ms ({chain_ms / base:5.2f}x)   "
              f"tree {tree_ms:7.2f} ms ({tree_ms / base:5.2f}x)", flush=True)
    return rows


METHODS_7B = [
    ("vanilla", "vanilla", {}),
    ("speculative γ=4", "speculative", {"num_draft_tokens": 4}),
    ("speculative γ=8", "speculative", {"num_draft_tokens": 8}),
    ("block γ=4", "block", {"num_draft_tokens": 4}),
    ("tree dynamic 8/d4/w4", "tree", {"total_tokens": 8, "depth": 4, "width": 4}),
    ("tree dynamic 16/d6/w4", "tree", {"total_tokens": 16, "depth": 6, "width": 4}),
    ("tree dynamic 60/d5/w10 (EAGLE-2)", "tree", {"total_tokens": 60, "depth": 5, "width": 10}),
    ("tree static eagle10", "tree", {"shape": "eagle10"}),
    ("specinfer 3x4", "specinfer", {"num_drafts": 3, "num_draft_tokens": 4}),
    ("lookahead (default)", "lookahead", {}),
    ("ouroboros (default)", "ouroboros", {}),
]


def timed_runs(pair: ModelPair, configs, prompts, max_new_tokens: int, label: str) -> list[dict]:
    methods = []
    for name, method_name, kw in configs:
        method = build_method(method_name, pair, **kw)
        generate(method, prompts[0], 8)                       # warm-up (kernels, allocator)
        methods.append((name, method))
    totals = {name: {"tokens": 0, "seconds": 0.0, "steps": 0, "draft": 0, "same": 0, "joules": 0.0}
              for name, _ in methods}
    device = next(pair.target.parameters()).device
    for prompt in prompts[1:]:
        reference = None
        for name, method in methods:
            meter = EnergyMeter(device)
            torch.cuda.synchronize()
            began = time.perf_counter()
            with meter:
                out = generate(method, prompt, max_new_tokens)   # tokens land on the host: synced
            row = totals[name]
            row["seconds"] += time.perf_counter() - began
            row["joules"] += (meter.reading.joules or 0.0) if meter.available else float("nan")
            row["tokens"] += out.stats.new_tokens
            row["steps"] += out.stats.steps
            row["draft"] += out.stats.draft_forwards
            reference = out.tokens if reference is None else reference
            row["same"] += out.tokens == reference
    base = totals["vanilla"]
    table = []
    for name, _ in methods:
        row = totals[name]
        speed = row["tokens"] / row["seconds"]
        entry = {"models": label, "configuration": name, "tok_s": speed,
                 "ratio": speed / (base["tokens"] / base["seconds"]),
                 "tokens_per_target_forward": row["tokens"] / row["steps"],
                 "draft_forwards_per_token": row["draft"] / row["tokens"],
                 "j_per_token": row["joules"] / row["tokens"],
                 "energy_ratio": (row["joules"] / row["tokens"]) / (base["joules"] / base["tokens"]),
                 "identical": f"{row['same']}/{len(prompts) - 1}"}
        table.append(entry)
        print(f"{label:<10} {name:<34} {entry['tokens_per_target_forward']:6.2f} tok/fwd "
              f"{speed:8.1f} tok/s {entry['ratio']:6.3f}x  {entry['j_per_token']:7.3f} J/tok "
              f"({entry['energy_ratio']:5.3f}x)  same {entry['identical']}", flush=True)
    return table


def section_methods(model: torch.nn.Module, prompts: int, max_new_tokens: int) -> list[dict]:
    pair = ModelPair(model, early_exit_draft(model, 4), None, "7B-shaped bf16 (random)",
                     "early_exit 4/32")
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 32000, (64,), generator=gen).tolist() for _ in range(prompts + 1)]
    return timed_runs(pair, METHODS_7B, ids, max_new_tokens, "7B-shaped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="+", choices=["cost", "methods"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU")
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}", flush=True)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "transformers": transformers.__version__}
    model = seven_b()
    if "cost" in args.sections:
        result["cost"] = section_cost(model)
    if "methods" in args.sections:
        result["methods"] = section_methods(model, args.prompts, args.max_new_tokens)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
