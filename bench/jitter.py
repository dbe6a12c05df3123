"""Widen the race windows of several workers on one study (a test hook, never imported by the
tuner itself): ``runpy.run_path("bench/jitter.py")`` before
``runpy.run_module("tuner", run_name="__main__")`` (bench/stress.py).

Before and after every ``Study.enqueue_trial`` and ``Study.ask`` (Optuna's public calls the workers
use to claim points) the worker sleeps a random 0..``SPECTUNE_JITTER_S`` seconds (default 0.3),
seeded by its pid, so workers started together interleave their claims in ever different orders.
The sleep after ``ask`` matters most: a trial just asked for is RUNNING, but an enqueued trial's
point is still only in its fixed parameters until the objective suggests them — the window in
which a plan that reads ``trial.params`` saw the point as free.
"""

from __future__ import annotations

import functools
import os
import random
import time

import optuna

_rng = random.Random(os.getpid())
_MAX = float(os.environ.get("SPECTUNE_JITTER_S", "0.3"))


def _jittered(call):
    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        time.sleep(_rng.uniform(0.0, _MAX))
        result = call(*args, **kwargs)
        time.sleep(_rng.uniform(0.0, _MAX))
        return result
    return wrapper


optuna.study.Study.enqueue_trial = _jittered(optuna.study.Study.enqueue_trial)
optuna.study.Study.ask = _jittered(optuna.study.Study.ask)
