"""Do tuned settings transfer between engines? The tuner's answer with engine=hf vs engine=llamacpp.

    python bench/engines.py [--prompts 3] [--held-out 3] [--max-new-tokens 64] [--trials 32]
                            [--parts A B C] [--out bench/results_engines_cpu.json]

On the embedded default (SmolLM2-135M-Instruct; hf: fp32 + its int8 dynamic self-draft;
llama.cpp: the same weights re-typed to F32 + a Q8_0 self-draft), one run, nothing else on the
machine:

  A. speculative decoding: the grid over γ (1–6) searched by the tuner in each engine (llama.cpp
     at concurrency 1 and 4); the best γ and its held-out speedup per engine and level;
  B. n-gram drafting (method=prompt_lookup): llama.cpp's own n-gram types searched by the tuner
     (heuristic plan) on GSM8K and on Spec-Bench's natural-text summarization items; on held-out
     prompts the tuned setting against llama.cpp's defaults (trial 0) and against no speculation
     (1.0 by definition), at concurrency 1 and 4; and our own prompt lookup's best setting;
  C. vLLM (engine=vllm): speculative decoding with the early-exit draft (the target's first 24
     layers: the one draft vLLM, hf and this pair share; llama.cpp has no early-exit draft), grid
     over γ 1–6 in hf and in vLLM at concurrency 1 and 4; and vLLM's n-gram drafting (γ,
     prompt_lookup_min/max) tuned vs vLLM's defaults vs off on the same two tasks as B.
``--parts`` chooses which run (default all); with ``--out`` an existing file keeps the parts not run.
Every figure is a paired ratio against the same engine's non-speculative run on the same
prompts, measured side by side (tuner.measure / tuner.engines).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (1, 4)


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def study(overrides: list[str]) -> dict:
    """A whole tuner study (search + held-out confirmation); its result and wall time."""
    from tuner.run import run
    began = time.perf_counter()
    name = next(o for o in overrides if o.startswith("study_name="))
    print(f"[{time.strftime('%H:%M:%S')}] {name}: running", file=sys.stderr, flush=True)
    with contextlib.redirect_stdout(io.StringIO()):
        result = run(compose(overrides))
    seconds = time.perf_counter() - began
    print(f"[{time.strftime('%H:%M:%S')}] {name}: done in {seconds:.0f} s", file=sys.stderr,
          flush=True)
    return {**result, "study_seconds": seconds}


def held_out(overrides: list[str], params: dict) -> dict:
    """``params`` vs the engine's baseline on the held-out prompts (every level)."""
    from tuner.run import measure_held_out
    return measure_held_out(compose(overrides), params)


def levels(record: dict, prefix: str = "held_out_") -> dict:
    from tuner.measure.figures import Figures
    return {c: Figures.from_flat(record).at_level(f"{prefix}throughput_ratio", c)
            for c in LEVELS}


def part_a(base: list[str]) -> dict:
    grid = ["method=speculative", "search=grid", "search.ranges=full",
            "method.space.num_draft_tokens.high=6", "method.params.num_draft_tokens=4"]
    hf = study([*base, *grid, "study_name=bench-a-hf"])
    engine = ["method=speculative", "engine=llamacpp", "search=grid", "search.ranges=full",
              "~engine.methods.speculative.space",
              "+engine.methods.speculative.space={n_max:{type:int,low:1,high:6}}",
              f"budget.concurrency={list(LEVELS)}", "search.objectives=[throughput_ratio@c1]"]
    llama = study([*base, *engine, "study_name=bench-a-llamacpp"])
    return {"hf": hf_gamma(base, hf, "bench-a-hf"),
            "llamacpp": engine_gamma(base, llama, "bench-a-llamacpp", "n_max")}


def hf_gamma(base: list[str], record: dict, name: str) -> dict:
    """An hf γ study's row: the winner, its held-out speedup, every γ's tuning figure."""
    return {"best_gamma": record["params"]["num_draft_tokens"],
            "held_out_speedup": record["held_out_speedup"],
            "tuning": per_point(base, name, "num_draft_tokens", ["speedup"]),
            "seconds": record["study_seconds"]}


def engine_gamma(base: list[str], record: dict, name: str, knob: str) -> dict:
    """An engine γ study's row (``knob``: the engine's γ): the same, per concurrency level."""
    from tuner.measure.figures import level_key
    return {"best_gamma": record["params"][knob],
            "held_out_throughput_ratio": levels(record),
            "tuning": per_point(base, name, knob,
                                [level_key("throughput_ratio", c) for c in LEVELS]),
            "seconds": record["study_seconds"]}


def per_point(base: list[str], name: str, param: str, keys: list[str]) -> dict:
    """Every completed trial's tuning-prompt figures, by the searched parameter's value."""
    import optuna
    folder = next(o.split("=", 1)[1] for o in base if o.startswith("studies_dir="))
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        f"{folder}/{name}.journal"))
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(
        states=(optuna.trial.TrialState.COMPLETE,))
    return {t.params[param]: {k: t.user_attrs.get(k) for k in keys} for t in trials}


def part_b(base: list[str], task: list[str], name: str) -> dict:
    engine = [*base, *task, "method=prompt_lookup", "engine=llamacpp",
              f"budget.concurrency={list(LEVELS)}", "search.objectives=[throughput_ratio]",
              "search=heuristic"]
    tuned = study([*engine, f"study_name=bench-b-{name}"])
    from tuner.run import default_params
    defaults = default_params(compose(engine))
    default = held_out(engine, defaults)
    ours = study([*base, *task, "method=prompt_lookup", "search=heuristic",
                  f"study_name=bench-b-{name}-hf"])
    return {"llamacpp_tuned": {"params": tuned["params"], "held_out": levels(tuned),
                               "trials": tuned["trials"], "seconds": tuned["study_seconds"]},
            "llamacpp_defaults": {"params": defaults, "held_out": levels(default)},
            "hf_prompt_lookup": {"params": ours["params"],
                                 "held_out_speedup": ours["held_out_speedup"]}}


def part_c(base: list[str], tasks) -> dict:
    """vLLM: the early-exit pair's γ in hf vs vLLM; vLLM's n-gram drafting tuned vs defaults."""
    pair = ["models=smollm2_early_exit", "method=speculative", "search=grid",
            "search.ranges=full"]
    hf = study([*base, "+task=gsm8k", *pair, "method.space.num_draft_tokens.high=6",
                "method.params.num_draft_tokens=3", "study_name=bench-c-hf"])
    engine = ["engine=vllm", f"budget.concurrency={list(LEVELS)}",
              "search.objectives=[throughput_ratio@c1]", "~engine.methods.speculative.space",
              "+engine.methods.speculative.space={num_speculative_tokens:"
              "{type:int,low:1,high:6}}"]
    vllm = study([*base, "+task=gsm8k", *pair, *engine, "study_name=bench-c-vllm"])
    out = {"speculative_gsm8k": {
        "hf": hf_gamma(base, hf, "bench-c-hf"),
        "vllm": engine_gamma(base, vllm, "bench-c-vllm", "num_speculative_tokens")}}
    for name, task in tasks:
        ngram = [*base, *task, "method=prompt_lookup", "engine=vllm", "models=smollm2",
                 f"budget.concurrency={list(LEVELS)}", "search.objectives=[throughput_ratio]",
                 "search=heuristic"]
        tuned = study([*ngram, f"study_name=bench-c-{name}"])
        from tuner.run import default_params
        defaults = default_params(compose(ngram))
        out[f"ngram_{name}"] = {
            "vllm_tuned": {"params": tuned["params"], "held_out": levels(tuned),
                           "trials": tuned["trials"], "seconds": tuned["study_seconds"]},
            "vllm_defaults": {"params": defaults, "held_out": levels(held_out(ngram, defaults))}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--held-out", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=32, help="search.n_trials per study")
    parser.add_argument("--parts", nargs="+", default=["A", "B", "C"], choices=["A", "B", "C"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    base = ["budget=full", f"task.n_prompts={args.prompts}", f"task.n_held_out={args.held_out}",
            f"task.max_new_tokens={args.max_new_tokens}", "tracking=none", "warmup_prompts=1",
            f"studies_dir={folder}", f"search.n_trials={args.trials}"]
    began = time.perf_counter()
    kept = json.loads(args.out.read_text()) if args.out and args.out.is_file() else {}
    results = {**kept, "machine": platform.processor() or platform.machine(), "cpu": _cpu()}
    tasks = (("gsm8k", ["+task=gsm8k"]),
             ("summarization", ["+task=specbench", "task.categories=[summarization]"]))
    if "A" in args.parts:
        results["A_speculative_gsm8k"] = part_a([*base, "+task=gsm8k"])
    if "B" in args.parts:
        for name, task in tasks:
            results[f"B_ngram_{name}"] = part_b(base, task, name)
    if "C" in args.parts:
        results["C_vllm"] = part_c(base, tasks)
    results[f"args_{''.join(args.parts)}"] = vars(args) | {"out": str(args.out)}
    results[f"seconds_{''.join(args.parts)}"] = time.perf_counter() - began
    text = json.dumps(results, indent=1, default=str)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def _cpu() -> str:
    for line in open("/proc/cpuinfo", encoding="utf-8"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
