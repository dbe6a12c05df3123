"""``python -m tuner.profile``: measure this machine's cost surface for our own loops
(``engine=hf``) and write it as a hardware profile (``tuner.predict.surface``), to predict
speculative speed from acceptance here or on another machine.

    python -m tuner.profile --models smollm2 --out profiles/smollm2-cpu.json

Times KV-cached forwards of the target (and of the draft model, where the preset has one) on a
grid of contexts × rows and prompt prefills, and the loop's own time per step
(``tuner.predict.loops``). Bad input gets one line before any model loads; a quiet machine is
wanted: sustained load from other processes (over 25 % of the CPUs over 10 s or more of a
round) stops it in one line, exit status 3, nothing written; a block a shorter burst disturbed is
measured again (``tuner.predict.loops``).

    python -m tuner.profile --models smollm2 --roofline H100
    python -m tuner.profile --models smollm2 --roofline cpu --compare profiles/smollm2-cpu.json

    python -m tuner.profile --engine llamacpp --models smollm2 --levels 1 2 4 --ks 1 2 4 8

``--engine llamacpp`` measures llama-server's cost surface instead (``--drafting``: a draft
model's steps, n-gram drafting's draft-free steps, or both, the default: two profiles), from its
synthetic-acceptance mode (``tuner.predict.synthetic``: k drafted tokens per step accepted at
random with mean length ``--synth-len``), per concurrency level and k, on the task's prompts; ``--engine vllm`` the same
from vLLM's server (its CPU build has no synthetic mode: ``--synth-len real`` measures each k at
the draft model's own acceptance, on either engine). The draft-free profile
(``<out>-ngram.json``) is the target's step at k + 1 tokens with no draft model, as n-gram drafting
pays it (the lookup's time included): prompt lookup (``method=prompt_lookup``) drafting k tokens on
prompts that repeat themselves, so that every step finds a full draft; it prices n-gram deployments
(``python -m tuner.watch``). Load is checked per cell with the servers' processes counted as the
profile's own (``tuner.predict.loops.ServedLoad``): sustained load stops it (exit 3), a burst
measures the cell again.
``--roofline NAME`` writes instead a roofline profile (an ESTIMATE, ``tuner.predict.roofline``)
for a named GPU from its datasheet, or for this CPU from its bandwidth and matmul throughput
measured here; ``--compare`` prints its error against a measured profile, cell by cell.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path
from typing import Sequence

from tuner.config.errors import ConfigError
from tuner.engines import DEFAULT  # our own loops (engine=hf)

CONF = Path(__file__).resolve().parents[1] / "conf"
FLAGGED = 3           # exit status: the profile is written, but its fit (or an engine's cells'
                      # order) is not to be believed; or it stopped under sustained load from
                      # other processes (nothing written)


def preset_models(name: str) -> dict:
    """The ``models=<name>`` config's target and draft specs (conf/models/<name>.yaml)."""
    import yaml
    path = CONF / "models" / f"{name}.yaml"
    if not path.is_file():
        allowed = sorted(p.stem for p in (CONF / "models").glob("*.yaml"))
        raise ConfigError(f"--models={name!r} is unknown: allowed are {allowed}")
    data = yaml.safe_load(path.read_text())
    return {"target": data["target"], "draft": data.get("draft")}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tuner.profile", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--models", default="smollm2", help="a conf/models preset")
    parser.add_argument("--out", default=None, help="the profile JSON to write "
                        "(default profiles/<models>-<machine>.json)")
    parser.add_argument("--threads", default="auto", help="torch threads (auto: one per CPU)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per cell")
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=None,
                        help="the target's forward rows (default: 1-16 for chains and tries, "
                             "32-128 for lookahead's and Ouroboros's trees)")
    parser.add_argument("--prefill", type=int, nargs="+", default=None,
                        help="prompt lengths whose prefill is timed (default: 16-2048; cover "
                             "the task's prompts)")
    parser.add_argument("--draft-rows", type=int, nargs="+", default=None,
                        help="the draft model's forward rows (default: 1, 2 for chains, up to "
                             "256 for Ouroboros's lookahead drafts)")
    parser.add_argument("--roofline", default=None, metavar="NAME",
                        help="write a roofline ESTIMATE for a GPU (H100, H200, A100, L40S, L4, "
                        "RTX4090) or for this cpu instead of measuring forwards")
    parser.add_argument("--batches", type=int, nargs="+", default=None, metavar="B",
                        help="with --roofline: the surfaces at these batch sizes too (a "
                        "per-batch-size schedule needs two or more), e.g. 1 2 4 8 16 32 64")
    parser.add_argument("--engine", default=None, help="our own loops (default), or an engine "
                        "server measured in its synthetic-acceptance mode (llama.cpp)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1], metavar="C",
                        help="--engine: concurrency levels (1 is always measured)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4], metavar="K",
                        help="--engine: drafted tokens per step")
    parser.add_argument("--drafting", default="both", choices=("model", "ngram", "both"),
                        help="--engine: a draft model's steps (model), n-gram drafting's "
                        "draft-free steps (ngram), or both (two profiles)")
    parser.add_argument("--synth-len", default="2.5", metavar="L",
                        help="--engine: mean accepted length asked (capped at k + 1), or "
                        "real: no synthetic mode, the draft model's own acceptance")
    parser.add_argument("--task", default="gsm8k", help="--engine: the prompts' task")
    parser.add_argument("--prompts", type=int, default=4, help="--engine: prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="--engine: tokens per request")
    parser.add_argument("--compare", default=None, metavar="PROFILE",
                        help="with --roofline: its error against this measured profile")
    parser.add_argument("--compare-json", default=None, metavar="FILE",
                        help="with --compare: write the cell-by-cell comparison here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        models = preset_models(args.models)
        from tuner.measure.hygiene import check_threads
        check_threads(None if args.threads == "auto" else args.threads)
        if args.repeats < 1:
            raise ConfigError(f"--repeats={args.repeats} is invalid: allowed is an integer >= 1")
        for name, values in (("--contexts", args.contexts), ("--rows", args.rows),
                             ("--draft-rows", args.draft_rows), ("--prefill", args.prefill)):
            if values is not None and (min(values) < 1 or sorted(set(values)) != values):
                raise ConfigError(f"{name}={values} is invalid: allowed are distinct ascending "
                                  "integers >= 1")
        if args.roofline is not None:
            from tuner.predict.roofline import machine_named
            args.roofline = machine_named(args.roofline)
        if args.batches is not None:
            check_batches(args.batches, args.roofline)
        check_engine(args)
        if args.compare is not None:
            if args.roofline is None:
                raise ConfigError(f"--compare={args.compare!r} needs --roofline: allowed is "
                                  "--roofline NAME --compare PROFILE")
            from tuner.predict.surface import load_profile
            compared = load_profile(args.compare, models=models, engine=DEFAULT,
                                    setting="--compare")
            if compared.kind != "measured":
                raise ConfigError(f"--compare={args.compare!r} is a {compared.kind} profile: "
                                  "allowed is a measured one (python -m tuner.profile)")
            args.compared = compared
        elif args.compare_json is not None:
            raise ConfigError(f"--compare-json={args.compare_json!r} needs --compare PROFILE")
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.roofline is not None:
        return roofline_main(models, args)
    from tuner.predict.loops import ProfileDisturbed
    if args.engine != DEFAULT:
        try:
            return engine_main(models, args)
        except ConfigError as err:          # what only the composed config or the engine says
            print(f"error: {err}", file=sys.stderr)
            return 2
        except ProfileDisturbed as err:     # sustained load: nothing written
            print(f"error: {err}", file=sys.stderr)
            return FLAGGED
    try:
        profile = make_profile(models, args)
    except ProfileDisturbed as err:         # sustained load: nothing written
        print(f"error: {err}", file=sys.stderr)
        return FLAGGED
    out = Path(args.out or f"profiles/{args.models}-{slug(profile.machine)}.json")
    profile.save(out)
    vanilla = profile.target.step_s(profile.target.contexts[0], 1)
    print(f"wrote {out}: {profile.describe()}; target forward {1e3 * vanilla:.1f} ms for one "
          f"token, {profile.target.step_s(profile.target.contexts[0], 5) / vanilla:.2f}x that "
          f"for 5 tokens; the loop's own time per step: " + ", ".join(
              f"{key} {1e3 * value:+.2f} ms "
              f"(spread {1e3 * profile.step_overhead_spread_s[key]:.2f})"
              for key, value in profile.step_overhead_s.items()))
    if profile.flags:
        for flag in profile.flags:
            print(f"PROFILE FLAGGED: {flag}")
        print(f"{out} is written with these flags, and a study that uses it checks it against "
              "its first trial; make it again on a quiet machine (exit status 3)")
        return FLAGGED
    from tuner.predict.check import SPREAD_BOUND
    print("profile check: the overhead fit is believed (no other load over "
          f"{loops_threshold():.0%} of the CPUs during any timed part; every overhead's standard "
          f"error within {SPREAD_BOUND:.0%} of its step's price)")
    return 0


def loops_threshold() -> float:
    from tuner.predict.loops import BUSY_THRESHOLD
    return BUSY_THRESHOLD


def surface_engines() -> list[str]:
    """Our own loops, and the engines that measure a synthetic-acceptance surface."""
    from tuner.engines import ENGINES, engine_named
    return [DEFAULT] + [k for k in ENGINES if k != DEFAULT and engine_named(k).synthetic_surface]


def check_engine(args: argparse.Namespace) -> None:
    """``--engine`` and its settings, one line each."""
    args.engine = args.engine or DEFAULT
    allowed = surface_engines()
    if args.engine not in allowed:
        raise ConfigError(f"--engine={args.engine!r}: its cost surface is not built yet; "
                          f"allowed are {allowed}")
    if args.engine == DEFAULT:
        return
    if args.roofline is not None:
        raise ConfigError(f"--roofline={args.roofline!r} estimates our own loops: allowed is "
                          "--engine hf with it")
    for name, values, low in (("--levels", args.levels, 1), ("--ks", args.ks, 1)):
        if min(values) < low or sorted(set(values)) != values:
            raise ConfigError(f"{name}={values} is invalid: allowed are distinct ascending "
                              f"integers >= {low}")
    if args.synth_len != "real":
        given = args.synth_len
        try:
            args.synth_len = float(given)
        except ValueError:
            args.synth_len = float("nan")
        if not args.synth_len >= 1:
            raise ConfigError(f"--synth-len={given} is invalid: allowed is a mean accepted "
                              "length >= 1 (the target's token included), or real")
    tasks = sorted(p.stem for p in (CONF / "task").glob("*.yaml"))
    if args.task not in tasks:
        raise ConfigError(f"--task={args.task!r} is unknown: allowed are {tasks}")
    if args.prompts < 1 or args.max_new_tokens < 2:
        raise ConfigError(f"--prompts={args.prompts} --max-new-tokens={args.max_new_tokens}: "
                          "allowed are >= 1 prompts and >= 2 tokens")


def engine_main(models: dict, args: argparse.Namespace) -> int:
    """``--engine llamacpp|vllm``: the engine's cost surface as a profile per ``--drafting``:
    a draft model's steps (synthetic acceptance, or the draft's own with ``--synth-len real``),
    and n-gram drafting's draft-free steps."""
    default = Path(f"profiles/{args.models}-{args.engine}-{{machine}}.json")
    model_out = Path(args.out) if args.out else default
    flagged = False
    if args.drafting in ("model", "both"):
        length = None if args.synth_len == "real" else args.synth_len
        flagged |= bool(engine_profile(models, args, "model", length, model_out).flags)
    if args.drafting in ("ngram", "both"):
        out = Path(args.out) if args.out and args.drafting == "ngram" else \
            model_out.with_name(model_out.stem + "-ngram" + model_out.suffix)
        flagged |= bool(engine_profile({**models, "draft": None}, args, "ngram", None,
                                       out).flags)
    return FLAGGED if flagged else 0


def engine_profile(models: dict, args: argparse.Namespace, drafting: str,
                   length: float | None, out: Path):
    """One engine profile: ``drafting`` ``model`` (draft-model speculation) or ``ngram``
    (prompt lookup on repeating prompts: draft-free), written to ``out`` (``{machine}`` in it
    filled) with its cells' order checked (``tuner.predict.check.inversions``: flagged, exit
    status 3); returns it."""
    import torch

    from decoding.hardware import hardware
    from tuner.predict import loops, synthetic
    levels = sorted({1, *args.levels})
    method = "speculative" if drafting == "model" else "prompt_lookup"
    # n-gram drafts: the last steps of a request draft fewer (its remaining tokens), so the
    # requests are long enough that they hardly count (32 steps of the largest k at least)
    tokens = args.max_new_tokens if drafting == "model" else \
        max(args.max_new_tokens, 32 * (max(args.ks) + 1))
    _, evaluator = engine_evaluator(args.engine, args.models, args.task, levels, args.prompts,
                                    tokens, args.threads, method=method)
    if length is not None:
        evaluator.check_synthetic(length)
    try:
        evaluator.open()
        print(f"cost surface: k {args.ks} at concurrency {levels}, " + (
            "DRAFT-FREE: n-gram drafting (no draft model) on prompts that repeat themselves"
            if drafting == "ngram" else
            "at the draft model's own acceptance (no synthetic mode)" if length is None else
            f"synthetic acceptance, mean length {length:g} asked"))
        load = loops.ServedLoad(evaluator.server_groups, abort=evaluator.close)
        cells = evaluator.synthetic_costs(args.ks, levels, length, repeat=drafting == "ngram",
                                          load=load)
        profile = synthetic.profile(
            cells, machine=hardware(torch.device("cpu")), engine=args.engine,
            build={args.engine: evaluator.build_info()}, threads=evaluator.threads,
            models=loops.describe_models(models),
            length="real" if length is None else length, drafting=drafting,
            made=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    finally:
        evaluator.close()
    from dataclasses import replace

    from tuner.predict.check import inversions
    profile = replace(profile, flags=tuple(inversions(profile)) + tuple(
        f"{line}: measured {1 + loops.BURST_RETRIES} times, disturbed each time"
        for line in load.busy))
    out = Path(str(out).replace("{machine}", slug(profile.machine)))
    profile.save(out)
    print(f"wrote {out}: {profile.describe()}")
    for flag in profile.flags:
        print(f"PROFILE FLAGGED: {flag}; make it again with more --prompts on a quiet machine "
              "(python -m tuner.watch recommends no switch at that batch size from it)")
    for c in cells:
        if c.k:
            asked = ("the drafter's own" if c.asked_length is None else
                     f"asked {c.asked_length:g}, ±{c.length_error():.2f}")
            print(f"  k={c.k} at concurrency {c.level}: mean length {c.mean_length:.2f} "
                  f"({asked}), {c.drafted_per_step:.2f} drafted per step, "
                  f"{1e3 * c.step_s:.1f} ms per step")
            if drafting == "ngram" and c.drafted_per_step < 0.8 * c.k:
                print(f"  NOTE: k={c.k} at concurrency {c.level} drafted {c.drafted_per_step:.2f} "
                      "per step, short of k: its price is the step at the rows it fed")
    return profile


def engine_evaluator(engine: str, models: str, task: str, levels: Sequence[int], prompts: int,
                     max_new_tokens: int, threads: str = "auto", warmup_prompts: int = 0,
                     say=print, method: str = "speculative"):
    """(study settings, evaluator) of ``method`` (draft-model speculation by default; or
    ``prompt_lookup``) in ``engine`` on ``prompts`` prompts of ``task``, at concurrency
    ``levels``, composed and validated as ``python -m tuner`` would (not opened)."""
    from tuner.measure.timing import time_generation
    from tuner.study.settings import StudySettings
    # budget=full: the prompts and tokens asked here (budget=auto would cap them at cpu_budget's)
    cfg = compose(["+task=" + task, f"engine={engine}", f"method={method}", "budget=full",
                   f"models={models}", f"budget.concurrency=[{','.join(map(str, levels))}]",
                   f"task.n_prompts={prompts}", "task.n_held_out=1",
                   f"task.max_new_tokens={max_new_tokens}", "tracking=none",
                   "study_name=profile", f"warmup_prompts={warmup_prompts}",
                   *([] if threads == "auto" else [f"threads={threads}"])])
    settings = StudySettings.from_config(cfg)
    return settings, settings.engine_object.evaluator(settings.measuring, time_generation, say)


def compose(overrides: list[str]):
    """The tuner's config as ``python -m tuner <overrides>`` composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose("config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def check_batches(batches: list[int], roofline: str | None) -> None:
    """``--batches``: two or more distinct ascending sizes >= 1, with ``--roofline``."""
    if roofline is None:
        raise ConfigError(f"--batches={batches} needs --roofline: our own loops are measured at "
                          "batch 1; allowed is --roofline NAME --batches 1 2 4 ...")
    if len(batches) < 2:
        raise ConfigError(f"--batches={batches} asks a per-batch-size schedule for one level "
                          "only: allowed are two or more batch sizes, e.g. 1 2 4 8 16 32 64")
    if min(batches) < 1 or sorted(set(batches)) != batches:
        raise ConfigError(f"--batches={batches} is invalid: allowed are distinct ascending "
                          "integers >= 1")


def roofline_main(models: dict, args: argparse.Namespace) -> int:
    """``--roofline``: write the estimate, and with ``--compare`` print (and write) its error
    against the measured profile, on that profile's grid."""
    import json

    from tuner.predict import roofline
    compared = getattr(args, "compared", None)
    profile, machine = make_roofline(models, args, compared)
    out = Path(args.out or f"profiles/{args.models}-roofline-{slug(args.roofline)}.json")
    profile.save(out)
    one = profile.target.step_s(profile.target.contexts[0], 1)
    print(f"wrote {out}: {profile.describe()} ({machine.source}); target forward "
          f"{1e3 * one:.3f} ms for one token, "
          f"{profile.target.step_s(profile.target.contexts[0], 5) / one:.2f}x that for 5")
    if compared is None:
        return 0
    report = {"estimate": profile.machine, "measured": compared.machine,
              "machine": machine.source, "target": roofline.compare(profile.target,
                                                                     compared.target)}
    if profile.draft is not None and compared.draft is not None:
        report["draft"] = roofline.compare(profile.draft, compared.draft)
    for role in ("target", "draft"):
        if role in report:
            print(comparison_table(role, report[role]))
    if args.compare_json:
        Path(args.compare_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.compare_json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.compare_json}")
    return 0


def comparison_table(role: str, result: dict) -> str:
    """Per context × rows: estimate / measured − 1, and the medians."""
    cells = result["cells"]
    rows = sorted({c["rows"] for c in cells})
    lines = [f"{role}: roofline estimate / measured - 1 (median |error| "
             f"{100 * result['median_abs_error']:.0f} % per forward, "
             f"{100 * result['median_abs_ratio_error']:.0f} % on the n-rows / 1-row ratio"
             + (f", {100 * result['median_abs_prefill_error']:.0f} % on prefill"
                if result["median_abs_prefill_error"] is not None else "") + ")",
             "| context | " + " | ".join(f"{n} rows" for n in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for context in sorted({c["context"] for c in cells}):
        line = {c["rows"]: c["error"] for c in cells if c["context"] == context}
        lines.append(f"| {context} | " + " | ".join(f"{100 * line[n]:+.0f} %" for n in rows)
                     + " |")
    return "\n".join(lines)


def make_roofline(models: dict, args: argparse.Namespace, compared=None):
    """The roofline profile for ``args.roofline`` (this CPU measured here), on the grid of
    ``compared`` when given, else the measured profile's default grid."""
    import torch

    from decoding.models import load_pair
    from tuner.measure.hygiene import configure_threads
    from tuner.predict import loops, roofline
    from tuner.predict.surface import HardwareProfile
    threads = configure_threads(None if args.threads == "auto" else args.threads)
    pair = load_pair(models["target"], models["draft"] or {"kind": "none"})
    machine = roofline.measure_cpu(threads) if args.roofline == roofline.CPU else \
        roofline.GPUS[args.roofline]
    shapes = {"target": roofline.ModelShape.of(pair.target, pair.target_name,
                                                bf16=machine.bf16)}
    if pair.draft is not None:
        shapes["draft"] = roofline.ModelShape.of(pair.draft, pair.draft_name or "draft",
                                                 bf16=machine.bf16)

    def grid(role: str, rows: tuple) -> dict:
        measured = getattr(compared, role, None) if compared is not None else None
        if measured is not None:
            return {"contexts": measured.contexts, "rows": measured.rows,
                    "prefill": [n for n, _ in measured.prefill]}
        return {"contexts": tuple(args.contexts or loops.CONTEXTS),
                "rows": tuple((args.rows if role == "target" else args.draft_rows) or rows),
                "prefill": loops.PREFILL}
    target = roofline.surface(shapes["target"], machine, **grid("target", loops.TARGET_ROWS))
    draft = roofline.surface(shapes["draft"], machine, **grid("draft", loops.DRAFT_ROWS)) \
        if "draft" in shapes else None
    batches = []
    for b in sorted({1, *(args.batches or ())}) if args.batches else ():
        batches.append((b, roofline.surface(shapes["target"], machine, batch=b,
                                            **grid("target", loops.TARGET_ROWS)),
                        roofline.surface(shapes["draft"], machine, batch=b,
                                         **grid("draft", loops.DRAFT_ROWS))
                        if "draft" in shapes else None))
    import transformers
    return HardwareProfile(
        kind="roofline", machine=machine.name, engine=DEFAULT,
        build={"torch": torch.__version__, "transformers": transformers.__version__,
               "python": platform.python_version()},
        threads=threads, models=loops.describe_models(models), target=target, draft=draft,
        made=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        note=roofline.describe(machine, shapes), batches=tuple(batches)), machine


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:48]


def make_profile(models: dict, args: argparse.Namespace, say=print,
                 between_rounds=lambda round_: None):
    """Our own loops' profile on this machine, as ``args`` sizes it
    (``tuner.predict.cache.measure_loops_profile``, which ``search.profile=auto`` uses too)."""
    from tuner.predict.cache import measure_loops_profile
    return measure_loops_profile(
        models, DEFAULT, args.threads, args.repeats, say=say, between_rounds=between_rounds,
        contexts=tuple(args.contexts or ()), rows=tuple(args.rows or ()),
        draft_rows=tuple(args.draft_rows or ()), prefill=tuple(args.prefill or ()))


if __name__ == "__main__":
    sys.exit(main())
