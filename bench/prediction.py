"""Benchmark: predicted vs measured paired speedup in our own loops on the embedded default
(SmolLM2-135M-Instruct fp32 + its int8-dynamic self-draft), greedy, on a quiet machine.

    python bench/prediction.py [--profile P.json] [--tasks gsm8k cnndm] [--prompts 3]
        [--max-new-tokens 48] [--rounds 2] [--out bench/results_prediction_cpu.json]
        [--predict-for H100.json ...]

Per task (held-out prompts of ``bench/drafters.py``):
  1. one vanilla trajectory per prompt to ``--max-new-tokens`` without stopping at EOS
     (``decoding.replay.trajectory``, untimed);
  2. per setting (speculative γ 1–8, prompt lookup γ 2/4/10 and a 3-match trie): the acceptance
     replayed by the method's own drafter (``decoding.replay.drafter_steps``), priced by the
     hardware profile (``--profile``, else measured first: ``tuner.predict.loops``) into a
     predicted paired speedup (``tuner.predict.predict``); the replay's counts are checked
     against the timed run's (they must be equal: the replay is exact);
  3. per setting and round: the measured paired speedup, as a study's ``speedup`` is (per prompt
     vanilla's wall time over the method's, end to end, the two in alternating order, one
     untimed warm-up each; the geometric mean over prompts).
Besides the measured profile, every setting is priced by this CPU's roofline (an ESTIMATE from
the read bandwidth and matmul throughput measured at the start, ``tuner.predict.roofline``) and
by each ``--predict-for`` profile (e.g. a GPU's roofline with batch sizes): the CPU roofline's
error against the measurements is reported as the measured profile's is; for the other profiles
the predictions and, over their batch sizes, the speculative γ schedule
(``tuner.predict.schedule``) — predictions only, nothing is measured there.
Reported: per setting measured (each round), predicted and the error; per task the median
|predicted/measured − 1|, Spearman's ρ, the measurements' own test–retest spread (median
|round 1/round 2 − 1|: no prediction can be shown better than that), the seconds spent
scoring the grid by replay (trajectories + drafter passes) vs by generating it, and per method
the measured speedup of the best-predicted setting as a fraction of the best measured one.
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

from tuner.predict import roofline

sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTINGS = [(f"speculative γ={g}", "speculative", {"num_draft_tokens": g}) for g in range(1, 9)] \
    + [(f"prompt lookup γ={g}", "prompt_lookup", {"num_draft_tokens": g}) for g in (2, 4, 10)] \
    + [("prompt lookup trie 3×4", "prompt_lookup", {"num_draft_tokens": 4, "num_matches": 3})]


def timed(method, ids, max_new):
    from decoding import generate
    start = time.perf_counter()
    out = generate(method, ids, max_new)
    return time.perf_counter() - start, out


def run_task(name, pair, prompts, args, profile, others=()):
    from decoding import build_method
    from decoding.replay import drafter_steps, trajectory
    from tuner.predict.predict import calibration, predict
    start = time.perf_counter()
    trajectories = [trajectory(pair.target, torch.tensor(p), args.max_new_tokens)
                    for p in prompts]
    replay_s = time.perf_counter() - start
    rows, generate_s, speculative = [], 0.0, {}
    vanilla = build_method("vanilla", pair)
    for label, name_, params in SETTINGS:
        method = build_method(name_, pair, **params)
        start = time.perf_counter()
        replayed = [drafter_steps(method.drafter, torch.tensor(p), t, args.max_new_tokens,
                                  tuple(method.eos_ids)) for p, t in zip(prompts, trajectories)]
        replay_s += time.perf_counter() - start
        generations = [(len(p), s) for p, s in zip(prompts, replayed)]
        uses_draft = name_ != "prompt_lookup"
        predicted = predict(generations, profile, uses_draft=uses_draft)
        elsewhere = {label_: predict(generations, other.at_batch(1),
                                     uses_draft=uses_draft).speedup
                     for label_, other in others}
        if label.startswith("speculative"):
            speculative[params["num_draft_tokens"]] = generations
        rounds, exact = [], True
        for r in range(args.rounds):
            ratios = []
            for i, ids in enumerate(prompts):
                if r == 0 and i == 0:               # untimed warm-up of both
                    timed(vanilla, ids, args.max_new_tokens)
                    timed(method, ids, args.max_new_tokens)
                order = [vanilla, method] if (i + r) % 2 == 0 else [method, vanilla]
                walls = {}
                for m in order:
                    wall, out = timed(m, ids, args.max_new_tokens)
                    walls[m is method] = wall
                    if m is method:
                        if r == 0:
                            generate_s += wall
                        steps = replayed[i]
                        exact &= (out.stats.steps, out.stats.accepted) == \
                            (len(steps), sum(s.accepted for s in steps))
                ratios.append(walls[False] / walls[True])
            rounds.append(statistics.geometric_mean(ratios))
        measured = statistics.fmean(rounds)
        row = {"task": name, "setting": label, "measured": rounds, "measured_mean": measured,
               "predicted": predicted.speedup, "error": predicted.speedup / measured - 1,
               "mean_accepted_tokens": predicted.mean_accepted_tokens,
               "replay_equals_loop": exact, "predicted_for": elsewhere}
        rows.append(row)
        print(f"{name:<7} {label:<24} measured {' / '.join(f'{x:.3f}' for x in rounds)}  "
              f"predicted {predicted.speedup:.3f}  error {100 * row['error']:+.1f} %  "
              f"accepted/step {predicted.mean_accepted_tokens:.2f}  replay exact {exact}",
              flush=True)
    calib = calibration([(r["predicted"], r["measured_mean"]) for r in rows],
                        [r["setting"] for r in rows])
    retest = statistics.median(abs(r["measured"][0] / r["measured"][1] - 1) for r in rows) \
        if args.rounds > 1 else None
    picks = {}
    for family in ("speculative", "prompt lookup"):
        mine = [r for r in rows if r["setting"].startswith(family)]
        best = max(mine, key=lambda r: r["measured_mean"])
        chosen = max(mine, key=lambda r: r["predicted"])
        picks[family] = {"best_measured": best["setting"],
                         "best_predicted": chosen["setting"],
                         "reached": chosen["measured_mean"] / best["measured_mean"]}
    summary = {"task": name, **calib, "test_retest_median": retest, "replay_s": replay_s,
               "elsewhere": elsewhere_summary(rows, others, speculative, profile.machine),
               "top1_by_family": picks,
               "generate_s": generate_s, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens,
               "best_measured": max(rows, key=lambda r: r["measured_mean"])["setting"],
               "best_predicted": max(rows, key=lambda r: r["predicted"])["setting"]}
    print(f"{name}: median error {100 * calib['median_abs_error']:.1f} %, Spearman "
          f"{calib['spearman']:.2f}, test-retest {100 * (retest or 0):.1f} %; scoring the grid "
          f"took {replay_s:.1f} s by replay vs {generate_s:.1f} s by generation; best measured "
          f"{summary['best_measured']}, best predicted {summary['best_predicted']}", flush=True)
    return rows, summary


def elsewhere_summary(rows, others, speculative, here):
    """Per other profile: for one of this machine (``here``: this CPU's roofline) its
    calibration against the measurements; for every one its best predicted setting and, with
    several batch sizes, the speculative γ schedule it predicts."""
    from tuner.predict.predict import calibration, predict
    from tuner.predict.forms import every_form
    from tuner.predict.schedule import plan
    out = {}
    for label, other in others:
        entry = {"machine": other.machine, "kind": other.kind,
                 "best_predicted": max(rows, key=lambda r: r["predicted_for"][label])["setting"]}
        if other.machine == here:
            entry["calibration_here"] = calibration(
                [(r["predicted_for"][label], r["measured_mean"]) for r in rows],
                [r["setting"] for r in rows])
        if len(other.batch_sizes()) > 1:
            schedule = plan(lambda k, b: predict(speculative[k], other.at_batch(b),
                                                 uses_draft=True).speedup,
                            sorted(speculative), other.batch_sizes())
            entry["schedule"] = {"lines": schedule.lines(), "forms": every_form(schedule)}
            print(f"  {label} schedule: " + "; ".join(schedule.lines()), flush=True)
        out[label] = entry
        calib = entry.get("calibration_here")
        rho = None if calib is None or calib["spearman"] is None else round(calib["spearman"], 2)
        shown = "" if calib is None else (
            f"median error vs this machine's measurements {100 * calib['median_abs_error']:.1f} "
            f"%, Spearman {rho}; ")
        print(f"  priced by {label} ({other.machine}): {shown}best predicted "
              f"{entry['best_predicted']}", flush=True)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="a hardware profile JSON (else measured)")
    parser.add_argument("--tasks", nargs="+", default=["gsm8k", "cnndm"])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--predict-for", nargs="*", default=[],
                        help="further profiles to price every setting by (e.g. a GPU roofline)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from drafters import bench_prompts

    from decoding import load_pair
    from tuner import profile as cli
    from tuner.predict.surface import load_profile
    pair = load_pair("smollm2")
    models = cli.preset_models("smollm2")
    if args.profile:
        profile = load_profile(args.profile, models=models, engine="hf", setting="--profile")
    else:
        profile = cli.make_profile(models, cli.parse(["--models", "smollm2"]))
    print(f"profile: {profile.describe()}", flush=True)
    roofline_cpu, _ = cli.make_roofline(models, cli.parse(["--roofline", "cpu"]), profile)
    others = [("cpu roofline", roofline_cpu)]
    others += [(Path(p).stem, load_profile(p, models=models, engine="hf",
                                           setting="--predict-for")) for p in args.predict_for]
    print(f"cpu roofline: {others[0][1].note}", flush=True)
    rows, summaries = [], []
    for name in args.tasks:
        task, held = bench_prompts(name)
        prompts = [task.encode(p, pair.tokenizer) for p in held[: args.prompts]]
        task_rows, summary = run_task(name, pair, prompts, args, profile, others)
        rows += task_rows
        summaries.append(summary)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "profile": profile.to_json(), "threads": torch.get_num_threads(),
            "cpu_roofline": others[0][1].to_json(),
            "roofline_vs_measured": {"target": roofline.compare(others[0][1].target,
                                                                profile.target),
                                     "draft": roofline.compare(others[0][1].draft,
                                                               profile.draft)},
            "summaries": summaries, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
