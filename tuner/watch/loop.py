"""One watch: scrapes → windows → the change test, the study's range and the priced decision →
one terminal line per window, the JSON Lines log, the MLflow run → a summary at the end (the
recording's end, ``--windows``/``--duration``, or Ctrl-C). It suggests; it never changes the
server."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from decoding.acceptance import total
from tuner.config.errors import ConfigError
from tuner.engines.metrics import MetricsError
from tuner.predict.check import inversions
from tuner.watch.decide import Decider, Pricing, Recommendation, price
from tuner.watch.drift import (
    AUTO_START,
    POWER,
    WITHIN,
    ChangeTest,
    Observation,
    Sizing,
    Verdict,
    WindowSizer,
    dispersion_bound,
)
from tuner.watch.source import Raw, ServerGone
from tuner.watch.study import length_interval
from tuner.watch.windows import Restart, Scrape, Window, Windower

if TYPE_CHECKING:
    from tuner.predict.surface import HardwareProfile
    from tuner.watch.record import JsonLog, WatchRun
    from tuner.watch.study import WatchedStudy


@dataclass(frozen=True)
class WatchSettings:
    study: WatchedStudy
    source: str                          # the URL, or "replay of <file>"
    min_steps: int | str                 # decode steps that close a window, or "auto"
    warmup: int
    shift: float
    arl: float
    profile: HardwareProfile | None
    margin: float
    margin_source: str                   # where the margin comes from, in words
    persist: int
    traffic_temperature: float | None    # what the user says the live traffic samples at
    # why the profile's prices are biased for this deployment ("": they are not): then no
    # switch is recommended from them
    pricing_bias: str
    out_dir: Path
    max_windows: int | None = None
    max_seconds: float | None = None
    profile_steps: str = ""              # the profile and which kind of step it measured


@dataclass
class WatchState:
    """What the watch saw (the summary reads it)."""

    windows: list[Window] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)
    alarms: list[tuple[Window, Verdict]] = field(default_factory=list)
    pricings: list[Pricing] = field(default_factory=list)
    recommendations: list[tuple[Recommendation, Path]] = field(default_factory=list)
    outside: list[Window] = field(default_factory=list)     # beyond the study's range
    sizings: list[Sizing] = field(default_factory=list)     # --min-steps auto: each size chosen
    disordered: dict[int, str] = field(default_factory=dict)   # batch -> its cells' disorder
    deployed_k: int | None = None
    stopped: str = ""


def comparable(settings: WatchSettings) -> str | None:
    """Why live acceptance is not comparable with the study's (None: it is)."""
    live, study = settings.traffic_temperature, settings.study.temperature
    if live is None or study is None or abs(live - study) < 1e-9:
        return None
    return (f"traffic at T={live:g} against a study at T={study:g}: acceptance is not "
            "comparable with the study's (the range check is off); the change test compares "
            "the deployment with its own start")


def window_line(w: Window, v: Verdict, pricing: Pricing | None, outside: str) -> str:
    acc = " ".join(f"{a:.2f}" for a in w.acceptance_per_pos[:8])
    ref = "" if v.reference is None else (f" (ref {v.reference.mean_length:.2f}, "
                                          f"{100 * (v.change or 0):+.0f} %)")
    batch = "?" if w.batch is None else f"{w.batch:.1f}"
    tpot = "" if w.tpot_s is None else f" tpot {1e3 * w.tpot_s:.1f} ms"
    if pricing is not None:
        tpot += f" (pred {1e3 * pricing.deployed.tpot_s:.1f})"
    state = v.state if v.state != "ALARM" else f"ALARM ({v.direction})"
    test = "" if v.reference is None else f" cusum {max(v.drop, v.rise):.1f}/{v.threshold:.1f}"
    decided = "" if pricing is None else " | " + pricing.line()
    return (f"window {w.index} [{w.seconds:.0f} s] steps {w.steps} drafts {w.drafts} "
            f"L {w.mean_length:.2f}{ref} acc/pos {acc or '-'} batch {batch}{tpot}{test} "
            f"{state}{outside}{decided}")


def window_metrics(w: Window, v: Verdict, pricing: Pricing | None) -> dict[str, float]:
    out = {"mean_length": w.mean_length, "steps": float(w.steps), "drafts": float(w.drafts),
           "drafted_per_step": w.drafted_per_step, "cusum_drop": v.drop, "cusum_rise": v.rise,
           "alarm": float(v.state == "ALARM"), "segment": float(w.segment)}
    out.update({f"acceptance_pos_{i}": a for i, a in enumerate(w.acceptance_per_pos)})
    if w.batch is not None:
        out["live_batch"] = w.batch
    if w.tpot_s is not None:
        out["tpot_ms"] = 1e3 * w.tpot_s
    if pricing is not None:
        out.update({f"predicted_speedup_k{p.k}": p.speedup for p in pricing.options})
        out["predicted_tpot_ms"] = 1e3 * pricing.deployed.tpot_s
    return out


def watch(settings: WatchSettings, raws: Iterator[Raw], log: JsonLog, run: WatchRun | None,
          say: Callable[[str], None] = print) -> WatchState:
    """The loop of the module docstring; returns what it saw (Ctrl-C ends it like the end of a
    recording: the caller prints the summary)."""
    study, metrics = settings.study, settings.study.engine.live_metrics
    sizer = WindowSizer(settings.shift, settings.arl) if settings.min_steps == "auto" else None
    windower = Windower(sizer.steps if sizer else int(settings.min_steps),
                        metrics.batch_is_window_mean,
                        not metrics.requests and study.engine.drafts_with_model(list(study.argv)))
    test = ChangeTest(settings.warmup, settings.shift, settings.arl)
    decider = Decider(settings.margin, settings.persist)
    state = WatchState(deployed_k=study.deployed_k)
    inferred = study.deployed_k is None
    not_comparable = comparable(settings)
    low_high = None if not_comparable or study.acceptance is None else \
        study.acceptance.interval()
    began = time.monotonic()
    try:
        for raw in raws:
            counters = None
            if raw.error:
                say(f"scrape failed ({raw.error}): the window stays open")
                log.write("gap", {"at": raw.at, "error": raw.error})
            else:
                try:
                    counters = metrics.read(raw.text)
                except MetricsError as err:
                    say(f"scrape skipped ({err})")
                    log.write("gap", {"at": raw.at, "error": str(err)})
            if counters is not None and inferred and \
                    len(counters.accepted_per_pos) > (state.deployed_k or 0):
                state.deployed_k = len(counters.accepted_per_pos)
                say(f"the study declares no draft size for its winner: k={state.deployed_k} "
                    "from the positions the server has counted so far (--k sets it)")
            events = [] if counters is None else windower.push(Scrape(raw.at, counters))
            for event in events:
                if isinstance(event, Restart):
                    state.restarts.append(event)
                    test.restart()
                    decider.reset()
                    say(f"server restarted (a counter went down): segment {event.segment} "
                        f"begins; the open window ({event.dropped_steps} steps) is dropped and "
                        f"the change test warms up again ({settings.warmup} windows)")
                    log.write("restart", {"at": event.at, "segment": event.segment,
                                          "dropped_steps": event.dropped_steps})
                    if sizer is not None:
                        sizer.restart()
                else:
                    handle_window(settings, state, event, test, decider, low_high, log, run,
                                  say)
                if sizer is not None:
                    size_windows(state, sizer, windower, test, log, say)
            if settings.max_windows is not None and len(state.windows) >= settings.max_windows:
                state.stopped = f"{settings.max_windows} windows"
                break
            if settings.max_seconds is not None and \
                    time.monotonic() - began >= settings.max_seconds:
                state.stopped = f"{settings.max_seconds:g} s"
                break
        else:
            state.stopped = "the end of the scrapes"
    except ServerGone as err:
        state.stopped = str(err)
    except KeyboardInterrupt:
        state.stopped = "Ctrl-C"
    except ConfigError as err:          # a malformed line further in a recording
        say(f"error: {err}")
        state.stopped = "an unreadable scrape"
    return state


def size_windows(state: WatchState, sizer: WindowSizer, windower: Windower, test: ChangeTest,
                 log: JsonLog, say: Callable[[str], None]) -> None:
    """``--min-steps auto`` (``tuner.watch.drift.WindowSizer``): the next window's size; a new
    one is said once, with why, and logged."""
    sizing = sizer.after(test)
    windower.min_steps = sizer.steps
    if sizing is None:
        return
    ref = sizing.reference
    state.sizings.append(sizing)
    say(sizing.describe())
    log.write("window_size", {"steps": sizing.steps, "drift": sizing.drift,
                              "mean_length": ref.mean_length, "variance": ref.variance,
                              "dispersion": ref.dispersion, "successive": ref.successive,
                              "dispersion_bound": dispersion_bound(ref),
                              "within": sizing.within, "power": sizing.power,
                              "bounded": sizing.bounded})


def handle_window(settings: WatchSettings, state: WatchState, w: Window, test: ChangeTest,
                  decider: Decider, low_high: tuple[float, float] | None, log: JsonLog,
                  run: WatchRun | None, say: Callable[[str], None]) -> None:
    study = settings.study
    verdict = test.observe(Observation(w.steps, w.accepted, w.step_variance()))
    state.windows.append(w)
    if verdict.shifted is not None:
        shifted = verdict.shifted
        say(shifted.describe())
        log.write("warmup_shift", {"ratio": shifted.ratio, "bound": shifted.bound,
                                   "at": shifted.at, "windows": shifted.windows,
                                   "before": shifted.before, "after": shifted.after})
    pricing = None
    if settings.profile is not None and state.deployed_k and w.steps:
        pricing = price(w, settings.profile, state.deployed_k,
                        study.engine.least_drafting_k(list(study.argv)))
        state.pricings.append(pricing)
    outside = ""
    if low_high is not None:
        pool = [x for x in state.windows[-settings.warmup:] if x.segment == w.segment]
        pooled = total([x.counts for x in pool])
        drafts = pooled.drafts
        if drafts and len(pool) >= settings.warmup:     # as many windows as a reference
            fractions = pooled.draft_fractions()
            # drafts of one request are not independent: widened by the reference's √φ
            spread = test.reference.dispersion if test.reference is not None else 1.0
            low, high = length_interval(fractions, drafts / spread)
            side = "below" if high < low_high[0] else "above" if low > low_high[1] else ""
            if side:
                outside = f" [{side} the study's range]"
                newly = len(state.windows) < 2 or not state.outside or \
                    state.outside[-1].index != state.windows[-2].index
                if newly:
                    say(f"re-tune hint: live acceptance over the last {len(pool)} windows "
                        f"({1 + sum(fractions):.2f} tokens per draft, {low:.2f}-{high:.2f}) is "
                        f"{side} what the study measured ({low_high[0]:.2f}-{low_high[1]:.2f}, "
                        "95 % intervals): the study's prompts do not represent this traffic")
                state.outside.append(w)
    say(window_line(w, verdict, pricing, outside))
    body = {"window": w.index, "segment": w.segment, "start": w.start, "end": w.end,
            "steps": w.steps, "drafts": w.drafts, "draft_tokens": w.draft_tokens,
            "accepted": w.accepted, "accepted_per_pos": list(w.accepted_per_pos),
            "generated": w.generated, "mean_length": w.mean_length,
            "acceptance_per_pos": list(w.acceptance_per_pos), "batch": w.batch,
            "tpot_s": w.tpot_s, "state": verdict.state, "direction": verdict.direction,
            "cusum_drop": verdict.drop, "cusum_rise": verdict.rise,
            "threshold": verdict.threshold, "outside_study_range": bool(outside),
            "reference_mean_length": None if verdict.reference is None else
            verdict.reference.mean_length}
    if pricing is not None:
        body["pricing"] = {"batch": pricing.batch, "note": pricing.note, "options": [
            {"k": p.k, "speedup": p.speedup, "mean_length": p.mean_length,
             "drafted_per_step": p.drafted_per_step, "exact": p.exact, "tpot_s": p.tpot_s}
            for p in pricing.options]}
    log.write("window", body)
    if run is not None:
        run.window(w.index, w.end, window_metrics(w, verdict, pricing))
    if verdict.state == "ALARM":
        state.alarms.append((w, verdict))
        ref = verdict.reference
        say(f"ALARM: the mean accepted length {verdict.direction}s: {w.mean_length:.2f} "
            f"against the reference {ref.mean_length:.2f} of the first {ref.windows} windows "
            f"({100 * (verdict.change or 0):+.0f} %; CUSUM {max(verdict.drop, verdict.rise):.1f} "
            f"> {verdict.threshold:.1f}); the new level becomes the reference after "
            f"{settings.warmup} windows")
        if pricing is None:
            say("  the decision cannot be priced: no profile (--profile, made by python -m "
                "tuner.profile --engine " + study.engine.name + ")")
        else:
            say("  priced now: " + ", ".join(
                f"{'off' if p.k == 0 else f'k={p.k}'} {p.speedup:.2f}x"
                + ("" if p.exact else "~") for p in pricing.options)
                + f" at batch {pricing.batch} (~: an estimate)"
                + (f"; {pricing.note}" if pricing.note else ""))
        say("  re-tune on prompts like this traffic: " + study.retune_command(
            sorted({x.live_batch for x in state.windows[-settings.warmup:]
                    if x.live_batch is not None}), settings.traffic_temperature))
        decider.reset()
        log.write("alarm", {"window": w.index, "direction": verdict.direction,
                            "mean_length": w.mean_length, "reference": ref.mean_length,
                            "change": verdict.change})
    if pricing is not None and not settings.pricing_bias:
        disorder = inversions(settings.profile, batch=pricing.batch)
        if disorder:                      # prices between k there rest on cells out of order
            if pricing.batch not in state.disordered:
                state.disordered[pricing.batch] = disorder[0]
                say(f"  no switch is recommended at batch {pricing.batch}: the profile's cells "
                    f"there are out of order ({disorder[0]}); make it again with more "
                    "--prompts on a quiet machine")
            decider.skip()
            return
        found = decider.observe(pricing)
        if found is not None:
            recommend(settings, state, found, log, say)


def recommend(settings: WatchSettings, state: WatchState, found: Recommendation,
              log: JsonLog, say: Callable[[str], None]) -> None:
    """Write the candidate schedule in the engine's form and say how to re-tune."""
    study = settings.study
    schedule = found.schedule()
    form = study.engine.candidate_form(list(study.argv), schedule)
    number = len(state.recommendations) + 1
    path = settings.out_dir / f"{study.name}.candidate-{number}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"study": study.name, "recommendation": found.line(),
                                "schedule": schedule.ranges(),
                                "engine_form": form, "exact": found.exact}, indent=1) + "\n")
    state.recommendations.append((found, path))
    levels = sorted({p.batch for p in found.windows})
    say("RECOMMENDATION: " + found.line())
    say(f"  the candidate in {study.engine.display}'s form: {path} (nothing was changed on the "
        "server)")
    say("  measure it before deploying: " + study.retune_command(
        levels, settings.traffic_temperature))
    log.write("recommendation", {"line": found.line(), "k": found.k, "file": str(path),
                                 "form": form, "gains": found.gains})


def summary(settings: WatchSettings, state: WatchState) -> list[str]:
    """The readable end of a watch."""
    study, ws = settings.study, state.windows
    lines = [(f"watch of {study.name} ({study.engine.display}, {settings.source}) ended at "
              f"{state.stopped or 'its end'}")]
    if not ws:
        first = AUTO_START if settings.min_steps == "auto" else settings.min_steps
        lines.append(f"no window closed (fewer than {first} decode steps between scrapes): "
                     "nothing to judge")
        return lines
    span = ws[-1].end - ws[0].start
    counts = total([w.counts for w in ws])
    lines.append(f"windows {len(ws)} over {span:.0f} s, {counts.decode_steps} decode steps, "
                 f"mean accepted length {counts.tokens_per_decode_step:.2f}; segments "
                 f"{len(state.restarts) + 1} "
                 f"(server restarts: {len(state.restarts)})")
    if state.sizings:
        lines.append(f"windows sized to the traffic (--min-steps auto) after each warm-up of "
                     f"{AUTO_START} steps: " + ", ".join(str(z.steps) for z in state.sizings)
                     + f" decode steps (a {settings.shift:.0%} change in L found within "
                     f"{WITHIN} windows in {POWER:.1%} of cases under the model)")
    if state.alarms:
        for w, v in state.alarms:
            lines.append(f"alarm at window {w.index}: mean accepted length {v.direction} "
                         f"{100 * (v.change or 0):+.0f} % against the reference "
                         f"{v.reference.mean_length:.2f}")
    else:
        lines.append(f"no alarm (CUSUM of a {100 * settings.shift:.0f} % change, at most one "
                     f"false alarm per {settings.arl:.0f} windows under its model)")
    why = comparable(settings)
    if why:
        lines.append(why)
    elif study.acceptance is None:
        lines.append("the study recorded no acceptance per position: no range to compare")
    elif state.outside:
        lines.append(f"{len(state.outside)} of {len(ws)} windows outside the study's measured "
                     "acceptance: re-tune on prompts like this traffic")
    if settings.profile is None:
        lines.append("decision: not priced (no --profile): alarms and ranges only")
    elif state.pricings:
        last = state.pricings[-1]
        lines.append("decision at the last window" + (
            f" (priced with {settings.profile_steps})" if settings.profile_steps else "")
            + ": " + last.line()
                     + (f" ({last.note})" if last.note else ""))
    if settings.profile is not None and settings.pricing_bias:
        lines.append("decision: priced, no switch recommended (the profile misprices this "
                     "deployment's steps: see the line at the start)")
    for batch, line in sorted(state.disordered.items()):
        lines.append(f"decision at batch {batch}: priced, no switch recommended (the "
                     f"profile's cells there are out of order: {line})")
    for found, path in state.recommendations:
        lines.append(f"recommended: {found.line()} -> {path}")
    return lines
