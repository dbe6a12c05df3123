"""The study a deployment came from, as the watch reads it: its ``outcome.json`` through the typed
reader beside its writer (``tuner.answer.outcome.read_outcome``: the decisions, the winner's
parameters, the deployed launch line, the winner's acceptance per position, the profile's
calibration) and the best YAML beside it (the models, sampling, levels and config choices a
re-tune repeats). The deployed k is the winner's draft size as the engine declares it
(``Engine.draft_size``); the launch line stays what the user runs, and only says which flag a
candidate sets.

``--study`` is a study name (``studies/best/<name>.outcome.json``), or the path of the
``outcome.json`` or of the best YAML. Each refusal is one ``ConfigError`` line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decoding.acceptance import variance_of
from tuner.config.errors import ConfigError
from tuner.engines import ENGINES, engine_named
from tuner.engines.servers import ServerEngine
from tuner.answer.outcome import StudyOutcome, read_outcome

BEST_DIR = Path("studies") / "best"
DEFAULT_MARGIN = 0.10        # the least predicted gain worth a switch without a calibration


@dataclass(frozen=True)
class StudyAcceptance:
    """The winner's acceptance per draft position on the study's held-out prompts."""

    per_position: tuple[float, ...]      # [k] accepted fraction of the drafts at position i
    drafts: tuple[float, ...]            # [k] drafts counted there

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """A 95 % interval of the mean length per draft, over the first position's drafts."""
        return length_interval(self.per_position, self.drafts[0] if self.drafts else 0.0, z)


def length_interval(fractions: tuple[float, ...], drafts: float,
                    z: float = 1.96) -> tuple[float, float]:
    """A normal interval of the mean accepted length per draft, 1 + Σ a_i, from the accepted
    fractions a_i per position over ``drafts`` drafts: the per-draft variance is
    ``decoding.acceptance.variance_of`` (positions from 0: P(X > i) = a_i)."""
    mean = sum(fractions)
    if not drafts:
        return 1.0 + mean, 1.0 + mean
    half = z * math.sqrt(variance_of(fractions) / drafts)
    return 1.0 + mean - half, 1.0 + mean + half


@dataclass(frozen=True)
class WatchedStudy:
    """What the watch needs of a study (module docstring)."""

    name: str
    path: Path                           # its outcome.json
    engine: ServerEngine
    outcome: StudyOutcome
    best: Mapping[str, Any]              # the best YAML ({} where absent)
    argv: tuple[str, ...]                # the deployed launch line
    deployed_k: int | None
    k_setting: str                       # the flag or key that sets k, or "k"
    temperature: float | None
    acceptance: StudyAcceptance | None
    calibration_error: float | None      # the study's median |predicted / measured − 1|
    choices: Mapping[str, str] = field(default_factory=dict)   # models=..., budget=...

    @property
    def method(self) -> str:
        return self.outcome.method

    @property
    def task(self) -> str:
        return self.outcome.task

    @property
    def deployed_model(self) -> str | None:
        return self.engine.deployed_model(list(self.argv))

    def retune_command(self, levels: list[int], temperature: float | None) -> str:
        """The study's settings again, on the user's prompts and the live levels."""
        parts = ["python -m tuner +task=prompts task.data.local=<your prompts file>",
                 f"method={self.method}", f"engine={self.engine.name}"]
        parts += [f"{group}={choice}" for group, choice in self.choices.items()
                  if group not in ("engine",)]
        if levels:
            parts.append(f"budget.concurrency=[{','.join(str(c) for c in levels)}]")
        if temperature is not None:
            parts.append(f"sampling.temperature={temperature:g}")
        return " ".join(parts)


def find_outcome(given: str) -> Path:
    """The outcome.json ``given`` names (module docstring); one line where there is none."""
    path = Path(given)
    candidates = [BEST_DIR / f"{given}.outcome.json"] if "/" not in given and \
        not given.endswith((".json", ".yaml")) else []
    if path.suffix == ".yaml":
        candidates.append(path.with_suffix(".outcome.json"))
    elif path.suffix == ".json":
        candidates.append(path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    where = ", ".join(str(c) for c in candidates) or given
    raise ConfigError(f"--study={given!r} does not exist (no {where}): allowed is a study name "
                      f"under {BEST_DIR}/ or the path of its .outcome.json or best YAML")


def read_study(given: str, k: int | None = None) -> WatchedStudy:
    """The study ``given`` names; ``k``: the drafted tokens per step the deployment runs where
    the user changed it from the study's launch line."""
    import yaml
    path = find_outcome(given)
    try:
        outcome = read_outcome(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--study={given!r}: {path} is not a study outcome ({err})") from None
    kind = outcome.engine.get("kind")
    engine = engine_named(kind) if kind in ENGINES else None
    servers = " | ".join(f"engine={k}" for k in ENGINES
                         if engine_named(k).live_metrics is not None)
    if engine is None or engine.live_metrics is None or not isinstance(engine, ServerEngine):
        raise ConfigError(f"--study={given!r} was a study of engine={kind} (our own loops): "
                          f"nothing runs as a server to watch; allowed is a study of an engine "
                          f"server ({servers})")
    best_path = path.with_name(path.name.removesuffix(".outcome.json") + ".yaml")
    best = yaml.safe_load(best_path.read_text()) if best_path.is_file() else {}
    argv = engine.launch_argv(outcome.deploy)
    found = engine.deployed_k(argv)          # the flag a candidate sets (and the k it shows)
    setting = found[1] if found else "k"
    deployed = k if k is not None else deployed_k(engine, outcome)
    sampling = (best or {}).get("sampling") or {}
    temperature = sampling.get("temperature")
    error = (outcome.prediction.calibration or {}).get("median_abs_error")
    choices = {}
    for entry in (best or {}).get("defaults") or []:
        for key, value in (entry or {}).items():
            choices[str(key).removeprefix("override /")] = str(value)
    return WatchedStudy(
        name=outcome.study, path=path, engine=engine, outcome=outcome,
        best=best or {}, argv=tuple(argv), deployed_k=deployed, k_setting=setting,
        temperature=None if temperature is None else float(temperature),
        acceptance=study_acceptance(outcome), calibration_error=None if error is None
        else float(error), choices=choices)


def deployed_k(engine: ServerEngine, outcome: StudyOutcome) -> int | None:
    """The drafted tokens per step of the winner's parameters, as the engine declares its draft
    size for the study's method (its shipped mapping: ``conf/engine/<kind>.yaml``); None where
    nothing is deployed or the setting declares no size (llama.cpp's ngram-cache)."""
    params = outcome.deployed_params
    size = engine.shipped_draft_size(outcome.method, params) if params else None
    return None if size is None else int(size)


def study_acceptance(outcome: StudyOutcome) -> StudyAcceptance | None:
    positions = sorted(outcome.acceptance.get("positions") or [],
                       key=lambda p: int(p["position"]))
    if not positions:
        return None
    return StudyAcceptance(tuple(float(p["accepted_fraction"]) for p in positions),
                           tuple(float(p.get("drafts") or 0.0) for p in positions))
