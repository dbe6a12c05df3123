"""The ranking's untimed runs in the study's process against on every core, side by side.

    python bench/untimed_workers.py --profile P.json --json bench/results_untimed_workers_cpu.json

Per member whose points need untimed runs (Ouroboros, lookahead, SpecInfer), one process loads
the embedded default pair once (GSM8K, 4 tuning prompts x 48 tokens, greedy; its heuristic grid
ranked by Algorithm 1's sweep, ``search.untimed=sweep``, as ``make tune`` ranks its members:
``tuner.run.ranking_of``), then ranks it alternately with ``search.untimed_workers=1`` (the
study's process, at the study's threads) and one one-thread worker per CPU
(``tuner/predict/workers.py``), ``--rounds`` times, the order flipped each round. Reported per
member: each ranking's seconds, the ratio of the medians (in process over workers), and whether
the two gave the same predictions and cuts (they must: at T = 0 the runs' steps do not depend
on the thread count). Check ``uptime`` first: nothing else may run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def config(member: str, profile: Path, prompts: int, tokens: int):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "+task=gsm8k", f"method={member}", "search=predict", f"search.profile={profile}",
            "search.untimed=sweep", f"task.n_prompts={prompts}",
            f"task.max_new_tokens={tokens}", "tracking=none"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--members", nargs="+", default=["ouroboros", "lookahead", "specinfer"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from tuner.run import ranking_of
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_before": os.getloadavg()[0], "cpus": cpus,
           "machine": platform.processor() or platform.machine(),
           "prompts": args.prompts, "tokens": args.tokens, "members": {}}
    for name in args.members:
        with ranking_of(config(name, args.profile.resolve(), args.prompts, args.tokens)) as \
                (points, rank):
            row = {"points": points, "in_process_s": [], "workers_s": [], "same": True}
            first = None
            for r in range(args.rounds):
                for workers in ((1, cpus) if r % 2 == 0 else (cpus, 1)):
                    began = time.perf_counter()
                    got = rank(workers)
                    seconds = time.perf_counter() - began
                    row["in_process_s" if workers == 1 else "workers_s"].append(round(seconds, 1))
                    first = first or got
                    row["same"] = row["same"] and got == first
                    print(f"{name}: {points} points, untimed_workers={workers}: {seconds:.1f} s",
                          flush=True)
        row["ratio"] = round(statistics.median(row["in_process_s"]) /
                             statistics.median(row["workers_s"]), 3)
        print(f"{name}: in process / workers = {row['ratio']:.2f}x; the same predictions and "
              f"cuts: {row['same']}", flush=True)
        out["members"][name] = row
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
