"""GPU figures (H100/H200): what verification costs, what each method gains, and bf16 losslessness.

    python bench/gpu.py cost methods --out gpu.json        # 7B-shaped bf16 target built from a config
    python bench/gpu.py cost --device cpu --shape tiny      # the harness on a CPU (scripts/gpu_check.sh --cpu)

Sections:
  * ``cost``: one target forward of n new tokens after a 512-token cached context, for a chain
    (causal) and for a token tree (4D mask), n = 1..128, CUDA-event timing (median of 10 after 3
    warm-ups), as a ratio to n = 1. This is the number that decides how wide a tree may be.
  * ``loops``: where a generation's time per token goes on this device (``torch.profiler``, CPU and
    CUDA activities): our vanilla loop, block γ=4 and a bare forward + argmax loop on the same
    cache, timed side by side in two orders (vanilla first and last), then one profiled prompt each:
    GPU kernel time per token, host time inside and outside the target's forward, host syncs and
    the costliest ops outside the forward. Answers "why does vanilla pay more per token than one
    forward" from a trace rather than a guess.
  * ``methods``: every decoding method on the same 7B-shaped bf16 target (Llama-2-7B shapes,
    random weights, seed 0) with a draft derived from it (its first 1/8 of the layers + the LM head:
    ``early_exit``), greedy, same prompts (seeded random token ids), side by side: tokens/s, ratio to
    vanilla, tokens per target forward, output = vanilla's, and J/token from NVML's energy counter.
    Random weights make acceptance a property of this construction, not of a trained pair: read the
    per-forward costs and the loop overhead from it, not the speed-ups a real pair would get.
    The order turns by one method per prompt, and each method warms up on a run as long as the
    timed ones (vanilla first on every prompt after an 8-token warm-up read 44.0 ms per token on
    an H200 where the loops part read 29.8: ``aa`` tells which suspect it was).
  * ``aa``: vanilla against itself in the methods harness (a second vanilla among the methods),
    as the harness ran on the H200 and with each suspect removed in turn: the order, the
    warm-up's length, the energy meter, the other methods resident. 1.00 where it is fair.
bf16 losslessness (where outputs first differ, and by how much) is bench/near_ties.py (any device).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.random_models import SHAPES, random_pair, random_prompts  # noqa: E402
from decoding import build_method, generate  # noqa: E402
from decoding.hardware import hardware  # noqa: E402
from decoding.models import ModelPair, resolve_dtype  # noqa: E402
from decoding.runtime import crop_cache, forward_logits, new_cache  # noqa: E402
from decoding.tree import tree_forward  # noqa: E402
from tuner.measure.energy import EnergyMeter  # noqa: E402

FORWARD = "target forward"                 # the profiler range around every target forward
HOST_SYNCS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cudaEventSynchronize")


def median_ms(fn, device: torch.device, repeats: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()``: CUDA events on a GPU, perf_counter elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def balanced_parents(n: int, width: int = 4) -> list[int]:
    """A tree of n nodes: ``width`` children per level-1 node, then chains (EAGLE-like)."""
    parents = [-1] * min(width, n)
    while len(parents) < n:
        parents.append(len(parents) - width)
    return parents


@torch.inference_mode()
def section_cost(model: torch.nn.Module, context: int = 512,
                 sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)) -> list[dict]:
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=gen).to(device)
    cache = new_cache(model)
    forward_logits(model, prompt, cache, 0, 1)
    rows = []
    base = None
    for n in sizes:
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device)

        def chain():
            forward_logits(model, ids, cache, context, n)
            crop_cache(cache, context)

        parents = balanced_parents(n)
        tokens = ids[0].tolist()

        def tree():
            tree_forward(model, tokens, parents, cache, list(range(n)))
            crop_cache(cache, context)

        chain_ms, tree_ms = median_ms(chain, device), median_ms(tree, device)
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


def timed_runs(pair: ModelPair, configs, prompts, max_new_tokens: int, label: str,
               rotate: bool = True, meter_on: bool = True,
               warmup_tokens: int | None = None) -> list[dict]:
    """Every configuration on every prompt after the first (the warm-up's), side by side.
    ``rotate``: the order turns by one configuration per prompt (else vanilla is always first);
    ``meter_on``: each run inside an NVML energy meter; ``warmup_tokens``: the warm-up's length
    (None: the runs' own ``max_new_tokens``)."""
    methods = []
    for name, method_name, kw in configs:
        method = build_method(method_name, pair, **kw)
        generate(method, prompts[0], warmup_tokens or max_new_tokens)   # kernels, allocator
        methods.append((name, method))
    totals = {name: {"tokens": 0, "seconds": 0.0, "steps": 0, "draft": 0, "same": 0, "joules": 0.0}
              for name, _ in methods}
    device = next(pair.target.parameters()).device
    for number, prompt in enumerate(prompts[1:]):
        reference = generate(methods[0][1], prompt, max_new_tokens).tokens \
            if rotate and number % len(methods) else None      # vanilla's tokens (untimed)
        turn = number % len(methods) if rotate else 0
        for name, method in methods[turn:] + methods[:turn]:
            meter = EnergyMeter(device) if meter_on else None
            synchronize(device)
            began = time.perf_counter()
            if meter is None:
                out = generate(method, prompt, max_new_tokens)
            else:
                with meter:
                    out = generate(method, prompt, max_new_tokens)   # tokens on the host: synced
            row = totals[name]
            row["seconds"] += time.perf_counter() - began
            row["joules"] += (meter.reading.joules or 0.0) if meter is not None and \
                meter.available else float("nan")
            row["tokens"] += out.stats.new_tokens
            row["steps"] += out.stats.steps
            row["draft"] += out.stats.draft_forwards
            reference = out.tokens if reference is None else reference
            row["same"] += out.tokens == reference
    base = totals["vanilla"]
    method_of = {name: method_name for name, method_name, _ in configs}
    table = []
    for name, _ in methods:
        row = totals[name]
        speed = row["tokens"] / row["seconds"]
        entry = {"models": label, "configuration": name, "method": method_of[name],
                 "tokens": row["tokens"], "seconds": row["seconds"], "tok_s": speed,
                 "ratio": speed / (base["tokens"] / base["seconds"]),
                 "tokens_per_target_forward": row["tokens"] / row["steps"],
                 "draft_forwards_per_token": row["draft"] / row["tokens"],
                 "j_per_token": row["joules"] / row["tokens"],
                 "energy_ratio": (row["joules"] / row["tokens"]) / (base["joules"] / base["tokens"]),
                 "identical": f"{row['same']}/{len(prompts) - 1}"}
        print(f"{label:<10} {name:<34} {entry['tokens_per_target_forward']:6.2f} tok/fwd "
              f"{speed:8.1f} tok/s {entry['ratio']:6.3f}x  {entry['j_per_token']:7.3f} J/tok "
              f"({entry['energy_ratio']:5.3f}x)  same {entry['identical']}", flush=True)
        for key in ("j_per_token", "energy_ratio"):       # no energy counter (a CPU): null
            entry[key] = None if entry[key] != entry[key] else entry[key]
        table.append(entry)
    return table


@torch.inference_mode()
def bare_loop(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int) -> int:
    """The least a greedy loop can do: one cached forward and an argmax per token, the token read
    back to the host each step (as every loop must, to test EOS). Returns the tokens made."""
    cache = new_cache(model, prompt.shape[0] + max_new_tokens + 8)
    inputs, start = prompt[None], 0
    for _ in range(max_new_tokens):
        logits = forward_logits(model, inputs, cache, start, 1)                 # [1, V]
        token = logits[-1].argmax()
        int(token)                                                              # host sync
        start += inputs.shape[1]
        inputs = token.view(1, 1)
    return max_new_tokens


def trace_summary(prof, tokens: int) -> dict:
    """Per token: GPU time (the profiler's "Self CUDA time total": every kernel, copy and memset
    once), host time inside and outside the ``FORWARD`` ranges, host syncs, kernel launches, and
    the costliest top-level host ops outside the forward (a draft's forwards included)."""
    gpu_us = sum(row.self_device_time_total for row in prof.key_averages())
    cuda = torch.autograd.DeviceType.CUDA
    inside_us = launches = syncs = 0.0
    outside_ops: dict[str, float] = {}
    forward_ranges = []
    host_events = [e for e in prof.events() if e.device_type != cuda]
    for event in host_events:
        if event.name == FORWARD:
            forward_ranges.append((event.time_range.start, event.time_range.end))
            inside_us += event.cpu_time_total
    for event in host_events:
        syncs += event.name in HOST_SYNCS
        launches += event.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
        if event.name == FORWARD or event.cpu_parent is not None:
            continue                     # top-level host ops only: their children are inside
        began = event.time_range.start
        if not any(lo <= began <= hi for lo, hi in forward_ranges):
            outside_ops[event.name] = outside_ops.get(event.name, 0.0) + event.cpu_time_total
    top = sorted(outside_ops.items(), key=lambda kv: -kv[1])[:6]
    return {"gpu_ms_per_token": gpu_us / 1000 / tokens,
            "host_forward_ms_per_token": inside_us / 1000 / tokens,
            "host_outside_ms_per_token": sum(outside_ops.values()) / 1000 / tokens,
            "host_syncs_per_token": syncs / tokens, "kernel_launches_per_token": launches / tokens,
            "costliest_outside_us_per_token": [(name, round(us / tokens, 1)) for name, us in top]}


TRACED_TOKENS = 16                         # a profiled generation's length (traces grow fast)


LOOPS = [("vanilla", "vanilla", {}), ("block γ=4", "block", {"num_draft_tokens": 4})]


def section_loops(pair: ModelPair, prompts: int, max_new_tokens: int) -> dict:
    """Vanilla, block γ=4 and the bare loop side by side (ms per token, two orders), then one
    profiled prompt of each (``trace_summary``), with the target's forward wrapped in a range."""
    from torch.profiler import ProfilerActivity, profile, record_function

    device = next(pair.target.parameters()).device
    ids = [torch.tensor(p, device=device) for p in
           random_prompts(prompts + 1, 64, pair.target.config.vocab_size)]
    runners = {"bare forward + argmax": lambda p: bare_loop(pair.target, p, max_new_tokens)}
    methods = {}
    for name, method_name, kw in LOOPS:
        method = methods[name] = build_method(method_name, pair, **kw)
        runners[name] = (lambda m: lambda p: generate(m, p, max_new_tokens)
                         .stats.new_tokens)(method)
    for run in runners.values():
        run(ids[0])                                              # warm-up (kernels, allocator)
    order = ["vanilla", "bare forward + argmax", "block γ=4", "vanilla (again, last)"]
    times: dict[str, list[float]] = {name: [] for name in order}
    for prompt in ids[1:]:
        for name in order:
            synchronize(device)
            began = time.perf_counter()
            tokens = runners[name.split(" (")[0]](prompt)
            synchronize(device)
            times[name].append(1000 * (time.perf_counter() - began) / tokens)
    rows = []
    bare = statistics.median(times["bare forward + argmax"])
    for name in order:
        ms = statistics.median(times[name])
        rows.append({"loop": name, "ms_per_token": ms, "vs_bare": ms / bare,
                     "per_prompt_ms": [round(t, 2) for t in times[name]]})
        print(f"loops {name:<24} {ms:7.2f} ms/token ({ms / bare:5.2f}x the bare loop)", flush=True)

    depth = [0]

    def enter(module, args):
        depth[0] += 1
        if depth[0] == 1:
            scope = record_function(FORWARD)
            scope.__enter__()
            scopes.append(scope)

    def leave(module, args, output):
        depth[0] -= 1
        if depth[0] == 0 and scopes:
            scopes.pop().__exit__(None, None, None)

    scopes: list = []
    handles = [pair.target.register_forward_pre_hook(enter),
               pair.target.register_forward_hook(leave)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    traces = {}
    try:
        for name in ("bare forward + argmax", "vanilla", "block γ=4"):
            with profile(activities=activities) as prof:
                if name.startswith("bare"):
                    tokens = bare_loop(pair.target, ids[1], TRACED_TOKENS)
                else:
                    tokens = generate(methods[name], ids[1], TRACED_TOKENS).stats.new_tokens
                synchronize(device)
            traces[name] = trace_summary(prof, tokens)
            t = traces[name]
            print(f"trace {name:<24} GPU {t['gpu_ms_per_token']:6.2f} ms/token, "
                  f"host in forward {t['host_forward_ms_per_token']:6.2f}, outside "
                  f"{t['host_outside_ms_per_token']:6.2f}, syncs {t['host_syncs_per_token']:.1f}, "
                  f"launches {t['kernel_launches_per_token']:.0f}; outside: "
                  f"{t['costliest_outside_us_per_token'][:3]}", flush=True)
    finally:
        for handle in handles:
            handle.remove()
    return {"timed": rows, "traces": traces,
            "note": "timed: no profiler, medians over prompts of ms per generated token, each "
                    "prompt runs the loops in the order listed; traces: one prompt, "
                    f"{TRACED_TOKENS} tokens, under torch.profiler (its overhead inflates "
                    "host times: compare loops, not absolute figures)"}


def section_methods(pair: ModelPair, prompts: int, max_new_tokens: int) -> list[dict]:
    ids = random_prompts(prompts + 1, 64, pair.target.config.vocab_size)
    return timed_runs(pair, METHODS_7B, ids, max_new_tokens, pair.target_name.split()[0])


TWIN = ("vanilla (twin)", "vanilla", {})
# the methods harness as the H200 run of 2026-11-28 measured it (vanilla first on every prompt, an
# 8-token warm-up, the meter on), then each suspect removed in turn
AA_SETUPS = (("as it ran: every method resident, vanilla first, 8-token warm-up, meter on",
              METHODS_7B + [TWIN], {"rotate": False, "warmup_tokens": 8}),
             ("order rotated per prompt", METHODS_7B + [TWIN], {"warmup_tokens": 8}),
             ("warm-up as long as the runs", METHODS_7B + [TWIN], {"rotate": False}),
             ("no energy meter", METHODS_7B + [TWIN],
              {"rotate": False, "warmup_tokens": 8, "meter_on": False}),
             ("no other method resident", [METHODS_7B[0], TWIN],
              {"rotate": False, "warmup_tokens": 8}),
             ("the fixed harness: rotated, full warm-up, meter on", METHODS_7B + [TWIN], {}))


def section_aa(pair: ModelPair, prompts: int, max_new_tokens: int) -> list[dict]:
    """Vanilla against itself in the methods harness (a second vanilla, ``TWIN``, among the
    methods): 1.00 where the harness is fair. Each setup removes one suspect of the inflated
    vanilla (44.0 ms per token there against 29.8 in the loops part on an H200): the order (the
    method that ran before), a short warm-up, the meter, the resident methods."""
    ids = random_prompts(prompts + 1, 64, pair.target.config.vocab_size)
    rows = []
    for label, configs, options in AA_SETUPS:
        table = timed_runs(pair, configs, ids, max_new_tokens, "A/A", **options)
        by_name = {row["configuration"]: row for row in table}
        vanilla, twin = by_name["vanilla"], by_name[TWIN[0]]
        rows.append({"setup": label, "twin_over_vanilla": twin["ratio"],
                     "vanilla_ms_per_token": 1e3 * vanilla["seconds"] / vanilla["tokens"],
                     "twin_ms_per_token": 1e3 * twin["seconds"] / twin["tokens"],
                     "methods": len(configs)})
        print(f"A/A  {label:<56} twin/vanilla {twin['ratio']:6.3f}x  vanilla "
              f"{rows[-1]['vanilla_ms_per_token']:7.2f} ms/token", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="+", choices=["cost", "loops", "methods", "aa"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda (the figures) or cpu (the harness)")
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES),
                        help="the random-weight target's shape (bench/random_models.py)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128],
                        help="cost: the numbers of new tokens verified in one forward")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py: --device cuda was asked for but no CUDA GPU is available; "
                         "use --device cpu --shape tiny to check the harness")
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    pair = random_pair(args.shape, device, resolve_dtype(args.dtype))
    print(f"# {hardware(device)}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; target {pair.target_name}, draft {pair.draft_name}",
          flush=True)
    result: dict = {"device": hardware(device), "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda, "transformers": transformers.__version__,
                    "target": pair.target_name, "draft": pair.draft_name, "dtype": args.dtype}
    if {"methods", "loops", "aa"} & set(args.sections):
        result |= {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens}
    if "cost" in args.sections:
        result["cost"] = section_cost(pair.target, sizes=tuple(args.sizes))
    if "loops" in args.sections:
        result["loops"] = section_loops(pair, args.prompts, args.max_new_tokens)
    if "methods" in args.sections:
        result["methods"] = section_methods(pair, args.prompts, args.max_new_tokens)
    if "aa" in args.sections:
        result["aa"] = section_aa(pair, args.prompts, args.max_new_tokens)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
