"""Benchmark of the tuner's searches: heuristic vs grid vs TPE with Wilcoxon pruning.

1. Measure the full grid once, on real wall-clock, with the tuner itself::

       python -m tuner +task=gsm8k method=ouroboros search=grid budget=full task.n_prompts=4 \
           task.max_new_tokens=12 tracking=none study_name=bench-grid search.n_trials=200

2. Replay the other searches on that measured table::

       python bench/tuner_search.py --journal studies/bench-grid.journal [--tpe-trials 20]

With ``search.profile=<profile>`` on the grid study every trial also records its predicted
speedup and the seconds its prediction took (``prediction_s``: the replay, or the untimed traced
run of a method that does not replay), and ``search=predict`` is replayed too: it pays the
prediction of every grid point, then the measured time of the default, the ``--top`` best
predicted and ``--spread`` spread points, and picks the best measured of them. The prediction's
own seconds are taken out of each grid point's time. ``--ranges-from-table`` rebuilds the
heuristic ranges from the values the grid measured (a grid run with narrowed
``method.space.*.heuristic`` ranges), so every search draws from the same points.

Every grid point has a measured objective (paired geometric-mean speedup over the tuning prompts),
its per-prompt speedups and the wall-clock the tuner spent on it. A replayed search pays the
measured time of each point it evaluates (a pruned trial pays the fraction of prompts it measured)
and ends with the point it would pick (best completed, non-pruned trial). We report the grid value of
that point as a fraction of the grid's optimum, against the fraction of the grid's wall-clock spent.
Replaying on one table removes run-to-run noise from the comparison; the searches' own logic
(``tuner.search.plans.HeuristicPlan``, Optuna's TPESampler + WilcoxonPruner) runs unchanged.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

from tuner.search.plans import HeuristicPlan, PredictPlan, point_key
from tuner.search.space import search_values

ROOT = Path(__file__).resolve().parents[1]


def load_table(journal: Path) -> tuple[dict, str]:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(journal)))
    name = optuna.get_all_study_names(storage)[0]
    study = optuna.load_study(study_name=name, storage=storage)
    table = {}
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        predicting = float(t.user_attrs.get("prediction_s") or 0.0)
        seconds = (t.datetime_complete - t.datetime_start).total_seconds() - predicting
        table[point_key(t.params)] = {"value": t.values[0], "seconds": seconds,
                                      "per_prompt": dict(t.intermediate_values),
                                      "predicted": t.user_attrs.get("predicted_speedup"),
                                      "prediction_s": predicting,
                                      "by_replay": t.user_attrs.get("predicted_by_replay"),
                                      "stage": t.user_attrs.get("stage")}
    return table, name


def ranges_from_table(table, space, default, task_class):
    """The method's space with each parameter's heuristic range set to the values the grid
    measured (the default's own point left out where the grid held it as an extra)."""
    keys = [k for k in table if k != point_key(default)] or list(table)
    out = {}
    for name, spec in space.items():
        values = sorted({dict(k)[name] for k in keys if name in dict(k)})
        spec = dict(spec)
        if values:
            spec["heuristic"] = {**spec.get("heuristic", {}), task_class: [values[0], values[-1]]}
        out[name] = spec
    return out


def replay_predict(table, space, default, task_class, top, spread, history=False):
    """search=predict on the measured table: every point's prediction paid, then the measured
    points (with, for a method whose history carries across prompts, ``history``, each one's
    untimed run again in its trial's order); the pick is the best measured of them. The
    predictions ranked by are the grid trials' own, each made in its trial's order of the
    prompts: a real run ranks in one order (see docs/benchmarks.md)."""
    plan = PredictPlan(space, default, "heuristic", task_class, top, spread)
    points = [p for p in plan.points if point_key(p) in table]
    plan.points = points
    chosen = plan.rank([table[point_key(p)]["predicted"] for p in points])
    if point_key(default) in table and all(point_key(p) != point_key(default) for p, _ in chosen):
        chosen = [(default, "default")] + chosen      # the default, measured first in any case
    seconds = sum(r["prediction_s"] for r in table.values())
    seconds += sum(table[point_key(p)]["seconds"] for p, _ in chosen)
    if history:
        seconds += sum(table[point_key(p)]["prediction_s"] for p, _ in chosen
                       if not table[point_key(p)]["by_replay"])
    best = max((point_key(p) for p, _ in chosen), key=lambda k: table[k]["value"])
    return best, seconds, len(chosen)


def calibration(table):
    """Predicted vs measured over the grid: median |predicted / measured − 1|, Spearman ρ."""
    from tuner.predict.predict import calibration as calibrate
    rows = [(r["predicted"], r["value"]) for r in table.values() if r["predicted"] is not None]
    return calibrate(rows) if rows else None


def replay_heuristic(table, space, default, task_class, seed):
    results = {point_key(default): table[point_key(default)]["value"]}
    seconds = table[point_key(default)]["seconds"]
    plan = HeuristicPlan(space, task_class, seed)
    while (step := plan.next_point(results)) is not None:
        key = point_key(step[0])
        results[key] = table[key]["value"]
        seconds += table[key]["seconds"]
    best = max(results, key=results.get)
    return best, seconds, len(results)


def replay_tpe(table, space, default, task_class, seed, n_trials, prune=True):
    values = search_values(space, "heuristic", task_class)
    dists = {k: optuna.distributions.IntDistribution(min(v), max(v)) for k, v in values.items()}
    pruner = optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=2) if prune \
        else optuna.pruners.NopPruner()
    study = optuna.create_study(direction="maximize", pruner=pruner,
                                sampler=optuna.samplers.TPESampler(seed=seed))
    study.enqueue_trial(default)
    seconds, complete = 0.0, {}
    for number in range(n_trials):
        trial = study.ask(dists)
        key = point_key(trial.params)
        row = table[key]
        steps = sorted(row["per_prompt"])
        random.Random(f"{seed}-{number}").shuffle(steps)
        measured = []
        for step in steps:
            measured.append(row["per_prompt"][step])
            trial.report(row["per_prompt"][step], step)
            if len(measured) < len(steps) and trial.should_prune():
                break
        seconds += row["seconds"] * len(measured) / len(steps)
        value = statistics.geometric_mean(measured)
        study.tell(trial, value)
        if len(measured) == len(steps):
            complete[key] = value
    best = max(complete, key=complete.get)
    return best, seconds, n_trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--journal", type=Path, required=True)
    parser.add_argument("--method", default="ouroboros")
    parser.add_argument("--task-class", default="LH")
    parser.add_argument("--tpe-trials", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--top", type=int, default=3, help="search=predict: best predicted")
    parser.add_argument("--spread", type=int, default=2, help="search=predict: spread points")
    parser.add_argument("--ranges-from-table", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    method = yaml.safe_load((ROOT / "conf" / "method" / f"{args.method}.yaml").read_text())
    space, default = method["space"], {k: method["params"][k] for k in method["space"]}
    table, name = load_table(args.journal)
    if args.ranges_from_table:
        space = ranges_from_table(table, space, default, args.task_class)
    grid_seconds = sum(r["seconds"] for r in table.values())
    optimum = max(r["value"] for r in table.values())
    best_point = max(table, key=lambda k: table[k]["value"])
    print(f"# study {name}: {len(table)} grid points measured in {grid_seconds:.0f} s; optimum "
          f"{optimum:.3f} at {dict(best_point)}; default {table[point_key(default)]['value']:.3f}")
    print(f"{'search':<28} {'evaluations':>11} {'time (of grid)':>15} {'optimum reached':>16}")
    print(f"{'grid (Table 9 style)':<28} {len(table):>11} {'100.0 %':>15} {'100.0 %':>16}")
    rows = {"heuristic (Algorithm 1)": [replay_heuristic(table, space, default, args.task_class,
                                                         seed) for seed in range(args.seeds)]}
    integers = all(isinstance(v, int) and not isinstance(v, bool) for values in search_values(
        space, "heuristic", args.task_class).values() for v in values)
    if integers:                     # the TPE replay draws integer parameters only
        rows[f"TPE + Wilcoxon ({args.tpe_trials})"] = [replay_tpe(
            table, space, default, args.task_class, seed, args.tpe_trials)
            for seed in range(args.seeds)]
        rows[f"TPE, no pruning ({args.tpe_trials})"] = [replay_tpe(
            table, space, default, args.task_class, seed, args.tpe_trials, prune=False)
            for seed in range(args.seeds)]
    calib = calibration(table)
    if calib is not None and all(r["predicted"] is not None for r in table.values()):
        rows[f"search=predict (top {args.top}, spread {args.spread})"] = [replay_predict(
            table, space, default, args.task_class, args.top, args.spread,
            history=bool(method["params"].get("reuse_history", False)))]
    results = {"study": name, "grid_points": len(table), "grid_seconds": grid_seconds,
               "optimum": optimum, "optimum_at": dict(best_point), "searches": {}}
    for label, runs in rows.items():
        reached = [table[best]["value"] / optimum for best, _, _ in runs]
        spent = [seconds / grid_seconds for _, seconds, _ in runs]
        evaluations = statistics.mean(n for _, _, n in runs)
        print(f"{label:<28} {evaluations:>11.1f} {100 * statistics.mean(spent):>13.1f} % "
              f"{100 * statistics.mean(reached):>8.1f} % (min {100 * min(reached):.1f} %)")
        results["searches"][label] = {"evaluations": evaluations,
                                      "time_fraction": statistics.mean(spent),
                                      "reached": statistics.mean(reached),
                                      "reached_min": min(reached)}
    if calib is not None:
        predicting = sum(r["prediction_s"] for r in table.values())
        print(f"prediction over the grid ({len(table)} points): median error "
              f"{100 * calib['median_abs_error']:.1f} %, Spearman "
              f"{calib['spearman'] if calib['spearman'] is None else round(calib['spearman'], 2)}"
              f"; predicting every point took {predicting:.0f} s "
              f"({100 * predicting / grid_seconds:.1f} % of the grid's time)")
        results["calibration"] = calib
        results["prediction_seconds"] = predicting
        results["points"] = [{"params": dict(k), **{f: v for f, v in r.items()
                                                     if f != "per_prompt"}}
                             for k, r in table.items()]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
