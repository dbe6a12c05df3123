"""``python -m tuner.watch``: watch a running deployment's acceptance, say when its tuned setting
has gone stale and what to run instead, and keep the record.

    python -m tuner.watch --url http://127.0.0.1:8080 --study <study name> \\
        --profile profiles/llamacpp.json

Every ``--interval`` seconds it scrapes the server's ``/metrics`` (the engine's counters,
``tuner.engines.metrics``), closes a window once ``--min-steps`` decode steps passed, and per
window: the mean accepted length and acceptance per position, the live batch, the measured time per
output token; a two-sided CUSUM against the deployment's own first ``--warmup`` windows
(``tuner.watch.drift``); whether live acceptance leaves what the study measured (a re-tune hint);
with ``--profile``, every k priced at the live batch (``tuner.watch.decide``) and, where a switch
wins by more than the margin in ``--persist`` windows in a row, the candidate in the engine's form
written to a file and the re-tune command printed. It never changes the server. ``--record``
keeps the scrapes; ``--replay`` reads such a recording instead of a server. Records: a JSON Lines
log and an MLflow run under the study's experiment; a summary at the end or on Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tuner.config.errors import ConfigError
from tuner.watch.decide import PERSIST
from tuner.watch.drift import ARL, AUTO_START, SHIFT, WARMUP

DEFAULT_URI = "sqlite:///mlruns/mlflow.db"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tuner.watch",
                                     description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the running server's base URL, e.g. http://127.0.0.1:8080")
    where.add_argument("--replay", type=Path, help="a recording (--record) instead of a server")
    parser.add_argument("--study", required=True, help="the study the deployment came from: "
                        "its name under studies/best/, or its .outcome.json or best YAML")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between scrapes")
    parser.add_argument("--min-steps", default="auto",
                        help="decode steps that close a window: auto (windows sized to the "
                        "traffic after each warm-up, tuner.watch.drift.sized_steps), or an "
                        "integer >= 1")
    parser.add_argument("--warmup", type=int, default=WARMUP,
                        help="windows of the deployment's start that make the reference")
    parser.add_argument("--shift", type=float, default=SHIFT, help="the relative change in mean "
                        "accepted length the change test is tuned to")
    parser.add_argument("--arl", type=float, default=ARL,
                        help="windows between false alarms, at least, under the test's model")
    parser.add_argument("--profile", type=Path, action="append", default=None,
                        help="the engine's hardware profile (python -m tuner.profile --engine); "
                        "give both it writes (a draft model's steps, and -ngram.json: "
                        "draft-free steps): the one of the deployment's kind prices it")
    parser.add_argument("--margin", type=float, default=None, help="the least predicted gain "
                        "of a switch (default: the study's calibration error, else 0.10)")
    parser.add_argument("--persist", type=int, default=PERSIST,
                        help="windows in a row a switch must win")
    parser.add_argument("--k", type=int, default=None, help="the drafted tokens per step the "
                        "deployment runs, where it was changed from the study's launch line")
    parser.add_argument("--temperature", type=float, default=None, help="the temperature the "
                        "live traffic samples at (default: the study's)")
    parser.add_argument("--record", type=Path, default=None, help="keep the scrapes (JSON Lines)")
    parser.add_argument("--out", type=Path, default=Path("studies") / "watch",
                        help="where the log and candidate schedules go")
    parser.add_argument("--tracking", choices=["mlflow", "none"], default="mlflow")
    parser.add_argument("--tracking-uri", default=DEFAULT_URI)
    parser.add_argument("--experiment", default=None,
                        help="default: the study's MLflow experiment (its task)")
    parser.add_argument("--windows", type=int, default=None, help="stop after this many windows")
    parser.add_argument("--duration", type=float, default=None, help="stop after these seconds")
    return parser.parse_args(argv)


def check_numbers(args: argparse.Namespace) -> None:
    given = args.min_steps
    if given != "auto":
        try:
            args.min_steps = int(given)
        except (TypeError, ValueError):
            args.min_steps = 0
        if args.min_steps < 1:
            raise ConfigError(f"--min-steps={given!r} is invalid: allowed are auto or an "
                              "integer >= 1")
    rules = [("--interval", args.interval, args.interval > 0, "a number of seconds > 0"),
             ("--warmup", args.warmup, args.warmup >= 2, "an integer >= 2"),
             ("--shift", args.shift, 0 < args.shift < 1, "a fraction in (0, 1)"),
             ("--arl", args.arl, args.arl >= 10, "a number of windows >= 10"),
             ("--persist", args.persist, args.persist >= 1, "an integer >= 1"),
             ("--margin", args.margin, args.margin is None or args.margin >= 0,
              "a fraction >= 0"),
             ("--k", args.k, args.k is None or args.k >= 1, "an integer >= 1"),
             ("--temperature", args.temperature, args.temperature is None or
              args.temperature >= 0, "a temperature >= 0"),
             ("--windows", args.windows, args.windows is None or args.windows >= 1,
              "an integer >= 1"),
             ("--duration", args.duration, args.duration is None or args.duration > 0,
              "a number of seconds > 0")]
    for name, value, ok, allowed in rules:
        if not ok:
            raise ConfigError(f"{name}={value} is invalid: allowed is {allowed}")
    if args.record is not None and args.replay is not None:
        raise ConfigError("--record is invalid with --replay: allowed is --record with --url "
                          "(a live server's scrapes)")
    if args.replay is not None and not args.replay.is_file():
        raise ConfigError(f"--replay={str(args.replay)!r} does not exist: allowed is a file "
                          "written by --record")


def check_model(url: str, study) -> list[str]:
    """One line unless the server serves the study's model; the names it serves."""
    from tuner.watch.source import fetch
    status, text = fetch(url + "/v1/models")
    try:
        data = json.loads(text).get("data") or [] if status == 200 else []
    except ValueError:
        data = []
    served = [str(m.get("id")) for m in data if isinstance(m, dict)]
    roots = [str(m.get("root")) for m in data if isinstance(m, dict) and m.get("root")]
    want = study.deployed_model
    if want is None:
        return served
    if not any(want in (name, Path(name).name) for name in served + roots):
        raise ConfigError(f"--url={url!r} serves {served or 'no model'} (/v1/models), not the "
                          f"model of study {study.name} ({want}): allowed is the server of the "
                          "study's deployment")
    return served


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        check_numbers(args)
        from tuner.watch.study import DEFAULT_MARGIN, read_study
        study = read_study(args.study, args.k)
        profile = None
        if args.profile:
            from tuner.predict.surface import load_profile
            # the target's steps are what is priced (a profile of another kind of step prices
            # the deployment too, biased: pricing_bias says how)
            target = (study.best.get("models") or {}).get("target")
            given = [(path, load_profile(path, models={"target": target} if target else None,
                                         engine=study.engine.name, setting="--profile"))
                     for path in args.profile]
            args.profile, profile = choose_profile(study, given)
        if args.margin is not None:
            margin, margin_source = args.margin, "--margin"
        elif study.calibration_error is not None:
            margin = max(study.calibration_error, 0.02)
            margin_source = ("the study's calibration (median error of predicted against "
                             "measured speedups)")
        else:
            margin, margin_source = DEFAULT_MARGIN, "no calibration recorded by the study"
        metrics = study.engine.live_metrics
        if args.url is not None:
            from tuner.watch.source import check_interval, check_metrics, live
            url = args.url.rstrip("/")
            cost = check_metrics(url, metrics, study.engine.display)
            served = check_model(url, study)
            check_interval(args.interval, cost)
            source = url
            header = {"url": url, "study": study.name, "engine": study.engine.name,
                      "served": served, "interval_s": args.interval}
            raws = live(url, args.interval, metrics, args.record, header)
        else:
            from tuner.watch.source import check_recording, check_text, replay
            first = next(replay(args.replay), None) if check_recording(args.replay) else None
            if first is None:
                raise ConfigError(f"--replay={str(args.replay)!r} holds no scrape: allowed is "
                                  "a file written by --record")
            check_text(first.text, metrics, study.engine.display,
                       f"--replay={str(args.replay)!r}")
            source, raws = f"replay of {args.replay}", replay(args.replay)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return run(args, study, profile, margin, margin_source, source, raws)


def step_kind(profile) -> str:
    """Which kind of step ``profile`` measured, in words."""
    draft = profile.models.get("draft")
    return f"a draft model's steps (models.draft={draft})" if draft else \
        "draft-free steps (n-gram drafting, no draft model)"


def choose_profile(study, given):
    """Of the (path, profile) pairs given, the one whose steps are the deployment's kind (a
    draft model's, or draft-free for n-gram drafting); the first where none is."""
    model = study.engine.drafts_with_model(list(study.argv))
    return next(((path, profile) for path, profile in given
                 if bool(profile.models.get("draft")) == model), given[0])


def pricing_bias(study, profile) -> str:
    """Why ``profile`` misprices the deployment's steps ("" where it does not): its steps were
    measured with a draft model and the deployment drafts without one (or the reverse). (Cells
    out of order at the batch priced stop a recommendation per window: ``tuner.watch.loop``.)"""
    if profile is None:
        return ""
    measured = bool(profile.models.get("draft"))
    deployed = study.engine.drafts_with_model(list(study.argv))
    if measured and not deployed:
        return (f"the profile's steps include its draft model's drafting (models.draft="
                f"{profile.models['draft']}); this deployment drafts from the context without "
                "a model, so its steps cost less: the prices of k > 0 are too low, and no "
                "switch is recommended from them (the measured time per output token stands "
                "beside each; measure with the re-tune command)")
    if deployed and not measured:
        return ("the profile was measured without a draft model (draft-free steps); this "
                "deployment drafts with one, so its steps cost more: the prices of k > 0 are too "
                "high, and no switch is recommended from them")
    return ""


def run(args, study, profile, margin, margin_source, source, raws) -> int:
    from tuner.watch.loop import WatchSettings, summary, watch
    from tuner.watch.record import JsonLog, WatchRun, experiment_of
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    settings = WatchSettings(
        study=study, source=source, min_steps=args.min_steps, warmup=args.warmup,
        shift=args.shift, arl=args.arl, profile=profile, margin=margin,
        margin_source=margin_source, persist=args.persist,
        traffic_temperature=args.temperature if args.temperature is not None
        else study.temperature, pricing_bias=pricing_bias(study, profile), out_dir=args.out,
        max_windows=args.windows, max_seconds=args.duration,
        profile_steps=f"{args.profile}: {step_kind(profile)}" if profile is not None else "")
    log = JsonLog(args.out / f"{study.name}.watch-{stamp}.jsonl")
    params = {"study": study.name, "source": source, "interval_s": args.interval,
              "min_steps": args.min_steps, "warmup": args.warmup, "shift": args.shift,
              "arl": args.arl, "profile": str(args.profile) if args.profile else "none",
              "profile_steps": step_kind(profile) if profile is not None else "none",
              "margin": margin, "margin_source": margin_source, "persist": args.persist,
              "deployed_k": study.deployed_k, "k_setting": study.k_setting,
              "traffic_temperature": settings.traffic_temperature,
              "study_temperature": study.temperature, "engine": study.engine.name,
              "launch": " ".join(study.argv)}
    log.write("start", params)
    tracked = None
    if args.tracking == "mlflow":
        experiment = args.experiment or experiment_of(
            args.tracking_uri, study.outcome.winner.run_id if study.outcome.winner else None,
            study.task)
        tracked = WatchRun(args.tracking_uri, experiment, f"watch-{study.name}", params,
                           {"study": study.name, "engine": study.engine.name})
    say = lambda line: print(line, flush=True)
    windows = f"a window closes at {args.min_steps} decode steps" \
        if args.min_steps != "auto" else (
            f"windows of {AUTO_START} decode steps during a warm-up, then sized to the traffic "
            "(--min-steps auto)")
    say(f"watching {source} for study {study.name} ({study.engine.display}, deployed "
        f"{study.k_setting}={study.deployed_k if study.deployed_k is not None else '?'}); "
        f"{windows}; reference: the first {args.warmup} "
        f"windows; CUSUM of a {100 * args.shift:.0f} % change (at most one false alarm per "
        f"{args.arl:.0f} windows under its model)")
    if profile is None:
        say(f"no --profile: alarms and ranges only; the decision cannot be priced (make one "
            f"with python -m tuner.profile --engine {study.engine.name})")
    else:
        say(f"pricing with the profile {args.profile}: {step_kind(profile)} "
            f"({profile.describe()}); a switch must win by {100 * margin:.0f} % "
            f"({margin_source}) in {args.persist} windows in a row")
        if settings.pricing_bias:
            say("  " + settings.pricing_bias)
    state = None
    status = "FINISHED"
    try:
        state = watch(settings, raws, log, tracked, say)
        if state.stopped == "Ctrl-C":
            status = "KILLED"
    except BaseException:
        status = "FAILED"
        raise
    finally:
        lines = summary(settings, state) if state is not None else ["watch failed"]
        if state is not None:
            say("=" * 78)
            for line in lines:
                say(line)
            say(f"log: {log.path}")
        log.write("summary", {"lines": lines})
        log.close()
        if tracked is not None:
            metrics = {} if state is None else {
                "windows": float(len(state.windows)), "alarms": float(len(state.alarms)),
                "restarts": float(len(state.restarts)),
                "recommendations": float(len(state.recommendations))}
            tracked.end(metrics, "\n".join(lines), [log.path] + (
                [] if state is None else [p for _, p in state.recommendations]), status)
            if state is not None:
                say(f"MLflow run {tracked.run_id} in experiment {tracked.experiment} "
                    f"({args.tracking_uri})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
