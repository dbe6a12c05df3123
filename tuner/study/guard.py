"""The A/A control as a guard: before an engine study's first trial, vanilla against itself
through the path its trials take (``Evaluator.control``, ``tuner.measure.control``).

On the tuning prompts at the study's first concurrency level (a few seconds on the embedded
model; its time is said), once per study (the report is kept as the study attribute
``control``; a resumed study reads it back). Its noise widens the physical bound's slack
(``tuner.measure.bounds.slack_for``). Beyond its bound it is measured once more (a noise
excursion rarely repeats: at the 99 % intervals of ``tuner.measure.control`` a fair path is
refused about once in a few thousand studies); beyond it again, the study stops in one line that
names the gap (``MeasurementRefused``), unless ``control.override=true``: then it measures
anyway and the study records the override (``control_override``), which its summary repeats.
``control.guard=false`` skips it (recorded as ``control_skipped``). In process nothing runs
here: our loops' path is checked by ``python -m tuner.control`` and the tests.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from tuner.config.errors import MeasurementRefused
from tuner.measure.bounds import slack_for
from tuner.measure.control import ControlReport, level_rows, rate_rows

if TYPE_CHECKING:
    import optuna

    from tuner.study.settings import StudySettings

CONTROL = "control"                      # study attribute: the guard's report (JSON)
OVERRIDE = "control_override"            # ... the gap measured anyway (control.override=true)
SKIPPED = "control_skipped"              # ... control.guard=false


def path_of(settings: StudySettings) -> str:
    """What the control measures against what, in words."""
    engine = settings.engine_object
    if engine.own_loops:
        return (f"in process ({settings.engine['kind']}): vanilla against a second vanilla after "
                f"method={settings.method_choice} ran")
    if settings.method_choice == "vanilla":
        return f"{engine.display}: the baseline server against a second one launched alike"
    form = "the same line with drafting made impossible" if \
        settings.engine.get("baseline") == "matched" else "no speculative flags"   # vLLM: none
    return (f"{engine.display}: the baseline server ({form}) against method="
            f"{settings.method_choice}'s server launched with drafting off")


def measure_control(settings: StudySettings, evaluator: Any, params: dict[str, Any],
                    prompts: list, levels: tuple[int, ...] | None = None,
                    rates: bool = True, parity: int = 0) -> ControlReport:
    """One path's control on ``prompts`` (index, prompt) at ``levels`` (None: every level);
    ``parity``: which side goes first (``Evaluator.measure``)."""
    began = time.perf_counter()
    pairs = list(evaluator.control(params, prompts, parity, levels, rates))
    rows = level_rows(pairs) + (rate_rows(evaluator.rate_requests) if rates else [])
    return ControlReport(path_of(settings), tuple(rows), time.perf_counter() - began,
                         {"study": settings.name, "engine": evaluator.describe(),
                          "method": settings.method_choice, "params": dict(params),
                          "task": settings.task.name, "prompts": len(prompts),
                          "max_new_tokens": settings.budget["max_new_tokens"],
                          "levels": list(levels or settings.concurrency)})


def guard(settings: StudySettings, study: optuna.Study, evaluator: Any,
          say: Callable[[str], None]) -> None:
    """The module docstring's guard, before the first trial of an engine study."""
    if settings.engine_object.own_loops:
        return
    if not settings.control["guard"]:
        if SKIPPED not in study.user_attrs:
            study.set_user_attr(SKIPPED, True)
        say("A/A control: skipped (control.guard=false, recorded in the study)")
        return
    kept = study.user_attrs.get(CONTROL)
    if kept is not None:
        evaluator.bound_slack = max(settings.bound_slack, slack_for(kept.get("pair_log_sd")))
        say(f"A/A control (measured before the first trial): "
            f"{'within its bound' if kept['within'] else 'BEYOND its bound, overridden'}")
        return
    level = settings.concurrency[0]
    prompts = list(enumerate(settings.tuning))
    say(f"A/A control before the first trial: {path_of(settings)}, on the {len(prompts)} "
        f"tuning prompts at concurrency {level} (vanilla twice per prompt; control.guard=false "
        "skips it)")
    report = measure_control(settings, evaluator, dict(settings.default), prompts, (level,),
                             rates=False)
    for line in report.lines():
        say(line)
    if not report.within:
        say(f"beyond: {report.gap_line()}; measuring the control once more")
        first, report = report, measure_control(settings, evaluator, dict(settings.default),
                                                prompts, (level,), rates=False, parity=1)
        for line in report.lines():
            say(line)
        if not report.within:
            report = ControlReport(report.path, report.rows, first.seconds + report.seconds,
                                   {**report.details, "first": first.to_json()})
    study.set_user_attr(CONTROL, report.to_json())
    evaluator.bound_slack = max(settings.bound_slack, slack_for(report.pair_log_sd))
    if report.within:
        return
    if settings.control["override"]:
        study.set_user_attr(OVERRIDE, report.gap_line())
        say("measuring anyway: control.override=true (recorded in the study and its summary)")
        return
    study.set_user_attr(CONTROL, None)        # measured again on the next run
    raise MeasurementRefused(f"A/A control beyond its bound: {report.gap_line()}; the two "
                             "sides of this path do not run alike here (docs/engines.md, the "
                             "baseline); re-run on a quiet machine, or pass "
                             "control.override=true to measure anyway (recorded)")
