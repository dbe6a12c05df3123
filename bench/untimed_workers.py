"""The ranking's untimed runs in the study's process against on every core, side by side.

    python bench/untimed_workers.py --profile P.json --json bench/results_untimed_workers_cpu.json

One process loads the embedded default pair once (GSM8K, 4 tuning prompts x 48 tokens, greedy,
as `make tune`'s members are ranked: each member's heuristic grid by Algorithm 1's sweep,
``search.untimed=sweep``), then ranks each member whose points need untimed runs (Ouroboros,
lookahead, SpecInfer) alternately with ``search.untimed_workers=1`` (the study's process, at the
study's threads) and ``auto`` (one one-thread worker per CPU: ``tuner/predict/workers.py``),
``--rounds`` times, the order flipped each round. Reported per member: each ranking's seconds,
the median ratio (in process over workers), and whether the two gave the same predictions and
cuts (they must: at T = 0 the runs' steps do not depend on the thread count). Check ``uptime``
first: nothing else may run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--members", nargs="+", default=["ouroboros", "lookahead", "specinfer"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from tuner.engines.inprocess import HFEvaluator
    from tuner.measure.timing import time_generation
    from tuner.predict.surface import load_profile
    from tuner.search.plans import GridPlan
    from tuner.study.settings import StudySettings
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+task=gsm8k", "method=ouroboros", "search=grid",
                                           f"task.n_prompts={args.prompts}",
                                           f"task.max_new_tokens={args.tokens}",
                                           "tracking=none"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    settings = StudySettings.from_config(cfg)
    evaluator = HFEvaluator(settings.measuring, time_generation, lambda line: None)
    evaluator.open()
    profile = load_profile(args.profile)
    load = os.getloadavg()[0]
    out = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_before": load,
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "prompts": args.prompts, "tokens": args.tokens, "members": {}}
    for name in args.members:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            member = compose("config", overrides=["+task=gsm8k", f"method={name}",
                                                  "search=grid"])
        from omegaconf import OmegaConf
        method_cfg = OmegaConf.to_container(member.method, resolve=True)
        space = method_cfg.get("space") or {}
        default = {k: v for k, v in method_cfg["params"].items() if k in space}
        points = GridPlan(space, default, "heuristic", settings.task.task_class).points
        row = {"points": len(points), "in_process_s": [], "workers_s": [], "same": True}
        first = None
        for r in range(args.rounds):
            for workers in ((1, "auto") if r % 2 == 0 else ("auto", 1)):
                ranker = evaluator.ranker().for_method(
                    method_cfg, lambda p, m=method_cfg: evaluator.build(m, p))
                count = 1 if workers == 1 else max(1, len(os.sched_getaffinity(0)))
                ranker.settings = replace(ranker.settings, untimed="sweep",
                                          untimed_workers=count)
                ranker.profile, ranker.say = profile, lambda line: None
                began = time.perf_counter()
                got = ranker.rank_points(points, list(settings.tuning))
                seconds = time.perf_counter() - began
                row["in_process_s" if workers == 1 else "workers_s"].append(round(seconds, 1))
                first = first or got
                row["same"] = row["same"] and got == first
                print(f"{name}: {len(points)} points, untimed_workers={workers}: {seconds:.1f} s",
                      flush=True)
        row["ratio"] = round(statistics.median(row["in_process_s"]) /
                             statistics.median(row["workers_s"]), 3)
        print(f"{name}: in process / workers = {row['ratio']:.2f}x; the same predictions and "
              f"cuts: {row['same']}", flush=True)
        out["members"][name] = row
    evaluator.close()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
