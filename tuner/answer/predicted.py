"""The study's side of prediction: predicted against measured over its trials, and
``search.predict_for`` (the grid ranked for another machine, with its per-batch-size schedule).
The pricing and the planning live in ``tuner.predict``; this module hands them the study's
points and the evaluator's acceptance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from tuner.measure.figures import Figures
from tuner.predict.predict import calibration
from tuner.predict.served import PREDICTED
from tuner.search.space import active_params
from tuner.study.trials import completed

if TYPE_CHECKING:
    import optuna

    from tuner.measure.evaluator import Evaluator
    from tuner.predict.ranker import Ranker
    from tuner.study.settings import StudySettings


def prediction_calibration(study: optuna.Study) -> dict[str, Any] | None:
    """Predicted vs measured paired speedup over the completed trials that recorded a
    prediction (``search.profile``): in our own loops one point per trial, in an engine one per
    trial and level (``predicted_decode_speedup@c<level>`` against ``decode_speedup@c<level>``);
    None where none did."""
    points = [(t.user_attrs["predicted_speedup"], t.user_attrs["speedup"], f"trial {t.number}")
              for t in completed(study) if "predicted_speedup" in t.user_attrs
              and "speedup" in t.user_attrs]
    per_trial = len(points)
    for t in completed(study):
        figures = Figures.from_flat(t.user_attrs)
        for level in sorted(figures.levels(PREDICTED), key=str):     # as the keys sort
            measured = figures.at_level("decode_speedup", level)
            if measured is not None:
                points.append((figures.at_level(PREDICTED, level), measured,
                               f"trial {t.number} c{level}"))
    if not points:
        return None
    return {**calibration([(p, m) for p, m, _ in points], [n for _, _, n in points]),
            "per_level": len(points) > per_trial}


MAX_FOREIGN_POINTS = 512     # search.predict_for ranks at most this many grid points
MAX_UNTIMED_POINTS = 32      # ... or this many where each takes an untimed run (not replayed)


def predict_elsewhere(settings: StudySettings, evaluator: Evaluator, params: Mapping[str, Any],
                      say: Callable[[str], None]) -> dict[str, Any] | None:
    """``search.predict_for``: the grid (``search.ranges``) ranked by the speedup predicted on
    the other machine (acceptance replayed, or from one untimed run, here; priced by its
    profile): the best point there,
    and there the default's and this study's winner's; with a profile of several batch sizes,
    the per-batch-size schedule of ``num_draft_tokens`` around the winner
    (``tuner.predict.schedule``). None without ``search.predict_for``."""
    profile = settings.predict_for
    if profile is None or not settings.engine_object.predicts:     # our own loops only
        return None
    from tuner.search.plans import GridPlan, point_key
    default = settings.searched(settings.default)
    ranges = settings.search.get("ranges", "heuristic")
    points = GridPlan(settings.space, default, ranges, settings.task.task_class).points
    replays = settings.method_class.replayable
    most = MAX_FOREIGN_POINTS if replays else MAX_UNTIMED_POINTS
    cut = len(points) > most
    points = points[:most]
    winner = settings.searched(params)
    for extra in (winner, default):          # both are shown, in the grid or not
        if point_key(extra) not in {point_key(p) for p in points}:
            points = points + [extra]
    say(f"search.predict_for: predicting {len(points)} points of the {ranges} grid"
        f"{f' (its first {most})' if cut else ''}, the default and the winner "
        f"for {profile.machine} ...")
    ranker = evaluator.ranker()
    replayed = ranker.acceptance_points(points)
    one = profile.at_batch(1)
    predicted = [float("-inf") if g is None else ranker.price(g, one).speedup
                 for g in replayed]
    by_key = {point_key(p): v for p, v in zip(points, predicted)}
    best = max(range(len(points)), key=lambda i: predicted[i])
    if not predicted[best] > float("-inf"):
        return None
    shown = active_params(points[best], settings.space)
    what = "an ESTIMATE (roofline)" if profile.kind == "roofline" else \
        f"a profile measured there ({profile.made or 'undated'})"

    def there(point: Mapping[str, Any]) -> str:
        value = by_key[point_key(point)]
        return f"{value:.2f}x" if value > float("-inf") else "not predicted"
    line = (f"on {profile.machine}, {what}, not measured here: best of {len(points)} points "
            f"{shown} {predicted[best]:.2f}x (predicted); this study's winner there "
            f"{there(winner)}, the default {there(default)}")
    out = {"line": line, "machine": profile.machine, "kind": profile.kind,
           "params": dict(points[best]), "speedup": predicted[best],
           "winner_speedup": by_key[point_key(winner)]}
    schedule = batch_schedule(settings, ranker, profile, winner, points, replayed)
    if schedule is not None:
        out["schedule"] = schedule
    return out


def batch_schedule(settings: StudySettings, ranker: Ranker, profile: Any,
                   winner: Mapping[str, Any], points: list, replayed: list) -> Any:
    """The schedule of ``num_draft_tokens`` over the profile's batch sizes, the winner's other
    parameters held (``tuner.predict.schedule.plan``); None with one batch size or without
    ``num_draft_tokens`` in the space."""
    from tuner.predict.schedule import plan
    sizes = profile.batch_sizes()
    if len(sizes) < 2 or "num_draft_tokens" not in settings.space:
        return None
    same = {k: v for k, v in winner.items() if k != "num_draft_tokens"}
    by_k = {int(p["num_draft_tokens"]): g for p, g in zip(points, replayed) if g is not None
            and {k: v for k, v in p.items() if k != "num_draft_tokens"} == same}
    if not by_k:
        return None
    at: dict[int, Any] = {}                     # the profile blended once per batch size
    cache: dict[tuple[int, int], float] = {}    # each (k, batch) priced once

    def speedup(k: int, batch: int) -> float:
        if (k, batch) not in cache:
            if batch not in at:
                at[batch] = profile.at_batch(batch)
            cache[k, batch] = ranker.price(by_k[k], at[batch]).speedup
        return cache[k, batch]
    return plan(speedup, sorted(by_k), sizes)
