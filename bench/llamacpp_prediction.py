"""Benchmark: llama.cpp's decode-phase speedup per concurrency level predicted from its
synthetic-acceptance cost surface and its own acceptance counts, against the paired measurement,
and the per-level choice of k both ways (embedded default: SmolLM2-135M-Instruct GGUF target +
its re-typed self-draft, draft-model speculation, greedy, quiet machine).

    python bench/llamacpp_prediction.py [--levels 1 2 4] [--ks 1 2 4 8] [--prompts 4]
        [--max-new-tokens 64] [--synth-len 2.5] [--out bench/results_llamacpp_prediction_cpu.json]

1. the engine's cost surface: ``ServerEvaluator.synthetic_costs`` (``tuner.predict.synthetic``):
   per level and k, a step's time with k drafts accepted at random (k = 0: the plain server);
2. per k: the paired protocol of a study (``measure``: the plain server and the method server
   with ``--spec-draft-n-max k --spec-draft-n-min 0 --spec-draft-p-min 0``, interleaved batches
   per level) on the task's prompts: the measured ``decode_speedup@c<level>`` and the engine's
   own mean accepted length;
3. predicted decode-phase speedup at level c = the engine's mean accepted length at level 1 (at
   T = 0 the outputs, hence the acceptance, are the same at every level) × T(c, 0) / T(c, k),
   with T from a synthetic run asked the fixed ``--synth-len`` and from one asked, per k, the
   mean length the engine reported at level 1 (``--synth-observed``: a step's cost depends
   on how far its drafts get, through the rollbacks);
4. the best k per level by prediction and by measurement (``tuner.predict.schedule.plan``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings
from pathlib import Path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--synth-len", type=float, default=2.5)
    parser.add_argument("--synth-observed", action="store_true",
                        help="also ask, per k, the mean length the engine reported at level 1")
    parser.add_argument("--task", default="gsm8k")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    from decoding.hardware import hardware
    from tuner import profile as cli
    from tuner.measure.figures import level_key
    from tuner.predict import loops, synthetic
    from tuner.predict.predict import calibration
    from tuner.predict.schedule import plan
    levels = sorted({1, *args.levels})
    settings, ev = cli.engine_evaluator("llamacpp", "smollm2", args.task, levels, args.prompts,
                                        args.max_new_tokens, warmup_prompts=1)
    measured: dict[int, dict[str, float]] = {}
    try:
        ev.open()
        for k in args.ks:
            params = {**settings.default, "n_max": k, "n_min": 0, "p_min": 0.0}
            pairs = list(ev.measure(params, list(enumerate(settings.tuning)), parity=k))
            measured[k] = ev.assess(pairs).summary
            print(f"k={k}: " + ", ".join(
                f"c{c} decode speedup {measured[k][level_key('decode_speedup', c)]:.3f} (mean "
                f"length {measured[k][level_key('mean_accepted_tokens', c)]:.2f})"
                for c in levels), flush=True)
        surfaces = {"fixed": ev.synthetic_costs(args.ks, levels, args.synth_len)}
        if args.synth_observed:
            surfaces["observed"] = ev.synthetic_costs(
                args.ks, levels,
                {k: measured[k][level_key("mean_accepted_tokens", 1)] for k in args.ks})
        build = ev.build_info()
    finally:
        ev.close()
    results = {name: compare(name, cells, measured, args.ks, levels, plan, calibration)
               for name, cells in surfaces.items()}
    if args.out:
        profiles = {name: synthetic.profile(
            cells, machine=hardware(torch.device("cpu")), engine="llamacpp",
            build={"llamacpp": build}, threads=ev.threads,
            models=loops.describe_models(cli.preset_models("smollm2")),
            length=args.synth_len if name == "fixed" else "per k as the engine reported at c1",
            made=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        ).to_json() for name, cells in surfaces.items()}
        Path(args.out).write_text(json.dumps({
            "profiles": profiles, "results": results, "measured": measured,
            "settings": vars(args)}, indent=1) + "\n")


def compare(name, cells, measured, ks, levels, plan, calibration) -> dict:
    """Predicted vs measured decode-phase speedup per (k, level) from one synthetic surface,
    and the best k per level both ways."""
    from tuner.measure.figures import level_key
    from tuner.predict.forms import llamacpp_per_level
    step = {(c.level, c.k): c.step_s for c in cells}
    rows = []
    for k in ks:
        length = measured[k][level_key("mean_accepted_tokens", 1)]
        for c in levels:
            predicted = length * step[c, 0] / step[c, k]
            got = measured[k][level_key("decode_speedup", c)]
            rows.append({"k": k, "level": c, "mean_length_c1": length,
                         "mean_length_here": measured[k][level_key("mean_accepted_tokens", c)],
                         "step_ms": 1e3 * step[c, k], "plain_step_ms": 1e3 * step[c, 0],
                         "predicted": predicted, "measured": got, "error": predicted / got - 1})
            print(f"[{name}] k={k} c={c}: predicted {predicted:.3f} measured {got:.3f} error "
                  f"{100 * (predicted / got - 1):+.1f} %", flush=True)
    calib = calibration([(r["predicted"], r["measured"]) for r in rows],
                        [f"k={r['k']} c={r['level']}" for r in rows])
    by = {(r["k"], r["level"]): r for r in rows}
    schedules = {}
    if len(levels) > 1:
        for what in ("predicted", "measured"):
            schedule = plan(lambda k, c, what=what: by[k, c][what], ks, levels, between=False)
            schedules[what] = {"lines": schedule.lines(), "llamacpp": llamacpp_per_level(schedule),
                               "per_level": {c.batch: c.k for c in schedule.levels}}
            print(f"[{name}] {what}: " + "; ".join(schedule.lines()), flush=True)
    print(f"[{name}] median error {100 * calib['median_abs_error']:.1f} %, Spearman "
          f"{calib['spearman'] if calib['spearman'] is None else round(calib['spearman'], 2)}; "
          f"synthetic lengths: " + ", ".join(
              f"k={c.k} c{c.level} {c.mean_length:.2f}±{c.length_error():.2f} (asked "
              f"{c.asked_length:g})" for c in cells if c.k), flush=True)
    return {"calibration": calib, "rows": rows, "schedules": schedules, "synthetic": [
        {"level": c.level, "k": c.k, "asked": c.asked_length, "mean_length": c.mean_length,
         "length_error": c.length_error(), "step_ms": 1e3 * c.step_s,
         "decode_steps": c.decode_steps} for c in cells]}


if __name__ == "__main__":
    sys.exit(main())
