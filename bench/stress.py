"""K workers started together on one study, repeated R times on fresh studies: does any point run
twice, or get lost? (tests/test_stress.py runs a short version; bench/stress_workers.py the long
one, also against an older checkout.) It lives in bench/, not tests/, so that stress_workers.py
imports no test code; the tests import it from here.

Each worker is the production CLI (``python -m tuner ... phase=work`` after one ``phase=prepare``,
or ``phase=all`` for all of them) on the tiny models, with ``bench/jitter.py`` widening the claim
and enqueue windows. A repetition reports the evaluated points, the duplicates (a point evaluated
more than once, trial 0's default point included) and the lost points (planned, never evaluated).

A point is *evaluated* by a trial that ended COMPLETE or PRUNED, or FAIL for a reason its point
caused (the measurement's own guards: e.g. ``impossible``, a batch read beyond its physical bound
twice, which four workers on two cores do cause now and then); a trial failed because it lost a
race for its point (``duplicate``), or because its worker died or was stopped (``orphaned``,
``interrupted``), evaluated nothing: its point is claimed again. That is the study's own rule
(``tuner.study.trials``: which failures use budget), restated here from the trials' attributes
because benchmarks do not import the study's internals.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parents[1]
GRID = ["+task=gsm8k", "method=speculative", "models=tiny", "task.n_prompts=1",
        "task.n_held_out=0", "task.max_new_tokens=4", "warmup_prompts=0", "search=grid",
        "search.ranges=full", "method.space.num_draft_tokens.high=5",
        "method.params.num_draft_tokens=2", "tracking=none"]
CURRENT = ("contention=warn", "contention_window_s=0.1")   # settings an older checkout lacks
PLANNED = [1, 2, 3, 4, 5]
# the CLI as `python -m tuner` runs it (Hydra finds conf/ from the module's file), jitter first
# (read by path from this checkout: an older checkout may have no bench/jitter.py, and its own
# packages come first on the path)
RUN = (f"import runpy; runpy.run_path({str(ROOT / 'bench' / 'jitter.py')!r}); "
       "runpy.run_module('tuner', run_name='__main__', alter_sys=True)")


# a failure that evaluated nothing: the point is claimed again (tuner.study.trials.RETRIED)
NOT_EVALUATED = ("orphaned", "interrupted", "duplicate")


@dataclass(frozen=True)
class Repetition:
    completed: tuple[int, ...]      # num_draft_tokens of every evaluated trial (see above)
    duplicates: tuple[int, ...]     # points evaluated more than once
    lost: tuple[int, ...]           # planned points never evaluated
    default_runs: int               # evaluated trials holding the default point (2)
    seconds: float
    failed_workers: int             # workers that exited non-zero
    errors: tuple[str, ...] = ()    # the end of each failed worker's stderr
    failed_evaluations: tuple[str, ...] = ()   # "point: kind" of each evaluation that failed


def repetition(folder: Path, workers: int, code_root: Path = ROOT, storage: str | None = None,
               jitter_s: float = 0.3, timeout: float = 300.0,
               extra: tuple[str, ...] = CURRENT) -> Repetition:
    """One fresh study, ``workers`` workers started together (``code_root``: the checkout whose
    tuner runs)."""
    name = f"stress-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True, exist_ok=True)
    args = [*GRID, *extra, f"study_name={name}", f"studies_dir={folder}"]
    if storage:
        args.append(f"storage={storage}")
    env = {"PYTHONPATH": str(code_root), "PYTHONUNBUFFERED": "1",
           "SPECTUNE_JITTER_S": str(jitter_s), "PATH": "/usr/bin:/bin:/usr/local/bin",
           "HOME": str(Path.home())}
    began = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", RUN, *args], cwd=folder, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(workers)]
    errors = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            errors.append(f"timed out after {timeout} s: {proc.communicate()[1][-1500:]}")
            continue
        if proc.returncode != 0:
            errors.append(f"exit {proc.returncode}: {err[-1500:]}")
    seconds = time.monotonic() - began
    return summarize(load(folder, name, storage), seconds, tuple(errors))


def load(folder: Path, name: str, storage: str | None) -> optuna.Study:
    if storage is None:
        path = str(folder / f"{name}.journal")
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    return optuna.load_study(study_name=name, storage=storage)


def evaluated(study: optuna.Study, trial: optuna.trial.FrozenTrial, retried: set[int]) -> bool:
    """Did ``trial`` evaluate its point (COMPLETE, PRUNED, or failed by its measurement)?
    ``retried``: the trials a retry names (``retry_of``: their worker died)."""
    State = optuna.trial.TrialState
    if trial.state in (State.COMPLETE, State.PRUNED):
        return True
    if trial.state != State.FAIL:
        return False
    reason = str(trial.user_attrs.get("error") or
                 study.user_attrs.get(f"trial_{trial.number}_error", ""))
    return not reason.startswith(NOT_EVALUATED) and trial.number not in retried


def summarize(study: optuna.Study, seconds: float, errors: tuple[str, ...]) -> Repetition:
    trials = study.get_trials()
    retried = {int(t.user_attrs["retry_of"]) for t in trials if "retry_of" in t.user_attrs}
    done = [t for t in trials if evaluated(study, t, retried)]
    points = [json.loads(t.user_attrs["point"])["num_draft_tokens"] if "point" in t.user_attrs
              else t.params["num_draft_tokens"] for t in done]
    counts = collections.Counter(points)
    failures = tuple(f"{p}: {t.user_attrs.get('error_kind', '?')}" for p, t in zip(points, done)
                     if t.state == optuna.trial.TrialState.FAIL)
    return Repetition(tuple(sorted(points)), tuple(sorted(p for p, n in counts.items() if n > 1)),
                      tuple(p for p in PLANNED if p not in counts), counts[2], seconds,
                      len(errors), errors, failures)


def as_json(reps: list[Repetition]) -> str:
    return json.dumps([r.__dict__ for r in reps], indent=1)
