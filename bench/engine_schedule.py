"""Benchmark: an engine's per-batch-size schedule, predicted from its own cost surface and
confirmed by a study's measurements at every level (embedded default SmolLM2-135M, greedy,
draft-model speculation, GSM8K, quiet machine).

    python bench/engine_schedule.py --engine llamacpp [--levels 1 2 4] [--ks 1 2 4 8]
        [--synth-len 2.5] [--prompts 4] [--held-out 2] [--max-new-tokens 64]
        [--out bench/results_engine_schedule_llamacpp_cpu.json]
    python bench/engine_schedule.py --engine vllm --models smollm2_early_exit --ks 1 2 4 \\
        --synth-len real

1. the engine's profile: ``python -m tuner.profile --engine <engine> --levels … --ks …``
   (``--synth-len``: a synthetic mean length, or ``real``: the draft's own acceptance);
2. a grid study of the drafted-token knob over ``--ks`` at ``budget.concurrency=<levels>``
   with that profile as ``search.profile`` (every other knob at the engine's default; llama.cpp
   with ``--spec-draft-p-min 0``, so every step drafts its k): each trial's paired measurement
   per level and its prediction from its own counts there;
3. the finish's schedule (``tuner.study.level_plan``): the best k per level by prediction,
   checked against the measured best per level; the deploy block as written.
The results JSON holds the profile, every trial's predicted and measured decode speedup per
level, the calibration, the schedule and its checks, and the commands.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import warnings
from pathlib import Path


def surfaced() -> dict[str, object]:
    """The engines whose cost surface ``python -m tuner.profile --engine`` measures."""
    from tuner.engines import ENGINES, engine_named
    return {name: engine_named(name) for name in ENGINES
            if getattr(engine_named(name), "synthetic_surface", False)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(surfaced()), default="llamacpp")
    parser.add_argument("--models", default="smollm2")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--synth-len", default="2.5")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--held-out", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--task", default="gsm8k")
    parser.add_argument("--work", default="studies/bench-engine-schedule",
                        help="the profile and the study's journal (studies/ is not tracked)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from tuner import profile as cli
    work = Path(args.work) / args.engine
    import shutil
    shutil.rmtree(work / "studies", ignore_errors=True)     # every run measures anew
    work.mkdir(parents=True, exist_ok=True)
    profile_path = work / "profile.json"
    profile_argv = ["--engine", args.engine, "--models", args.models, "--levels",
                    *map(str, args.levels), "--ks", *map(str, args.ks), "--synth-len",
                    args.synth_len, "--task", args.task, "--prompts", str(args.prompts),
                    "--max-new-tokens", str(args.max_new_tokens), "--out", str(profile_path),
                    "--drafting", "model"]
    started = time.perf_counter()
    if cli.main(profile_argv) != 0:
        return 2
    profile_s = time.perf_counter() - started
    engine = surfaced()[args.engine]
    knob = engine.draft_tokens_knob                 # every step drafts exactly k:
    fixed = [f"engine.methods.speculative.params.{name}={value}"
             for name, value in engine.exact_draft.items()]
    overrides = ["+task=" + args.task, f"engine={args.engine}", "method=speculative",
                 f"models={args.models}",
                 f"budget.concurrency=[{','.join(map(str, args.levels))}]",
                 f"task.n_prompts={args.prompts}", f"task.n_held_out={args.held_out}",
                 f"task.max_new_tokens={args.max_new_tokens}", "budget=full", "search=grid",
                 "search.ranges=full", "~engine.methods.speculative.space",
                 "+engine.methods.speculative.space={" + knob + ":{type:categorical,choices:["
                 + ",".join(map(str, args.ks)) + "]}}",
                 f"engine.methods.speculative.params.{knob}={args.ks[0]}", *fixed,
                 f"search.profile={profile_path}", "tracking=none",
                 f"studies_dir={work / 'studies'}", f"study_name={args.engine}-schedule"]
    from tuner.measure.timing import time_generation
    from tuner.run import run
    started = time.perf_counter()
    result = run(cli.compose(overrides), time_generation)
    study_s = time.perf_counter() - started
    out = collect(work / "studies", f"{args.engine}-schedule", result, args, profile_path,
                  profile_argv, overrides)
    out["seconds"] = {"profile": profile_s, "study": study_s}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def collect(studies: Path, name: str, result, args, profile_path, profile_argv,
            overrides) -> dict:
    """Every trial's per-level figures, the calibration, the schedule and its checks (the
    finish's own: ``tuner.predict.served.plan_levels`` on the same figures)."""
    import optuna
    import yaml

    from tuner.measure.figures import Figures
    from tuner.predict.forms import every_form
    from tuner.predict.predict import calibration
    from tuner.predict.served import DRAFTED, LENGTH, PREDICTED, plan_levels
    from tuner.predict.surface import load_profile
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(studies / f"{name}.journal")))
    study = optuna.load_study(study_name=name, storage=storage)
    knob = surfaced()[args.engine].draft_tokens_knob
    trials, by_k = [], {}
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        by_k[int(t.params[knob])] = t.user_attrs
        a = Figures.from_flat(t.user_attrs)
        trials.append({"k": t.params[knob], "levels": {
            c: {"measured_decode_speedup": a.at_level("decode_speedup", c),
                "predicted_decode_speedup": a.at_level(PREDICTED, c),
                "mean_length": a.at_level(LENGTH, c),
                "drafted_per_step": a.at_level(DRAFTED, c),
                "throughput_ratio": a.at_level("throughput_ratio", c)} for c in args.levels}})
    pairs = [(v["predicted_decode_speedup"], v["measured_decode_speedup"], f"k={t['k']} c{c}")
             for t in trials for c, v in t["levels"].items()
             if v["predicted_decode_speedup"] is not None]
    found = None
    if len(args.levels) > 1 and by_k:
        planned, checks = plan_levels(by_k, sorted(args.levels), load_profile(profile_path))
        found = {"schedule": planned, "checks": checks}
    best = yaml.safe_load((studies / "best" / f"{name}.yaml").read_text())
    return {
        "made": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": vars(args), "profile_command": ["python", "-m", "tuner.profile",
                                                    *profile_argv],
        "study_overrides": overrides,
        "profile": json.loads(Path(profile_path).read_text()),
        "trials": trials,
        "calibration": calibration([(p, m) for p, m, _ in pairs], [n for _, _, n in pairs]),
        "schedule": None if found is None else {
            "lines": found["schedule"].lines(),
            "per_level": {c.batch: c.k for c in found["schedule"].levels},
            "forms": every_form(found["schedule"]),
            "checks": [{"batch": c.batch, "k": c.k, "predicted": c.predicted,
                        "measured": c.measured, "best_k": c.best_k, "best": c.best,
                        "confirmed": c.confirmed, "line": c.line()} for c in found["checks"]]},
        "deploy": best.get("deploy"), "winner": result.get("params")}


if __name__ == "__main__":
    sys.exit(main())
