"""`make tune` as a user waits for it: today's single-method main job against the study across
methods that replaced it, measured one after the other in one run on a quiet machine.

    python bench/what_to_deploy.py --work /tmp/bench-deploy --json bench/results_what_to_deploy_cpu.json

Three real ``python -m tuner +task=gsm8k`` processes, each in its own empty folder (MLflow on, as
``make tune`` runs it), in this order:

  1. ``method=ouroboros search=heuristic``: the main job before (Ouroboros, Algorithm 1);
  2. the main job now (``method=auto``), with an empty profile cache: the profile is made on
     first use, inside this time;
  3. the main job now again, in a fresh folder with the cache step 2 filled: the profile reused.
  4. (``--runs ... 4``) run 3 again with the ranking's untimed runs in the study's own process
     (``search.untimed_workers=1``): what the untimed workers save, side by side.

Reported per run: the process's wall time, the phases the study recorded
(``phase_seconds``: models loaded, ranking, trials, held-out confirmation), the trials, the
answer (method and settings, or vanilla) and its held-out speedup, and for the study across
methods each method's row. The goals (issue 62): run 2 at most 2x run 1, run 3 at most 1.2x.
Check ``uptime`` first: nothing else may run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parents[1]
RUNS = [("before: method=ouroboros search=heuristic", ["method=ouroboros", "search=heuristic"],
         False),
        ("now: method=auto, the profile made on first use", [], True),
        ("now: method=auto again, the profile reused", [], False),
        ("control: method=auto again, untimed runs in the study's own process",
         ["search.untimed_workers=1"], False)]


def one(label: str, overrides: list[str], folder: Path, cache: Path, fresh_cache: bool,
        extra: list[str], task: str = "gsm8k") -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    if fresh_cache and cache.exists():
        for path in cache.glob("*.json"):
            path.unlink()
    env = {**os.environ, "SPECTUNE_PROFILES": str(cache), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "tuner", f"+task={task}", *overrides, *extra]
    began = time.perf_counter()
    done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    (folder / "out.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{label}: exit {done.returncode}\n{done.stderr[-3000:]}")
    [outcome_path] = list((folder / "studies" / "best").glob("*.outcome.json"))
    outcome = json.loads(outcome_path.read_text())
    name = outcome["study"]
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(folder / "studies" / f"{name}.journal")))
    study = optuna.load_study(study_name=name, storage=storage)
    phases = {k: round(sum(v), 1) for k, v in (study.user_attrs.get("phase_seconds") or
                                                {}).items()}
    ranking = sum(float(t.user_attrs.get("ranking_s") or 0) for t in study.trials)
    profile = study.user_attrs.get("profile_used") or {}
    return {"label": label, "argv": argv[2:], "wall_s": round(wall, 1), "phases_s": phases,
            "ranking_s": round(ranking, 1),
            "profile_made_s": profile.get("seconds") if profile.get("made_now") else None,
            "trials": len(study.trials), "study": name, "method": outcome["method"],
            "params": (outcome.get("winner") or {}).get("params"),
            "held_out_speedup": outcome["confirmed"].get("held_out_speedup"),
            "recommendation": outcome["recommendation"], "methods": outcome.get("methods", []),
            "summary_tail": [line for line in done.stdout.splitlines()
                             if line.startswith(("method ", "time ", "RECOMMENDATION"))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--override", action="append", default=[],
                        help="appended to every run (e.g. tracking=none)")
    parser.add_argument("--task", default="gsm8k")
    parser.add_argument("--before", nargs="+", default=RUNS[0][1],
                        help="the single-method job to compare with (run 1's overrides)")
    parser.add_argument("--runs", nargs="+", type=int, default=[1, 2, 3],
                        help="which runs (1: before, 2: profile made, 3: reused, 4: reused, "
                             "untimed runs in the study's process)")
    args = parser.parse_args()
    cache = args.work / "profiles"
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load = os.getloadavg()[0]
    rows = []
    for i, (label, overrides, fresh) in enumerate(RUNS):
        if i + 1 not in args.runs:
            continue
        if i == 0:
            label, overrides = f"before: {' '.join(args.before)}", list(args.before)
        row = one(label, overrides, args.work / f"run{i + 1}", cache, fresh, args.override,
                  args.task)
        rows.append(row)
        print(f"{label}: {row['wall_s']:.0f} s, {row['trials']} trials, method "
              f"{row['method']}, held out {row['held_out_speedup']}", flush=True)
    walls = dict(zip(args.runs, (row["wall_s"] for row in rows)))
    result = {"started": started, "load_before": load, "task": args.task,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "runs": rows, "ratios": {
                  name: round(walls[run] / walls[1], 3)
                  for name, run in (("first_over_before", 2), ("second_over_before", 3))
                  if 1 in walls and run in walls}}
    print(json.dumps(result["ratios"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
