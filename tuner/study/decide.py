"""The finish step's decisions, each made once from the study's data (``tuner.study.outcome``).

Per concurrency level (engine servers) and per request rate, one rule: speculation is ON where
the best tuning trial there beat vanilla *and* the held-out confirmation (which measures the
overall winner) beat vanilla there; NOT_CONFIRMED without held-out figures there; OFF where one
of them lost. The recommendation is the held-out verdict (``tuner.study.verdict
.recommendation``), the rate's own decision where a rate objective chose the winner, and names
the levels and rates whose decision is ON where it says to stay with vanilla.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

from tuner.measure.figures import level_key, parse, rate_key, rate_text
from tuner.search.space import active_params
from tuner.study import verdict
from tuner.study.outcome import Decision, State
from tuner.study.record import TrialRecord
from tuner.study.trials import completed, trial_params

if TYPE_CHECKING:
    import optuna

    from tuner.study.settings import StudySettings


def decisions(settings: StudySettings, study: optuna.Study, confirmed: Mapping[str, float]
              ) -> tuple[tuple[Decision, ...], tuple[Decision, ...]]:
    """(per level, per measured rate): each decided once."""
    levels: list[Decision] = []
    if settings.engine_object.max_concurrency > 1:
        levels = [d for level in settings.concurrency
                  if (d := level_decision(settings, study, confirmed, level)) is not None]
    rates = [d for rate in rates_of(settings)
             if (d := rate_decision(settings, study, confirmed, rate)) is not None]
    return tuple(levels), tuple(rates)


def decide(kind: str, at: str, line: str, tuning: float, held: float | None,
           tuning_better: bool, held_better: bool | None, trial: int,
           params: dict[str, Any], chosen: str, tuning_lost: str, held_lost: str) -> Decision:
    """The module docstring's rule, and the line that says it."""
    where = "level" if kind == "level" else "rate"
    if not tuning_better:
        state, text = State.OFF, f"speculation OFF at this {where} ({tuning_lost})"
    elif held_better is None:
        state, text = State.NOT_CONFIRMED, (f"not confirmed (no held-out prompts at this "
                                            f"{where}): tuning favours {chosen}")
    elif not held_better:
        state, text = State.OFF, f"speculation OFF at this {where} ({held_lost})"
    else:
        state, text = State.ON, f"speculation ON: {chosen}"
    return Decision(kind, at, state, params, trial, tuning, held, line + text)


def level_decision(settings: StudySettings, study: optuna.Study,
                   confirmed: Mapping[str, float], level: int) -> Decision | None:
    """Concurrency ``level``'s decision by throughput over vanilla; None where no trial
    measured the level."""
    top = level_best(study, "throughput_ratio", level)
    if top is None:
        return None
    ratio = TrialRecord.read(top).at_level("throughput_ratio", level)
    held = confirmed.get(level_key("held_out_throughput_ratio", level))
    params = trial_params(settings, top)
    shown = active_params(params, settings.space)
    line = (f"best tuning throughput {ratio:.3f}x vanilla (trial #{top.number}); the winner on "
            f"held-out prompts {'n/a' if held is None else f'{held:.3f}x'}; ")
    return decide("level", str(level), line, ratio, held, ratio > 1.0,
                  None if held is None else held > 1.0, top.number, params,
                  f"trial #{top.number} {shown}", "vanilla is faster",
                  "faster on the tuning prompts only; vanilla was faster on the held-out ones")


def level_best(study: optuna.Study, name: str, level: int) -> optuna.trial.FrozenTrial | None:
    """The completed trial with the highest ``name`` at concurrency ``level``, or None."""
    done = completed(study)
    figures = {t.number: TrialRecord.read(t).at_level(name, level) for t in done}
    measured = [t for t in done if figures[t.number] is not None]
    return max(measured, key=lambda t: figures[t.number]) if measured else None


def rates_of(settings: StudySettings) -> list[str]:
    """``budget.request_rate`` as the figures' keys name them (``4``, ``0.5``)."""
    return [rate_text(rate) for rate in settings.traffic.rates]


def rate_gain(figures: Mapping[str, float], rate: str, slo: bool,
              prefix: str = "") -> float | None:
    """How much better than vanilla at ``rate``: with an SLO, goodput minus vanilla's
    (requests/s that met it); without, vanilla's TPOT p50 over the method's, minus 1. None
    where the rate was not measured."""
    if slo:
        got, ref = (figures.get(rate_key(f"{prefix}{side}goodput", rate))
                    for side in ("", "vanilla_"))
        gain = None if got is None or ref is None else got - ref
    else:
        ratio = figures.get(rate_key(f"{prefix}tpot_ratio", rate))
        gain = None if ratio is None else ratio - 1.0
    return gain if gain is not None and math.isfinite(gain) else None


def rate_decision(settings: StudySettings, study: optuna.Study,
                  confirmed: Mapping[str, float], rate: str) -> Decision | None:
    """Request rate ``rate``'s decision: by goodput under ``search.slo``, else by TPOT; None
    where no trial measured it."""
    slo = bool(settings.traffic.slo)
    done = completed(study)
    gains = {t.number: rate_gain(TrialRecord.read(t).figures, rate, slo) for t in done}
    measured = [t for t in done if gains[t.number] is not None]
    if not measured:
        return None
    top = max(measured, key=lambda t: gains[t.number])
    figures = TrialRecord.read(top).figures
    held = rate_gain(confirmed, rate, slo, "held_out_")
    params = trial_params(settings, top)
    shown = active_params(params, settings.space)

    def pair(prefix: str, name: str, label: str, unit: str, digits: int) -> str:
        source = confirmed if prefix else figures
        got = source.get(rate_key(f"{prefix}{name}", rate))
        ref = source.get(rate_key(f"{prefix}vanilla_{name}", rate))
        return f"{label} n/a" if got is None or ref is None else \
            f"{label} {got:.{digits}f} vs vanilla {ref:.{digits}f} {unit}"

    bounds = ", ".join(f"{k} <= {v:g}" for k, v in (settings.traffic.slo or {}).items())
    what = ("goodput", f"goodput (SLO {bounds})", "req/s", 2) if slo else \
        ("tpot_ms_p50", "TPOT p50", "ms", 1)
    line = (f"best tuning {pair('', *what)} (trial #{top.number}); the winner on held-out "
            f"prompts {pair('held_out_', *what)}, "
            f"{pair('held_out_', 'tpot_ms_p90', 'TPOT p90', 'ms', 1)}, "
            f"{pair('held_out_', 'ttft_ms_p90', 'TTFT p90', 'ms', 0)}; ")
    return decide("rate", rate, line, gains[top.number], held, gains[top.number] > 0,
                  None if held is None else held > 0, top.number, params,
                  f"trial #{top.number} {shown}",
                  f"vanilla {'met the SLO as often' if slo else 'is as fast or faster'}",
                  "better on the tuning prompts only; not on the held-out ones")


def recommendation(settings: StudySettings, confirmed: Mapping[str, float],
                   levels: tuple[Decision, ...], rates: tuple[Decision, ...]) -> str:
    """The study's one recommendation (module docstring), from the decisions above."""
    advice = rate_advice(settings, confirmed, rates) or verdict.recommendation(
        confirmed, settings.min_held_out_prompts, settings.objectives[0])
    on_at = [d.label for d in levels + rates if d.state is State.ON]
    return verdict.with_exceptions(advice, on_at)


def rate_advice(settings: StudySettings, confirmed: Mapping[str, float],
                rates: tuple[Decision, ...]) -> str | None:
    """The recommendation of a study chosen by a request-rate objective (``goodput@r4``), from
    that rate's own decision, so the two agree; None (the usual recommendation) for any other
    objective, without held-out figures, or where the usual gates speak first (the winner broke
    the quality bound, or too few held-out prompts)."""
    objective = settings.objectives[0]
    key = parse(objective)
    rate = None if key is None or key.rate is None else rate_text(key.rate)
    if rate is None or not confirmed or confirmed.get("held_out_feasible") == 0.0 or \
            int(confirmed.get("held_out_prompts", 0)) < settings.min_held_out_prompts:
        return None
    decision = next((d for d in rates if d.at == rate), None)
    if decision is None:
        return None
    verdict = {State.OFF: "use vanilla decoding",
               State.ON: "use the setting this line names (deploy.per_rate in the best YAML)",
               State.NOT_CONFIRMED: "keep vanilla decoding until held-out prompts confirm the "
                                    "setting it names"}[decision.state]
    return f"at {rate} requests/s (the objective {objective}): {verdict}; {decision.reason}"
