"""The finish step: choose the winner, confirm it on held-out prompts, decide, write and report.

  1. the best feasible COMPLETE trial by the first objective (Pareto front first); a leader that
     was measured while the machine was busy is re-measured on the tuning prompts before it can
     win (``contention``), so no winner rests on a contended measurement alone;
  2. the winner against vanilla on held-out prompts the search never saw (interleaved);
  3. every decision made once (``tuner.answer.decide``: per level, per rate, the
     recommendation) into one ``StudyOutcome`` (``tuner.answer.outcome``), with the deploy answer
     as data and what prediction added;
  4. the outcome handed to ``publish`` (``tuner.tracking.render.publish``, from ``tuner.run``):
     ``studies/best/<study>.yaml`` and ``<study>.outcome.json``, the summary on the terminal,
     the MLflow parent run.
No feasible trial: the summary says so and recommends vanilla; no trial at all: an error that says
how to resume.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from optuna.trial import FrozenTrial, TrialState

from tuner.config.errors import MeasurementRefused
from tuner.measure.bounds import ImpossibleMeasurement
from tuner.measure.figures import parse
from tuner.measure.quality import feasible
from tuner.search.objectives import objective_values
from tuner.config.union import METHOD, is_union
from tuner.search.racing import deployment_rank, tie_break
from tuner.answer.conclude import conclude
from tuner.search.cost import record_seconds
from tuner.answer.notes import study_notes
from tuner.answer.outcome import StudyOutcome
from tuner.study.record import TrialRecord
from tuner.study.trials import completed, failure_reason, ranked, trial_params

if TYPE_CHECKING:
    import optuna

    from tuner.measure.evaluator import Evaluation, Evaluator
    from tuner.study.settings import StudySettings

FINISHED = "finished_with_trials"   # study attribute: completed trials when last finished
REMEASURE_AT_MOST = 3      # contended leaders re-measured before a winner is chosen
QUALITY_PREFIXES = ("quality_", "vanilla_quality_")
PERPLEXITY_KEYS = ("perplexity", "vanilla_perplexity", "perplexity_ratio")
ACCEPTANCE_PREFIXES = ("acceptance_pos_", "drafted_pos_")
Publish = Callable[[StudyOutcome], None]    # renders the outcome (tuner.tracking.render.publish,
                                            # handed down by tuner.run: the study never imports
                                            # tracking)


def finish(settings: StudySettings, study: optuna.Study, evaluator: Evaluator,
           publish: Publish, say: Callable[[str], None]) -> dict[str, Any]:
    """Steps 1–3 of the module docstring, once: several workers reaching the finish step at
    once (``phase=all`` in several processes) write the result once; the others wait and say
    where it is."""
    folder = Path(settings.studies_dir) / "best"
    with finish_lock(folder / f"{settings.name}.finish.lock"):
        done = len(completed(study))
        if study.user_attrs.get(FINISHED) == done and (folder / f"{settings.name}.yaml").exists():
            say(f"study {settings.name} is already finished with these {done} trials (by this "
                f"command earlier or by another worker): {folder / f'{settings.name}.yaml'}; "
                "add trials (search.n_trials) to search further")
            return {"study_name": settings.name, "finished_elsewhere": True}
        result = _finish(settings, study, evaluator, publish, say)
        study.set_user_attr(FINISHED, done)
        return result


@contextmanager
def finish_lock(path: Path, poll_s: float = 2.0) -> Iterator[None]:
    """One finisher at a time per study (an O_EXCL lock file next to the best YAML; a lock whose
    process died on this host is taken over)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _stale(path):
                path.unlink(missing_ok=True)
                continue
            time.sleep(poll_s)          # another worker is finishing this study
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
        break
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _stale(path: Path) -> bool:
    try:
        host, pid = path.read_text().split()
    except (OSError, ValueError):
        return False                    # being written right now
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _finish(settings: StudySettings, study: optuna.Study, evaluator: Evaluator,
            publish: Publish, say: Callable[[str], None]) -> dict[str, Any]:
    winner = choose_winner(settings, study, evaluator, say)
    if winner is None and completed(study):
        return no_feasible_trial(settings, study, publish)
    if winner is None:
        failed = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        reason = failure_reason(study, failed[-1]) if failed else "none ran"
        raise RuntimeError(f"no trial completed in study {settings.name} ({len(failed)} failed; "
                           f"last: {reason[:300]}); fix the cause and re-run the same command "
                           "to resume")
    params = trial_params(settings, winner)
    confirming = time.perf_counter()
    try:
        confirmed = confirm(settings, evaluator, params, say)
    except ImpossibleMeasurement as err:
        raise MeasurementRefused(f"the held-out confirmation of trial #{winner.number}: {err}; "
                                 "its trials are kept: re-run the same command on a quiet "
                                 "machine to finish") from None
    record_seconds(study, "held_out_s", time.perf_counter() - confirming)
    outcome = conclude(settings, study, evaluator, winner, confirmed, say)
    publish(outcome)
    best = outcome.winner
    return {"params": dict(best.params), "study_name": settings.name, "trial": best.trial,
            "value": best.value, "trials": best.trials, "run_id": best.run_id,
            **outcome.confirmed}


def choose_winner(settings: StudySettings, study: optuna.Study, evaluator: Evaluator,
                  say: Callable[[str], None]) -> FrozenTrial | None:
    """The best feasible trial; contended leaders are re-measured first (see module doc).
    Raced (``search.race``): of the trials within its margin of the best, the smallest draft
    (``tuner.search.racing.tie_break``)."""
    candidates = ranked(settings, study)
    if not candidates:
        return None
    value = {t.number: settings.sign * t.values[0] for t in candidates}
    if not TrialRecord.read(candidates[0]).contended:
        return tie(settings, candidates, value)
    contended = [t for t in candidates if TrialRecord.read(t).contended]
    for trial in contended[:REMEASURE_AT_MOST]:
        key = f"remeasured_{trial.number}"
        if key not in study.user_attrs:
            say(f"trial {trial.number} was measured while the machine was busy: re-measuring "
                "it on the tuning prompts before it can win")
            try:
                evaluation = measure(settings, evaluator, trial_params(settings, trial),
                                     settings.tuning)
                study.set_user_attr(key, objective_values(evaluation.summary,
                                                          settings.objectives)[0])
            except ImpossibleMeasurement as err:      # it cannot win on that measurement
                say(f"trial {trial.number} cannot win: {err}")
                study.set_user_attr(key, None)
        again = study.user_attrs[key]
        value[trial.number] = float("-inf") if again is None else settings.sign * again
    return tie(settings, sorted(candidates, key=lambda t: -value[t.number]), value)


def tie(settings: StudySettings, candidates: list[FrozenTrial], value: Mapping[int, float]
        ) -> FrozenTrial:
    """The best of ``candidates`` (best first), or raced the smallest draft within the margin."""
    race = settings.race
    if race is None or len(settings.objectives) != 1:
        return candidates[0]
    engine, method = settings.engine_object, settings.method
    union = is_union(method)    # across methods: the cheaper deployment, then the smaller draft
    return tie_break([(t, trial_params(settings, t), value[t.number]) for t in candidates],
                     race.margin, lambda params: engine.draft_size(method, params),
                     lambda params: deployment_rank(str(params[METHOD])) if union else 0)


def measure(settings: StudySettings, evaluator: Evaluator, params: Mapping[str, Any],
            prompts) -> Evaluation:
    """The configuration vs vanilla on ``prompts``, interleaved (vanilla first on even pairs)."""
    pairs = list(evaluator.measure(params, list(enumerate(prompts)), parity=1))
    return evaluator.assess(pairs)


def confirm(settings: StudySettings, evaluator: Evaluator, params: Mapping[str, Any],
            say: Callable[[str], None]) -> dict[str, float]:
    """The configuration vs vanilla on held-out prompts the search never saw."""
    if not settings.held_out:
        return {}
    say(f"held-out confirmation on {len(settings.held_out)} prompts: vanilla vs {dict(params)}")
    return held_out_record(settings, measure(settings, evaluator, params, settings.held_out))


def held_out_record(settings: StudySettings, evaluation: Evaluation) -> dict[str, float]:
    """The confirmation's numbers, ``held_out_``-prefixed."""
    s = evaluation.summary
    out = {"speedup": s["speedup"], "speedup_min": s["speedup_min"],
           "speedup_max": s["speedup_max"], "tokens_per_s": s["tokens_per_s"],
           "vanilla_tokens_per_s": s["vanilla_tokens_per_s"],
           "mean_accepted_tokens": s["mean_accepted_tokens"], "prompts": s["prompts"],
           "decode_tokens_per_step": s["decode_tokens_per_step"],
           "truncated_fraction": s["truncated_fraction"]}
    if "matches_vanilla" in s:
        out["matches_vanilla"] = s["matches_vanilla"]
    out.update({k: s[k] for k in ("decode_speedup", "decode_speedup_min", "decode_speedup_max",
                                  "speedup_lcb", "decode_speedup_lcb") if k in s})
    quality = {k: v for k, v in s.items() if k.startswith(QUALITY_PREFIXES) or
               k in PERPLEXITY_KEYS}
    out.update(quality)
    out.update({k: v for k, v in s.items() if k.startswith(ACCEPTANCE_PREFIXES)})
    out.update({k: v for k, v in s.items() if parse(k) is not None or k == "throughput_ratio"})
    if settings.bound.active:
        out["feasible"] = float(feasible(settings.bound.constraints(quality, settings.lossless)))
    return {f"held_out_{k}": v for k, v in out.items()}


def no_feasible_trial(settings: StudySettings, study: optuna.Study,
                      publish: Publish) -> dict[str, Any]:
    """Every completed trial broke the quality bound: say so, recommend vanilla, no winner."""
    done = completed(study)
    fastest = max(done, key=lambda t: settings.sign * t.values[0])
    rows = [("study", settings.name), ("quality bound", settings.bound.describe()),
            ("feasible trials", f"0 of {len(done)}"),
            ("best infeasible trial", f"#{fastest.number}: {fastest.params}, "
             f"{settings.objectives[0]} {fastest.values[0]:.3f}, constraint values "
             f"{TrialRecord.read(fastest).constraints}")]
    notes = study_notes(settings, study, {}, dict(TrialRecord.read(fastest).figures))
    rows += [("note", note) for note in notes]
    advice = (f"use vanilla decoding: no configuration met the quality bound "
              f"({settings.bound.describe()}); relax search.max_quality_drop / "
              "search.max_perplexity_ratio only if that quality loss is acceptable")
    publish(StudyOutcome(settings.name, settings.method_choice, settings.task.name,
                         settings.objectives[0], {"kind": settings.engine["kind"]}, None, {},
                         recommendation=advice, notes=tuple(notes), summary=tuple(rows),
                         metrics={"feasible_trials": 0.0, "infeasible_trials": float(len(done))},
                         feasible=False))
    return {"study_name": settings.name, "feasible": False, "trials": len(done)}
