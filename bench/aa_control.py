"""The A/A table: vanilla against itself through every measuring path (docs/benchmarks.md).

    python bench/aa_control.py                       # the whole table (~30 min on 2 CPUs)
    python bench/aa_control.py --paths llamacpp --tasks cnndm
    python bench/aa_control.py --out aa.json

One ``python -m tuner.control`` per path and task (``tuner.measure.control``): in process after
each of ``--methods`` ran (the embedded pair), llama.cpp beside prompt lookup's server (ngram-mod,
n-max 8: the setting whose plain baseline showed the prefill gap, with ``--plain`` for the plain
baseline as before), vLLM's two plain servers; GSM8K (short prompts) and CNN/DM (long ones),
``--prompts`` tuning + as many held-out prompts, 32 new tokens, concurrency 1 and 4 and a rate of
2 requests/s in the engines. Prints one markdown row per path, prompt length, place and figure,
with the ratio, its 99 % interval and whether it is within the bound. Run it on a quiet machine
(check ``uptime``): it times for half an hour.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NGRAM_MOD = ["engine.methods.prompt_lookup.params.spec_type=ngram-mod",
             "engine.methods.prompt_lookup.params.mod_n_match=4",
             "engine.methods.prompt_lookup.params.mod_n_min=0",
             "engine.methods.prompt_lookup.params.mod_n_max=8"]
TASKS = {"gsm8k": ["+task=gsm8k"], "cnndm": ["+task=cnndm"]}
ENGINE_LOAD = ["budget.concurrency=[1,4]", "budget.request_rate=[2]",
               "budget.requests_per_rate=8", "engine.ctx_per_slot=3072"]   # CNN/DM: 2,602 tokens


def paths(methods: list[str], plain: bool) -> list[tuple[str, list[str]]]:
    out = [(f"in process after {m}", [f"method={m}"]) for m in methods]
    out.append(("llama.cpp beside prompt lookup (ngram-mod, n-max 8)",
                ["engine=llamacpp", "method=prompt_lookup", *NGRAM_MOD, *ENGINE_LOAD]))
    if plain:
        out.append(("llama.cpp, plain baseline (before)",
                    ["engine=llamacpp", "method=prompt_lookup", *NGRAM_MOD, *ENGINE_LOAD,
                     "engine.baseline=plain"]))
    out.append(("vLLM, two plain servers", ["engine=vllm", "method=vanilla",
                                            "engine.kv_cache_gib=1", *ENGINE_LOAD]))
    return out


def run(label: str, overrides: list[str], task: str, prompts: int, work: Path) -> dict:
    folder = work / f"{len(list(work.iterdir()))}"
    cmd = [sys.executable, "-m", "tuner.control", *TASKS[task], *overrides, "tracking=none",
           f"studies_dir={folder}", f"cpu_budget.n_prompts={prompts}",
           f"cpu_budget.n_held_out={prompts}", "cpu_budget.max_new_tokens=32"]
    print("$ " + " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith("  ")),
          flush=True)
    found = sorted((folder / "control").glob("*.json"))
    if done.returncode not in (0, 1) or len(found) != 1:
        return {"path": label, "task": task, "error": (done.stderr or done.stdout)[-500:]}
    found = found[0]
    return {"path": label, "task": task, "command": " ".join(cmd[1:]),
            **json.loads(found.read_text())}


def table(reports: list[dict]) -> list[str]:
    lines = ["| path | prompts | where | figure | ratio | 99 % interval | n | bound |",
             "|---|---|---|---|---|---|---|---|"]
    for r in reports:
        if "error" in r:
            lines.append(f"| {r['path']} | {r['task']} | | | failed: {r['error'][:80]} | | | |")
            continue
        for row in r["rows"]:
            lines.append(f"| {r['path']} | {r['task']} | {row['at']} | {row['figure']} | "
                         f"{row['ratio']:.3f} | {row['low']:.3f}-{row['high']:.3f} | {row['n']} | "
                         f"{'within' if row['within'] else 'BEYOND'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", default=["hf", "llamacpp", "vllm"],
                        choices=["hf", "llamacpp", "vllm"])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--methods", nargs="+", default=["speculative", "prompt_lookup",
                                                         "ouroboros"],
                        help="in process: the methods that run before each control")
    parser.add_argument("--prompts", type=int, default=6,
                        help="tuning prompts (and as many held-out ones) per control")
    parser.add_argument("--plain", action="store_true",
                        help="llama.cpp with engine.baseline=plain too (the prefill gap)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    kinds = {"in process": "hf", "llama.cpp": "llamacpp", "vLLM": "vllm"}
    chosen = [(label, o) for label, o in paths(args.methods, args.plain)
              if next(k for prefix, k in kinds.items() if label.startswith(prefix)) in args.paths]
    reports = []
    with tempfile.TemporaryDirectory() as scratch:
        for task in args.tasks:
            for label, overrides in chosen:
                reports.append(run(label, overrides, task, args.prompts, Path(scratch)))
    print("\n".join(table(reports)), flush=True)
    if args.out:
        args.out.write_text(json.dumps(reports, indent=1) + "\n")


if __name__ == "__main__":
    main()
