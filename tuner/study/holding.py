"""The point a trial holds: written when the trial is enqueued, readable in any state.

Every trial the tuner enqueues (trial 0, a plan's next point, a dead trial's retry) records its
point as the user attribute ``point`` at enqueue time, so a WAITING trial (whose parameters Optuna
keeps as fixed params, not in ``params``) and a RUNNING trial that has not suggested yet hold their
point as visibly as a COMPLETE one. The lowest layer of the study: the claiming of points
(``tuner.search.points``), the creation of a study (``storage``) and the re-queueing of a dead
worker's point (``liveness``) all use it, and it uses none of them.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import optuna
from optuna.trial import FrozenTrial


def held_point(trial: FrozenTrial) -> dict[str, Any]:
    """The point ``trial`` holds, in any state (``params`` for trials that never recorded one:
    samplers' trials, studies made before ``point`` was recorded)."""
    point = trial.user_attrs.get("point")
    return json.loads(point) if point else dict(trial.params)


def enqueue(study: optuna.Study, point: Mapping[str, Any], **attrs: Any) -> None:
    """Queue ``point`` as a WAITING trial that holds it from now on."""
    study.enqueue_trial(dict(point), user_attrs={**attrs, "point": json.dumps(dict(point))})
