"""The oracle of issue 62: every member's grid measured, against the study across methods.

    python bench/oracle.py --task gsm8k --members speculative block prompt_lookup lookahead \
        specinfer eagle eagle3 --prompts 4 --tokens 32 --held-out 6 --rounds 2 \
        --work /tmp/bench-oracle --json bench/results_oracle_gsm8k_cpu.json

One run on a quiet machine (check ``uptime`` first; nothing else may run), every study one real
``python -m tuner`` process with MLflow off, all on the same prompts (``budget=full``, so nothing
caps them), one after the other:

  1. **the study across methods**: ``method=auto method.members=[...]`` (ranked by one profile,
     made on first use into an empty cache inside this run, then raced: ``search=predict``);
  2. **the oracle**: each member's ``search=grid`` on its heuristic ranges (the grid a user would
     run without this tool), every point measured on every tuning prompt. The oracle's best is
     the grid point with the highest measured tuning speedup across all members' grids;
  3. **one paired held-out re-measurement** of the study's answer and the oracle's best:
     ``+best=<study>`` replays, alternating answer, oracle, answer, oracle (``--rounds`` each),
     on the same ``--held-out`` prompts, each a paired measurement against vanilla. Where both
     are the same point, it is said and measured once per round all the same.

Reported: each study's end-to-end wall time and its search time (end to end minus the model load
and the held-out confirmation every study pays alike, both recorded by the study), the points
ranked and measured, each member's share of the summed grid time, the answer and the oracle's
best, and the re-measured ratio. The goals (issue 62): the answer reaches at least 97 % of the
oracle's best held-out speedup, in at most 10 % of the summed grids' search time (15 % end to
end); where nothing beats vanilla beyond the noise, the answer is vanilla.
A study this script finished in ``--work`` (its wall time and command in ``walls.json``) is not
run again when the script is re-run there with the same command for it (a grid that failed to
start is run after a fix, alone); a study whose command changed is run again.
``--members`` narrows the oracle: members left out are said in the JSON (``left_out``), and the
study across methods spans the same members, so the two answer the same question. ``--grids``
measures the grids of some members only (the rest said in ``grids_not_measured``: the oracle's
best is then the best of the grids measured). In an engine server the study across methods
takes ``--auto-override search=heuristic`` (nothing ranks an engine's points before measuring):

    python bench/oracle.py --task cnndm --members speculative prompt_lookup --grids prompt_lookup \
        --override engine=llamacpp --auto-override search=heuristic --work /tmp/oracle-llamacpp
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from optuna.trial import TrialState

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tuner_search import load_study, search_record  # noqa: E402


def tuner(work: Path, name: str, overrides: list[str], log: Path, env: dict) -> tuple[float, str]:
    """One ``python -m tuner`` process in ``work``: its wall time and output (kept in ``log``)."""
    command = [sys.executable, "-m", "tuner", *overrides, f"study_name={name}"]
    walls = work / "walls.json"       # studies finished by an earlier run, with their commands
    done_before = json.loads(walls.read_text()) if walls.exists() else {}
    earlier = done_before.get(name)
    if earlier is not None and earlier["command"] == command[1:] and log.exists():
        return earlier["seconds"], log.read_text()    # the same command only: nothing reused
    began = time.perf_counter()                       # from other settings
    done = subprocess.run(command, cwd=work, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - began
    log.write_text(" ".join(command) + "\n" + done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}): see {log}")
    walls.write_text(json.dumps({**done_before, name: {"seconds": seconds,
                                                       "command": command[1:]}}) + "\n")
    return seconds, done.stdout


def record(work: Path, name: str, wall: float) -> dict:
    """What one study cost, measured and answered: ``bench.tuner_search.search_record`` (its
    phases, winner and held-out figure), with what an oracle reads beside (its outcome's method
    and answer, the points ranked, the profile made, every finished point's tuning speedup)."""
    base = search_record(work, name, wall)
    s = load_study(work, name)
    trials = s.get_trials(deepcopy=False)
    table = [{"params": dict(t.params), "tuning_speedup": t.value,
              "method": t.user_attrs.get("method")}
             for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    outcome_path = work / "studies" / "best" / f"{name}.outcome.json"
    outcome = json.loads(outcome_path.read_text()) if outcome_path.exists() else {}
    ranking = s.user_attrs.get("predict_ranking") or {}
    profile = s.user_attrs.get("profile_used") or {}
    return {**{k: round(base[k], 1) for k in ("end_to_end_s", "open_s", "held_out_s",
                                               "search_s", "ranking_s")},
            "study": name,
            "points_ranked": sum(v is not None for _, v in ranking.get("predicted") or []),
            "points_measured": base["trials"], "method": outcome.get("method"),
            "profile_made_s": profile.get("seconds") if profile.get("made_now") else None,
            "winner": (outcome.get("winner") or {}).get("params") or base["winner"],
            "winner_tuning": base["winner_tuning"], "winner_held_out": base["winner_held_out"],
            "recommendation": outcome.get("recommendation"),
            "methods": outcome.get("methods", []), "table": table}


def replay(work: Path, task: str, method: str, name: str, env: dict, log: Path) -> float:
    """One fresh paired held-out measurement of ``name``'s winner (``+best``)."""
    command = [sys.executable, "-m", "tuner", f"+task={task}", f"method={method}",
               f"+best={name}", "tracking=none"]
    done = subprocess.run(command, cwd=work, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    with log.open("a") as out:
        out.write(" ".join(command) + "\n" + done.stdout)
    line = next((x for x in done.stdout.splitlines()
                 if x.startswith("replay: held-out speedup ")), None)
    if done.returncode or line is None:
        raise SystemExit(f"replay of {name} failed: see {log}")
    return float(line.split()[3].rstrip("x"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--task", default="gsm8k")
    parser.add_argument("--members", nargs="+", required=True)
    parser.add_argument("--left-out", nargs="*", default=[],
                        help="members of method=auto the oracle does not measure (said)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--held-out", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--grids", nargs="*", default=None,
                        help="the members whose grids are measured (default: every member); "
                             "the others are said in the JSON (grids_not_measured)")
    parser.add_argument("--override", action="append", default=[])
    parser.add_argument("--grid-override", action="append", default=[],
                        help="an override for the grids only (a narrowed grid, said in the JSON)")
    parser.add_argument("--auto-override", action="append", default=[],
                        help="an override for the study across methods only (an engine server: "
                             "search=heuristic, which nothing ranks before measuring)")
    args = parser.parse_args()
    grid_members = args.members if args.grids is None else args.grids
    unknown = sorted(set(grid_members) - set(args.members))
    if unknown:
        parser.error(f"--grids {unknown}: not among --members {args.members}")
    args.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "SPECTUNE_PROFILES": str(args.work / "profiles")}
    common = [f"+task={args.task}", "budget=full", f"task.n_prompts={args.prompts}",
              f"task.max_new_tokens={args.tokens}", f"task.n_held_out={args.held_out}",
              "tracking=none", *args.override]
    result = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "load_before": os.getloadavg()[0], "task": args.task,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "settings": common, "auto_settings": args.auto_override,
              "grid_settings": args.grid_override, "members": args.members,
              "left_out": args.left_out,
              "grids_not_measured": [m for m in args.members if m not in grid_members]}

    members = "[" + ",".join(args.members) + "]"
    wall, _ = tuner(args.work, "auto", [*common, "method=auto", f"method.members={members}",
                     *args.auto_override],
                    args.work / "auto.log", env)
    auto = record(args.work, "auto", wall)
    print(f"across methods: {auto['end_to_end_s']:.0f} s (search {auto['search_s']:.0f} s), "
          f"{auto['points_ranked']} ranked, {auto['points_measured']} measured, profile made in "
          f"{auto['profile_made_s']} s: {auto['method']} {auto['winner']} held out "
          f"{auto['winner_held_out']}", flush=True)

    grids = {}
    for member in grid_members:
        wall, _ = tuner(args.work, f"grid-{member}", [*common, f"method={member}", "search=grid",
                                 *args.grid_override],
                        args.work / f"grid-{member}.log", env)
        grids[member] = record(args.work, f"grid-{member}", wall)
        g = grids[member]
        print(f"grid {member}: {g['points_measured']} points, {g['search_s']:.0f} s, best "
              f"{g['winner_tuning']} ({g['winner']}), held out {g['winner_held_out']}",
              flush=True)
    summed = sum(g["search_s"] for g in grids.values())
    summed_end = sum(g["end_to_end_s"] for g in grids.values())
    oracle = max(grids, key=lambda m: grids[m]["winner_tuning"] or float("-inf"))

    # the study's winner is re-measured even where its answer is vanilla (said beside)
    answer_method = auto["method"] if auto["method"] not in (None, "vanilla", "off") else None
    recommendation = (auto["recommendation"] or "").lower()
    answer_is_vanilla = answer_method is None or "use vanilla" in recommendation or \
        "keep vanilla" in recommendation
    log = args.work / "remeasure.log"
    remeasured: dict[str, list[float]] = {"answer": [], "oracle": []}
    for _ in range(args.rounds):
        if answer_method is not None:
            remeasured["answer"].append(replay(args.work, args.task, answer_method, "auto", env,
                                               log))
        remeasured["oracle"].append(replay(args.work, args.task, oracle, f"grid-{oracle}", env,
                                           log))
    answer_x = statistics.mean(remeasured["answer"]) if remeasured["answer"] else 1.0
    oracle_x = statistics.mean(remeasured["oracle"])
    result.update({
        "auto": auto, "grids": grids, "oracle_method": oracle,
        "oracle_point": grids[oracle]["winner"], "summed_grid_search_s": round(summed, 1),
        "summed_grid_end_to_end_s": round(summed_end, 1),
        "shares": {m: round(g["search_s"] / summed, 3) for m, g in grids.items()},
        "remeasured": remeasured, "answer_held_out": answer_x, "oracle_held_out": oracle_x,
        "answer_is_vanilla": answer_is_vanilla,
        "same_point": answer_method == oracle and auto["winner"] == grids[oracle]["winner"],
        "reached": answer_x / oracle_x,
        "search_share": auto["search_s"] / summed,
        "end_to_end_share": auto["end_to_end_s"] / summed_end})
    print(json.dumps({k: result[k] for k in ("oracle_method", "oracle_point", "answer_is_vanilla",
                                             "answer_held_out",
                                             "oracle_held_out", "reached", "search_share",
                                             "end_to_end_share")}, default=str))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
