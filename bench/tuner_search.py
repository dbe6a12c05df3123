"""Benchmark of what a user waits for: every search run for real, end to end, on one grid.

    python bench/tuner_search.py --method ouroboros --range num_draft_tokens=2:5 \
        --range window=14:15 --range phrase_length=6:7 --profile profiles/smollm2-cpu.json \
        --tpe-trials 8 --retest 3 --work /tmp/bench-search \
        --json bench/results_search_ouroboros_cpu.json

Every search (grid, heuristic, TPE with the paired pruner, TPE without pruning, search=predict)
is one ``python -m tuner +task=gsm8k method=<m> budget=full task.n_prompts=4 task.n_held_out=2
task.max_new_tokens=32`` process on the same narrowed space (each ``--range`` sets the
parameter's space and its heuristic range alike, and a parameter given none is narrowed to its
GSM8K heuristic range, so the grid, the heuristic, the TPE sampler and search=predict all search
the same points), one after the other on a quiet machine. Reported per
search:

  * **end to end**: the process's wall time, as a user waits for it (imports, model load, the
    ranking, trials, the finish with its held-out confirmation); search=predict's profile is
    made once per machine (``--profile``; its making time is reported beside, from the profile
    run when ``--make-profile`` makes it here);
  * **the search's own time**: end to end minus what every search pays alike, the model load
    (``phase_seconds.open_s``) and the held-out confirmation (``held_out_s``), both recorded by
    the study itself;
  * trials run (pruned ones counted), the winner and its held-out speedup, beside the grid
    winner's held-out speedup and its test–retest spread (``--retest`` fresh replays of the grid
    winner, ``python -m tuner ... +best=<grid study>``: min, max and the spread of the held-out
    measurement itself).

A second, labelled column replays heuristic, TPE and search=predict on the grid study's measured
table (``replay_*``: no run-to-run noise, each point's time as the grid measured it; predict
ranks by the grid trials' own predictions when the grid ran with ``--grid-profile``). The grid's
per-prompt paired speedups are written to the JSON (``points[].per_prompt``) for
``bench/pruner_resample.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tuner.search.plans import HeuristicPlan, PredictPlan, point_key  # noqa: E402
from tuner.search.space import search_values  # noqa: E402

BASE = ["+task=gsm8k", "budget=full", "task.n_prompts=4", "task.n_held_out=2",
        "task.max_new_tokens=32", "tracking=none"]


# -- the real searches ----------------------------------------------------------------------------

def range_overrides(ranges: list[str], method: dict) -> list[str]:
    """``name=lo:hi`` (an int range) or ``name=a,b,c`` (values): the space and its heuristic
    range (both task classes) narrowed alike."""
    out = []
    for item in ranges:
        name, _, value = item.partition("=")
        spec = method["space"][name]
        if spec.get("type") == "int":
            lo, _, hi = value.partition(":")
            out += [f"method.space.{name}.low={lo}", f"method.space.{name}.high={hi}",
                    f"method.space.{name}.heuristic.LH=[{lo},{hi}]",
                    f"method.space.{name}.heuristic.HH=[{lo},{hi}]"]
        else:
            values = value.split(",")
            listed = "[" + ",".join(values) + "]"
            if spec.get("type") == "categorical":
                out.append(f"method.space.{name}.choices={listed}")
            out += [f"method.space.{name}.heuristic.LH={listed}",
                    f"method.space.{name}.heuristic.HH={listed}"]
    return out


def run_tuner(work: Path, name: str, overrides: list[str], log: Path) -> float:
    """One ``python -m tuner`` process in ``work``; its wall time (its output goes to ``log``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "tuner", *BASE, f"study_name={name}", *overrides]
    start = time.perf_counter()
    with log.open("w") as out:
        out.write(" ".join(command) + "\n")
        out.flush()
        done = subprocess.run(command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}): see {log}")
    return seconds


def load_study(work: Path, name: str) -> optuna.Study:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(work / "studies" / f"{name}.journal")))
    return optuna.load_study(study_name=name, storage=storage)


def search_record(work: Path, name: str, wall: float) -> dict:
    """What one real search cost and found."""
    study = load_study(work, name)
    phases = study.user_attrs.get("phase_seconds") or {}
    opened = sum(phases.get("open_s", []))
    held_out = sum(phases.get("held_out_s", []))
    best = yaml.safe_load((work / "studies" / "best" / f"{name}.yaml").read_text())
    replay = best.get("replay") or {}
    trials = study.get_trials(deepcopy=False)
    winner = next(t for t in trials if t.number == replay.get("trial"))
    return {"study": name, "end_to_end_s": wall, "open_s": opened, "held_out_s": held_out,
            "search_s": wall - opened - held_out,
            "ranking_s": sum(float(t.user_attrs.get("ranking_s") or 0) for t in trials),
            "trials": sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials),
            "pruned": sum(t.state == TrialState.PRUNED for t in trials),
            "winner": dict(winner.params), "winner_tuning": replay.get("tuning_speedup"),
            "winner_held_out": replay.get("held_out_speedup"),
            "profile_check": study.user_attrs.get("profile_check"),
            "estimates": study.user_attrs.get("estimates"),
            "race_stopped": study.user_attrs.get("race_stopped"),
            "dropped_at": {t.number: t.user_attrs.get("pruned_at") for t in trials
                           if t.state == TrialState.PRUNED},
            "search_wall_s": sum(phases.get("search_s", []))}


def retest(work: Path, grid: str, method: str, n: int, log: Path) -> list[float]:
    """``n`` fresh held-out measurements of the grid's winner (``+best=<grid study>``: the
    study's own models, budget and prompts, from its best YAML)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    values = []
    for i in range(n):
        command = [sys.executable, "-m", "tuner", "+task=gsm8k", f"method={method}",
                   f"+best={grid}", "tracking=none"]
        with log.open("a") as out:
            done = subprocess.run(command, cwd=work, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
            out.write(done.stdout)
        line = next((x for x in done.stdout.splitlines()
                     if x.startswith("replay: held-out speedup ")), None)
        if done.returncode or line is None:
            raise SystemExit(f"replay {i + 1} of {grid} failed: see {log}")
        values.append(float(line.split()[3].rstrip("x")))
    return values


# -- the replays on the grid's table (the labelled second column) ---------------------------------

def load_table(study: optuna.Study) -> dict:
    table = {}
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        predicting = float(t.user_attrs.get("prediction_s") or 0.0)
        seconds = (t.datetime_complete - t.datetime_start).total_seconds() - predicting
        table[point_key(t.params)] = {"value": t.values[0], "seconds": seconds,
                                      "per_prompt": {int(k): v for k, v in
                                                     t.intermediate_values.items()},
                                      "predicted": t.user_attrs.get("predicted_speedup"),
                                      "prediction_s": predicting,
                                      "by_replay": t.user_attrs.get("predicted_by_replay"),
                                      "stage": t.user_attrs.get("stage")}
    return table


def replay_heuristic(table, space, default, task_class, seed):
    results = {point_key(default): table[point_key(default)]["value"]}
    seconds = table[point_key(default)]["seconds"]
    plan = HeuristicPlan(space, task_class, seed, default)
    while (step := plan.next_point(results)) is not None:
        key = point_key(step[0])
        results[key] = table[key]["value"]
        seconds += table[key]["seconds"]
    return max(results, key=results.get), seconds, len(results)


def replay_tpe(table, space, default, task_class, seed, n_trials, prune=True):
    """TPE over the table's points (integer and categorical parameters), pruned by the paired
    pruner on the recorded per-prompt values in a seeded order."""
    from tuner.search.pruners import PairedPruner
    values = search_values(space, "heuristic", task_class)
    dists = {k: (optuna.distributions.IntDistribution(min(v), max(v)) if all(
        isinstance(x, int) and not isinstance(x, bool) for x in v) else
        optuna.distributions.CategoricalDistribution(v)) for k, v in values.items()}
    study = optuna.create_study(direction="maximize",
                                pruner=PairedPruner() if prune else optuna.pruners.NopPruner(),
                                sampler=optuna.samplers.TPESampler(seed=seed))
    study.enqueue_trial(default)
    seconds, complete = 0.0, {}
    for number in range(n_trials):
        trial = study.ask(dists)
        row = table.get(point_key(trial.params))
        if row is None:                          # a point the grid did not hold
            study.tell(trial, state=TrialState.FAIL)
            continue
        steps = sorted(row["per_prompt"])
        random.Random(f"{seed}-{number}").shuffle(steps)
        measured = []
        for step in steps:
            measured.append(row["per_prompt"][step])
            trial.report(row["per_prompt"][step], step)
            if len(measured) < len(steps) and trial.should_prune():
                break
        seconds += row["seconds"] * len(measured) / len(steps)
        if len(measured) < len(steps):
            study.tell(trial, state=TrialState.PRUNED)
            continue
        study.tell(trial, statistics.geometric_mean(measured))
        complete[point_key(trial.params)] = row["value"]
    return max(complete, key=complete.get), seconds, n_trials


def replay_predict(table, space, default, task_class, top, spread):
    """search=predict on the table: the default measured first, every other point predicted
    (its grid trial's own prediction: each in that trial's order of the prompts, where a real
    search ranks in one order), the chosen points measured."""
    plan = PredictPlan(space, default, "heuristic", task_class, top, spread)
    plan.points = [p for p in plan.points if point_key(p) in table]
    chosen = plan.rank([table[point_key(p)]["predicted"] for p in plan.points])
    seconds = sum(r["prediction_s"] for k, r in table.items() if k != point_key(default))
    seconds += sum(table[point_key(p)]["seconds"] for p, _ in chosen)
    best = max((point_key(p) for p, _ in chosen), key=lambda k: table[k]["value"])
    return best, seconds, len(chosen)


def replays(table, space, default, task_class, seeds, tpe_trials, top, spread) -> dict:
    grid_s = sum(r["seconds"] for r in table.values())
    optimum = max(r["value"] for r in table.values())
    rows = {"heuristic": [replay_heuristic(table, space, default, task_class, s)
                          for s in range(seeds)],
            "tpe (paired pruner)": [replay_tpe(table, space, default, task_class, s,
                                               tpe_trials) for s in range(seeds)],
            "tpe (no pruning)": [replay_tpe(table, space, default, task_class, s, tpe_trials,
                                            prune=False) for s in range(seeds)]}
    if all(r["predicted"] is not None for r in table.values()):
        rows["predict"] = [replay_predict(table, space, default, task_class, top, spread)]
    out = {}
    for label, runs in rows.items():
        out[label] = {"reached": statistics.mean(table[b]["value"] / optimum for b, _, _ in runs),
                      "reached_min": min(table[b]["value"] / optimum for b, _, _ in runs),
                      "time_fraction": statistics.mean(s / grid_s for _, s, _ in runs),
                      "evaluations": statistics.mean(n for _, _, n in runs)}
    return out


def heuristic_ranges(method: dict, ranges: list[str]) -> list[str]:
    """Every parameter not given a ``--range`` narrowed to its GSM8K (LH) heuristic range, so
    that the samplers search the space the grid and the heuristic search (Ouroboros's K: the
    grid holds it at 3, TPE would sample 1-5)."""
    given = {item.partition("=")[0] for item in ranges}
    out = []
    for name, spec in method["space"].items():
        values = (spec.get("heuristic") or {}).get("LH")
        if name in given or not values:
            continue
        if spec.get("type") == "int":
            out.append(f"{name}={min(values)}:{max(values)}")
        else:
            out.append(f"{name}={','.join(str(v) for v in values)}")
    return out


def narrowed_space(method: dict, ranges: list[str]) -> dict:
    """The method's space as ``range_overrides`` narrows it (for the replays)."""
    space = {k: dict(v) for k, v in method["space"].items()}
    for item in ranges:
        name, _, value = item.partition("=")
        spec = space[name]
        if spec.get("type") == "int":
            lo, _, hi = value.partition(":")
            spec.update(low=int(lo), high=int(hi), heuristic={"LH": [int(lo), int(hi)],
                                                              "HH": [int(lo), int(hi)]})
        else:
            values = [yaml.safe_load(v) for v in value.split(",")]
            if spec.get("type") == "categorical":
                spec["choices"] = values
            spec["heuristic"] = {"LH": values, "HH": values}
    return space


# -- main ----------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="ouroboros")
    parser.add_argument("--range", action="append", default=[], dest="ranges",
                        help="name=lo:hi or name=a,b,c (repeat)")
    parser.add_argument("--profile", type=Path, required=True, help="search=predict's profile")
    parser.add_argument("--profile-seconds", type=float, default=None,
                        help="what making --profile took (reported beside search=predict)")
    parser.add_argument("--grid-profile", action="store_true",
                        help="the grid study records predictions too (for the predict replay)")
    parser.add_argument("--tpe-trials", type=int, default=8)
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--spread", type=int, default=2)
    parser.add_argument("--retest", type=int, default=3)
    parser.add_argument("--retest-values", nargs="*", default=[],
                        help="with --tag: the grid winner's re-runs that run printed")
    parser.add_argument("--seeds", type=int, default=10, help="replays: seeds")
    parser.add_argument("--searches", nargs="+",
                        default=["grid", "heuristic", "tpe", "tpe_unpruned", "predict"],
                        help="from grid, heuristic, heuristic_unraced, tpe, tpe_unpruned, "
                             "predict (raced), predict_sweep (raced, untimed points ranked by "
                             "Algorithm 1 on the predictions; its untimed runs on every core), "
                             "predict_sweep_one (the same in the study's own process), "
                             "predict_unraced (top + spread)")
    parser.add_argument("--override", action="append", default=[],
                        help="a further tuner override for every search (e.g. models=tiny)")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--tag", default=None,
                        help="go on with an interrupted run: its tag (``<method>-<time>``)")
    parser.add_argument("--walls", nargs="*", default=[], metavar="SEARCH=SECONDS",
                        help="with --tag: searches already finished, read back from their "
                             "studies, with the end-to-end seconds that run printed")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    method = yaml.safe_load((ROOT / "conf" / "method" / f"{args.method}.yaml").read_text())
    args.work.mkdir(parents=True, exist_ok=True)
    args.ranges += heuristic_ranges(method, args.ranges)
    narrow = [f"method={args.method}", *range_overrides(args.ranges, method), *args.override]
    profile = str(args.profile.resolve())
    searches = {
        "grid": ["search=grid", "search.ranges=heuristic", "search.n_trials=1000"] +
                ([f"search.profile={profile}"] if args.grid_profile else []),
        "heuristic": ["search=heuristic"],
        "heuristic_unraced": ["search=heuristic", "search.race=null"],
        "tpe": ["search=tpe", f"search.n_trials={args.tpe_trials}"],
        "tpe_unpruned": ["search=tpe", f"search.n_trials={args.tpe_trials}",
                         "search.pruner=null"],
        "predict": ["search=predict", f"search.profile={profile}"],
        "predict_sweep": ["search=predict", f"search.profile={profile}", "search.untimed=sweep"],
        "predict_sweep_one": ["search=predict", f"search.profile={profile}",
                              "search.untimed=sweep", "search.untimed_workers=1"],
        "predict_unraced": ["search=predict", f"search.profile={profile}", "search.race=null",
                            f"search.top={args.top}", f"search.spread={args.spread}"]}
    tag = args.tag or f"{args.method}-{int(time.time())}"
    walls = {name: float(seconds) for name, seconds in
             (item.split("=", 1) for item in args.walls)}
    results = {"method": args.method, "ranges": args.ranges, "base": BASE,
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "profile": {"path": str(args.profile), "made_s": args.profile_seconds},
               "searches": {}, "read_back": sorted(walls)}
    for name in args.searches:
        study = f"{tag}-{name}"
        print(f"# {name}: {study} ...", flush=True)
        wall = walls.get(name) or run_tuner(args.work, study, [*narrow, *searches[name]],
                                            args.work / f"{study}.log")
        results["searches"][name] = record = search_record(args.work, study, wall)
        print(f"  end to end {wall:.0f} s, search {record['search_s']:.0f} s, "
              f"{record['trials']} trials ({record['pruned']} pruned), winner "
              f"{record['winner']} held out {record['winner_held_out']:.3f}x", flush=True)
    if "grid" in results["searches"]:
        grid = results["searches"]["grid"]
        if args.retest_values:             # read back from an earlier run's log
            grid["retest_held_out"] = [float(v) for v in args.retest_values]
        elif args.retest:
            values = retest(args.work, grid["study"], args.method, args.retest,
                            args.work / f"{tag}-retest.log")
            grid["retest_held_out"] = values
            print(f"  grid winner held out again: {values}")
        table = load_table(load_study(args.work, grid["study"]))
        space = narrowed_space(method, args.ranges)
        default = {k: method["params"][k] for k in space}
        for item in args.override:         # a default moved by --override method.params.k=v
            name, _, value = item.partition("=")
            if name.startswith("method.params.") and name[len("method.params."):] in default:
                default[name[len("method.params."):]] = yaml.safe_load(value)
        results["replay"] = replays(table, space, default, "LH", args.seeds, args.tpe_trials,
                                    args.top, args.spread)
        results["points"] = [{"params": dict(k), **r} for k, r in table.items()]
        best = max(r["value"] for r in table.values())
        for record in results["searches"].values():     # the winner by the grid's own table
            row = table.get(point_key(record["winner"]))
            record["reached"] = None if row is None else row["value"] / best
            record["search_fraction"] = record["search_s"] / grid["search_s"]
    print(table_text(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


def table_text(results: dict) -> str:
    """The end-to-end table (markdown)."""
    searches = results["searches"]
    grid = searches.get("grid")
    lines = ["| search | trials (pruned) | end to end | search's own time | model load | "
             "held-out | winner | held-out speedup |", "|---|---|---|---|---|---|---|---|"]
    for name, r in searches.items():
        share = f" ({100 * r['search_s'] / grid['search_s']:.0f} % of the grid's)" \
            if grid else ""
        reached = f" ({100 * r['reached']:.1f} % of the grid's best)" \
            if r.get("reached") is not None else ""
        lines.append(f"| {name} | {r['trials']} ({r['pruned']}) | {r['end_to_end_s']:.0f} s | "
                     f"{r['search_s']:.0f} s{share} | {r['open_s']:.0f} s | "
                     f"{r['held_out_s']:.0f} s | {r['winner']}{reached} | "
                     f"{r['winner_held_out']:.3f}x |")
    if grid and grid.get("retest_held_out"):
        values = grid["retest_held_out"]
        lines.append(f"\ngrid winner held out again {len(values)}x: "
                     + ", ".join(f"{v:.3f}x" for v in values)
                     + f" (spread {max(values) / min(values) - 1:.1%})")
    for name, r in searches.items():
        first = (r.get("estimates") or {}).get("after_first_trial")
        if first and r.get("search_wall_s"):
            total = first["elapsed_s"] + first["left_s"]
            lines.append(f"{name}: estimated after its first trial {total:.0f} s, took "
                         f"{r['search_wall_s']:.0f} s ({total / r['search_wall_s'] - 1:+.0%})")
    for label, r in (results.get("replay") or {}).items():
        lines.append(f"replay on the grid's table, {label}: {100 * r['reached']:.1f} % of the "
                     f"grid's optimum (min {100 * r['reached_min']:.1f} %) at "
                     f"{100 * r['time_fraction']:.1f} % of its trials' time")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
