"""How often does the paired pruner prune a trial it should not? Resampled from measured tables.

    python bench/pruner_resample.py bench/results_search_ouroboros_cpu.json \
        bench/results_search_speculative_cpu.json [--prompts 3] [--draws 4000] \
        [--retest-sd 0.03] [--json bench/results_pruner_resample_cpu.json]

Each JSON is ``bench/tuner_search.py``'s: a grid's points with their per-prompt paired speedups
(``points[].per_prompt``: every point measured on the same tuning prompts). One draw is one
moment of a study at ``--prompts`` prompts (``budget=auto``: 3):

  1. the study's prompts: ``--prompts`` of the table's, drawn at random;
  2. the trials already completed: a random subset of 2 or more of the other points (their values
     on the drawn prompts; the best of them is the best trial);
  3. a candidate point, measured prompt by prompt in a random order, the pruner
     (``tuner.search.pruners.PairedPruner``, Optuna's own ``should_prune`` on an in-memory
     study) asked after every prompt but the last, as ``tuner.study.objective`` asks it.

The candidate is *in fact within 2 %* when its geometric mean over the drawn prompts is at least
0.98 × the best trial's; a prune of such a candidate is a false prune. Reported per table and
over all: the false-prune rate among such candidates (with a 95 % Wilson interval), and the
prune rate of candidates at most 0.90 × and at most 0.80 × the best (the pruner's power), at
which prompt it pruned. With ``--retest-sd`` (e.g. 0.03: the per-prompt test–retest spread of a
paired speedup
measured here), the candidate's observed values also carry that much fresh log-normal noise,
as a re-measurement would: truth stays the table's value.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tuner.search.pruners import PairedPruner  # noqa: E402

DIST = optuna.distributions.IntDistribution(0, 10_000)


def geomean(values):
    return math.exp(statistics.fmean(math.log(v) for v in values))


def draw(points, prompts, rng, pruner, retest_sd):
    """One draw (module docstring): (ratio to best, pruned at prompt n or None)."""
    steps = rng.sample(sorted(points[0]["per_prompt"]), prompts)
    order = rng.sample(range(len(points)), len(points))
    candidate, others = points[order[0]], [points[i] for i in order[1:]]
    done = others[:rng.randint(2, len(others))]
    value = {id(p): geomean([p["per_prompt"][s] for s in steps]) for p in [candidate, *done]}
    best = max(done, key=lambda p: value[id(p)])
    study = optuna.create_study(direction="maximize", pruner=pruner)
    for i, p in enumerate(done):
        study.add_trial(optuna.trial.create_trial(
            params={"point": i}, distributions={"point": DIST}, value=value[id(p)],
            intermediate_values={s: p["per_prompt"][s] for s in steps}))
    trial = study.ask({"point": DIST})
    measured = rng.sample(steps, len(steps))
    pruned_at = None
    for n, step in enumerate(measured, 1):
        observed = candidate["per_prompt"][step]
        if retest_sd:
            observed *= math.exp(rng.gauss(0.0, retest_sd))
        trial.report(observed, step)
        if n < len(measured) and trial.should_prune():
            pruned_at = n
            break
    study.tell(trial, state=optuna.trial.TrialState.PRUNED if pruned_at else
               optuna.trial.TrialState.FAIL)
    return value[id(candidate)] / value[id(best)], pruned_at


def wilson(k, n, z=1.96):
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarise(draws):
    near = [(r, n) for r, n in draws if r >= 0.98]
    worse = [(r, n) for r, n in draws if r <= 0.90]
    far = [(r, n) for r, n in draws if r <= 0.80]
    false = sum(n is not None for _, n in near)
    power = sum(n is not None for _, n in worse)
    pruned_far = sum(n is not None for _, n in far)
    return {"draws": len(draws), "near_ties": len(near), "false_prunes": false,
            "false_prune_rate": false / len(near) if near else None,
            "false_prune_95": wilson(false, len(near)),
            "clearly_worse": len(worse), "pruned_worse": power,
            "power": power / len(worse) if worse else None,
            "far_behind": len(far), "pruned_far": pruned_far,
            "power_far": pruned_far / len(far) if far else None,
            "pruned_at": {str(k): sum(n == k for _, n in draws) for k in
                          sorted({n for _, n in draws if n is not None})}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="+", type=Path)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--retest-sd", type=float, default=0.0)
    parser.add_argument("--margin", type=float, default=0.02)
    parser.add_argument("--alpha", type=float, default=0.025)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    pruner = PairedPruner(margin=args.margin, alpha=args.alpha)
    rng = random.Random(args.seed)
    report, every = {"prompts": args.prompts, "retest_sd": args.retest_sd,
                     "margin": args.margin, "alpha": args.alpha, "tables": {}}, []
    for path in args.tables:
        data = json.loads(path.read_text())
        points = [{"per_prompt": {int(k): float(v) for k, v in p["per_prompt"].items()}}
                  for p in data["points"] if p.get("per_prompt")]
        if len(points) < 4 or len(points[0]["per_prompt"]) < args.prompts:
            print(f"{path}: too few points or prompts; skipped")
            continue
        draws = [draw(points, args.prompts, rng, pruner, args.retest_sd)
                 for _ in range(args.draws)]
        every += draws
        report["tables"][str(path)] = row = summarise(draws)
        print(f"{path.name}: {row['false_prunes']} false prunes of {row['near_ties']} trials "
              f"within 2 % of the best ({fmt(row['false_prune_rate'])}, 95 % "
              f"{fmt(row['false_prune_95'][0])}–{fmt(row['false_prune_95'][1])}); pruned "
              f"{row['pruned_worse']} of {row['clearly_worse']} at most 0.90x the best "
              f"({fmt(row['power'])}), {row['pruned_far']} of {row['far_behind']} at most "
              f"0.80x ({fmt(row['power_far'])}); pruned at prompt {row['pruned_at']}")
    report["all"] = row = summarise(every)
    print(f"all: false-prune rate {fmt(row['false_prune_rate'])} (95 % "
          f"{fmt(row['false_prune_95'][0])}–{fmt(row['false_prune_95'][1])}, "
          f"{row['near_ties']} near ties), power {fmt(row['power'])} at 0.90x the best, "
          f"{fmt(row['power_far'])} at 0.80x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def fmt(x):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f} %"


if __name__ == "__main__":
    main()
