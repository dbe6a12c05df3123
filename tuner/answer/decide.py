"""The finish step's decisions, each made once from the study's data (``tuner.answer.outcome``),
all by the study's one objective.

Per concurrency level (engine servers) the figure is the objective's at that level
(``level_figure``: ``decode_speedup@c<level>`` for an engine's default objective, the end-to-end
``speedup`` or ``throughput_ratio`` where the user chose them): never a second metric. Per request
rate it is the rate's counterpart (goodput under ``search.slo``, else TPOT for the decode phase,
end-to-end latency for the end-to-end objective). A level has one winner: the study's winner
where the study measured one level (its figure there is the objective), else the best trial by
the figure at that level. The rule, for each:

* OFF where that trial did not beat vanilla on the tuning prompts;
* NOT_CONFIRMED without held-out figures there, or on fewer than ``min_held_out_prompts``;
* OFF where the held-out winner broke the quality bound, or did not beat vanilla beyond the
  noise: its held-out ratio there must exceed 1 + the A/A control's bias (``margin``) with its
  one-sided 95 % lower confidence bound (``*_lcb``: ``tuner.measure.intervals.lower_bound``), or,
  where no bound can be computed (a rate's percentiles, one prompt), by ``STATED_MARGIN``; and
  no more of it counts than its tokens per decode step allow (``credible``: a setting that
  accepted nothing on the held-out prompts is never ON, however fast its server process ran:
  two server processes of identical settings differ by a few per cent for their lifetime);
* ON otherwise.

The recommendation (``recommendation``) is read from these decisions where the study has any
(engines): one clause per level and rate, so it can never say both "use vanilla" and ON for the
same place; in process it is ``tuner.answer.verdict.recommendation`` by the same rule. A study of
``method=vanilla`` is an A/A control of its path: it never recommends vanilla over itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from tuner.measure.bounds import credible
from tuner.measure.figures import level_key, rate_key, rate_text, split_level
from tuner.search.space import active_params
from tuner.answer import verdict
from tuner.answer.outcome import Decision, State
from tuner.study.record import TrialRecord
from tuner.study.trials import completed, trial_params

if TYPE_CHECKING:
    import optuna

    from tuner.study.settings import StudySettings

LEVEL_FIGURES = {"speedup": "end-to-end speedup", "decode_speedup": "decode-phase speedup",
                 "throughput_ratio": "throughput"}
STATED_MARGIN = 0.03        # beyond vanilla where no confidence bound exists (a rate's p50)


@dataclass(frozen=True)
class Judged:
    """Whether a held-out figure beats vanilla beyond the noise, and the words for it."""

    beats: bool | None           # None: no held-out figure
    text: str


def judge_held_out(confirmed: Mapping[str, Any], name: str, level: int | None,
                   margin: float) -> Judged:
    """The held-out ``name`` (at ``level``) against vanilla by the module docstring's rule: its
    lower bound, and no more than the tokens per decode step allow (``credible``)."""
    def key(figure: str) -> str:
        return level_key(figure, level) if level is not None else figure
    point = confirmed.get(key(f"held_out_{name}"))
    if point is None:
        return Judged(None, "n/a")
    low = confirmed.get(key(f"held_out_{name}_lcb"))
    length = confirmed.get(key("held_out_decode_tokens_per_step"))
    prompts = int(confirmed.get("held_out_prompts", 0))
    steps = "" if length is None else f", {length:.2f} tokens per decode step"
    if low is not None and low > 0:
        return Judged(credible(low, length) > 1.0 + margin,
                      f"{point:.3f}x (95 % lower bound {low:.3f}x{steps}, {prompts} prompts)")
    needed = 1.0 + max(margin, STATED_MARGIN)
    return Judged(credible(point, length) > needed,
                  f"{point:.3f}x ({prompts} prompts{steps}, no lower bound: beyond "
                  f"{needed:.2f}x needed)")


def level_figure(settings: StudySettings) -> str:
    """The objective's figure at a level (module docstring)."""
    name = split_level(settings.objectives[0])[0]
    return name if name in LEVEL_FIGURES else settings.engine_object.default_objective


def decisions(settings: StudySettings, study: optuna.Study, confirmed: Mapping[str, float],
              winner: int | None = None, margin: float = 0.0
              ) -> tuple[tuple[Decision, ...], tuple[Decision, ...]]:
    """(per level, per measured rate): each decided once; ``winner``: the study's winner (the
    one level's winner where the study measured one), ``margin``: the A/A control's bias."""
    levels: list[Decision] = []
    if settings.engine_object.max_concurrency > 1:
        levels = [d for level in settings.concurrency
                  if (d := level_decision(settings, study, confirmed, level, winner, margin))
                  is not None]
    rates = [d for rate in rates_of(settings)
             if (d := rate_decision(settings, study, confirmed, rate, margin)) is not None]
    return tuple(levels), tuple(rates)


def decide(kind: str, at: str, line: str, tuning: float, held: float | None,
           tuning_better: bool, judged: Judged, trial: int, params: dict[str, Any],
           chosen: str, tuning_lost: str, gate: str | None = None) -> Decision:
    """The module docstring's rule, and the line that says it; ``gate``: why the held-out
    figure cannot confirm (quality, too few prompts) where it cannot."""
    where = "level" if kind == "level" else "rate"
    if not tuning_better:
        state, text = State.OFF, f"speculation OFF at this {where} ({tuning_lost})"
    elif judged.beats is None:
        state, text = State.NOT_CONFIRMED, (f"not confirmed (no held-out prompts at this "
                                            f"{where}): tuning favours {chosen}")
    elif gate == "few":
        state, text = State.NOT_CONFIRMED, (f"not confirmed (fewer held-out prompts than "
                                            f"min_held_out_prompts): tuning favours {chosen}")
    elif gate == "quality":
        state, text = State.OFF, (f"speculation OFF at this {where} (the winner broke the "
                                  "quality bound on the held-out prompts)")
    elif not judged.beats:
        state, text = State.OFF, (f"speculation OFF at this {where} (faster on the tuning "
                                  "prompts only: not beyond the noise on the held-out ones)")
    else:
        state, text = State.ON, f"speculation ON: {chosen}"
    return Decision(kind, at, state, params, trial, tuning, held, line + text)


def gate_of(settings: StudySettings, confirmed: Mapping[str, float]) -> str | None:
    """Why held-out figures cannot confirm anything (None: they can)."""
    if not confirmed:
        return None
    if confirmed.get("held_out_feasible") == 0.0:
        return "quality"
    if int(confirmed.get("held_out_prompts", 0)) < settings.min_held_out_prompts:
        return "few"
    return None


def level_decision(settings: StudySettings, study: optuna.Study,
                   confirmed: Mapping[str, float], level: int, winner: int | None = None,
                   margin: float = 0.0) -> Decision | None:
    """Concurrency ``level``'s decision by the objective's figure there; None where no trial
    measured the level."""
    name = level_figure(settings)
    done = {t.number: t for t in completed(study)}
    top = done.get(winner) if winner is not None and len(settings.concurrency) == 1 else None
    if top is None or TrialRecord.read(top).at_level(name, level) is None:
        top = level_best(study, name, level)
    if top is None:
        return None
    ratio = TrialRecord.read(top).at_level(name, level)
    judged = judge_held_out(confirmed, name, level, margin)
    held = confirmed.get(level_key(f"held_out_{name}", level))
    params = trial_params(settings, top)
    shown = active_params(params, settings.space)
    label = LEVEL_FIGURES[name]
    line = (f"best tuning {label} {ratio:.3f}x vanilla (trial #{top.number}); the winner on "
            f"held-out prompts {judged.text}; ")
    return decide("level", str(level), line, ratio, held, ratio > 1.0, judged, top.number,
                  params, f"trial #{top.number} {shown}", "vanilla is faster",
                  gate_of(settings, confirmed))


def level_best(study: optuna.Study, name: str, level: int) -> optuna.trial.FrozenTrial | None:
    """The completed trial with the highest ``name`` at concurrency ``level``, or None."""
    done = completed(study)
    figures = {t.number: TrialRecord.read(t).at_level(name, level) for t in done}
    measured = [t for t in done if figures[t.number] is not None]
    return max(measured, key=lambda t: figures[t.number]) if measured else None


def rates_of(settings: StudySettings) -> list[str]:
    """``budget.request_rate`` as the figures' keys name them (``4``, ``0.5``)."""
    return [rate_text(rate) for rate in settings.traffic.rates]


def rate_figure(settings: StudySettings) -> tuple[str, str, str, int, bool]:
    """(figure, label, unit, digits, higher is better) a rate is decided by: goodput under an
    SLO; else the objective's counterpart (end-to-end latency for ``speedup``, TPOT for the
    decode phase)."""
    if settings.traffic.slo:
        bounds = ", ".join(f"{k} <= {v:g}" for k, v in settings.traffic.slo.items())
        return "goodput", f"goodput (SLO {bounds})", "req/s", 2, True
    if level_figure(settings) == "speedup":
        return "e2e_ms_p50", "end-to-end latency p50", "ms", 0, False
    return "tpot_ms_p50", "TPOT p50", "ms", 1, False


def rate_gain(figures: Mapping[str, float], rate: str, figure: str, higher: bool,
              prefix: str = "") -> float | None:
    """How much better than vanilla at ``rate``, relatively: the method's ``figure`` over
    vanilla's, minus 1 (inverted where lower is better). None where the rate was not
    measured; +inf where vanilla scored 0 goodput and the method did not."""
    got, ref = (figures.get(rate_key(f"{prefix}{side}{figure}", rate))
                for side in ("", "vanilla_"))
    if got is None or ref is None or not (math.isfinite(got) and math.isfinite(ref)):
        return None
    if higher:
        return got / ref - 1.0 if ref > 0 else (math.inf if got > 0 else 0.0)
    return ref / got - 1.0 if got > 0 else None


def rate_decision(settings: StudySettings, study: optuna.Study,
                  confirmed: Mapping[str, float], rate: str,
                  margin: float = 0.0) -> Decision | None:
    """Request rate ``rate``'s decision (``rate_figure``); None where no trial measured it."""
    figure, label, unit, digits, higher = rate_figure(settings)
    done = completed(study)
    gains = {t.number: rate_gain(TrialRecord.read(t).figures, rate, figure, higher)
             for t in done}
    measured = [t for t in done if gains[t.number] is not None]
    if not measured:
        return None
    top = max(measured, key=lambda t: gains[t.number])
    figures = TrialRecord.read(top).figures
    held = rate_gain(confirmed, rate, figure, higher, "held_out_")
    params = trial_params(settings, top)
    shown = active_params(params, settings.space)
    needed = max(margin, STATED_MARGIN)
    judged = Judged(None if held is None else held > needed, "")

    def pair(prefix: str, name: str, label: str, unit: str, digits: int) -> str:
        source = confirmed if prefix else figures
        got = source.get(rate_key(f"{prefix}{name}", rate))
        ref = source.get(rate_key(f"{prefix}vanilla_{name}", rate))
        return f"{label} n/a" if got is None or ref is None else \
            f"{label} {got:.{digits}f} vs vanilla {ref:.{digits}f} {unit}"

    line = (f"best tuning {pair('', figure, label, unit, digits)} (trial #{top.number}); the "
            f"winner on held-out prompts {pair('held_out_', figure, label, unit, digits)} "
            f"(beyond vanilla by {100 * needed:.0f} % needed: no lower bound at a rate), "
            f"{pair('held_out_', 'tpot_ms_p90', 'TPOT p90', 'ms', 1)}, "
            f"{pair('held_out_', 'ttft_ms_p90', 'TTFT p90', 'ms', 0)}; ")
    lost = ("vanilla met the SLO as often" if figure == "goodput" else
            "vanilla is as fast or faster")
    return decide("rate", rate, line, gains[top.number], held, gains[top.number] > 0, judged,
                  top.number, params, f"trial #{top.number} {shown}", lost,
                  gate_of(settings, confirmed))


def recommendation(settings: StudySettings, confirmed: Mapping[str, float],
                   levels: tuple[Decision, ...], rates: tuple[Decision, ...],
                   margin: float = 0.0) -> str:
    """The study's one recommendation (module docstring)."""
    if settings.method_choice == "vanilla":
        return verdict.self_control(confirmed, settings.objectives[0])
    if levels or rates:
        return from_decisions(levels + rates, bool(confirmed))
    return verdict.recommendation(confirmed, settings.min_held_out_prompts,
                                  settings.objectives[0], margin)


def from_decisions(decided: tuple[Decision, ...], confirmed: bool) -> str:
    """One clause per level and rate, each its decision's own answer."""
    if not confirmed:
        return "no held-out prompts: the winner is unconfirmed (task.n_held_out=0)"
    if all(d.state is State.OFF for d in decided):
        return ("use vanilla decoding: no level or rate beat it beyond the noise ("
                + "; ".join(f"{d.label}: {reason_of(d)}" for d in decided) + ")")

    def clause(d: Decision) -> str:
        if d.state is State.ON:
            return (f"at {d.label}: deploy trial #{d.trial} ({d.held_out:.3f}x vanilla held "
                    "out; the deploy lines below)" if d.held_out is not None else
                    f"at {d.label}: deploy trial #{d.trial} (the deploy lines below)")
        if d.state is State.NOT_CONFIRMED:
            return (f"at {d.label}: keep vanilla decoding until held-out prompts confirm "
                    f"trial #{d.trial}")
        return f"at {d.label}: use vanilla decoding"
    return "; ".join(clause(d) for d in decided)


def reason_of(d: Decision) -> str:
    """The parenthesised reason of an OFF line."""
    text = d.reason.rsplit("speculation OFF at this ", 1)[-1]
    return text[text.find("(") + 1:text.rfind(")")] if "(" in text else text
