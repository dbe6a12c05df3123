"""A study's identity: the fingerprint of everything that changes what is measured.

Stored in the study when it is created; a resume compares it key by key and refuses on any
difference (naming the keys), unless ``resume=force``. The default study name ends in a short hash
of it, so different settings never land in one study by accident. Not part of it: the number of
trials, the timeout and the cost cap (resuming to extend a search is legitimate), where results are logged.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import torch

from decoding.hardware import hardware   # the machine description; re-exported for the tuner
from tuner.config.errors import StudyMismatch


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def fingerprint(*, task: Mapping[str, Any], tuning_ids: list[str], held_out_ids: list[str],
                budget: Mapping[str, Any], sampling: Mapping[str, Any], seed: int,
                models: Mapping[str, Any], method: Mapping[str, Any], search: Mapping[str, Any],
                baseline: str, warmup_prompts: int, near_tie_ulps: float,
                device: torch.device, threads: Any = "auto",
                concurrency: tuple[int, ...] = (1,),
                engine: Mapping[str, Any] | None = None,
                data_sha256: str | None = None,
                traffic: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Flat ``{key: canonical JSON}``: easy to store, compare and report key by key.

    ``threads``: an explicit intra-op thread count is part of the identity; ``auto`` (one per CPU
    the process may use) is not a key, so a study made before threads were recorded keeps its
    fingerprint (the count is recorded on every trial either way). ``data_sha256``: the content of
    a user's prompt file (a key only for such tasks). ``traffic``: request rates, their size and
    the SLO (a key only where rates are measured; ``search.slo`` is read only there, so it is
    kept out of the ``search`` key and every older study keeps its name). ``search.profile`` only
    adds predictions beside the measurements: not a key either, except under ``search=predict``,
    where it chooses which points are measured (``auto``, this machine's cached profile, is
    recorded by file and date in the study instead; ``search.profile_rounds`` only sizes how it
    is made: never a key; nor ``search.untimed_workers``, which processes share the untimed
    runs, not what they give). ``search.predict_for`` (a prediction for
    another machine) changes no measurement: never a key. ``search.race`` decides which points
    and how many prompts are measured, never how a measurement is made (as ``n_trials``): not a
    key, so a study made before racing resumes, raced from where it stands.
    """
    search_keys = {k: v for k, v in search.items() if k not in ("n_trials", "timeout", "slo",
                                                                   "profile", "predict_for",
                                                                   "max_hours", "race",
                                                                   "profile_rounds",
                                                                   "untimed_workers")
                   and not (k == "untimed" and v == "auto")}   # auto: every older study's
    if search.get("kind") == "predict":      # there the profile chooses the measured points:
        from pathlib import Path             # its content, not its path, is the identity
        #                                      (auto: this machine's cached one, whose file and
        #                                      date the study records: tuner.predict.cache)
        path = Path(str(search.get("profile")))
        search_keys["profile"] = hashlib.sha256(path.read_bytes()).hexdigest()[:16] \
            if path.is_file() else str(path)
    digest = hashlib.sha256(_canonical([tuning_ids, held_out_ids]).encode()).hexdigest()[:16]
    raw = {
        "task.name": task["name"], "task.template": task.get("template"),
        "task.metric": task.get("metric"), "task.data": task.get("data"),
        "prompts": f"{len(tuning_ids)}+{len(held_out_ids)} ids sha256:{digest}",
        "budget.n_prompts": budget["n_prompts"], "budget.n_held_out": budget["n_held_out"],
        "budget.max_new_tokens": budget["max_new_tokens"],
        "sampling": dict(sampling), "seed": seed,
        "models.target": models.get("target"), "models.draft": models.get("draft"),
        "method._target_": method["_target_"], "method.params": method.get("params") or {},
        "method.space": method.get("space") or {}, "search": search_keys,
        "baseline": baseline, "warmup_prompts": warmup_prompts,
        "near_tie_ulps": near_tie_ulps, "hardware": hardware(device),
    }
    if threads not in (None, "auto"):
        raw["threads"] = threads
    if data_sha256 is not None:      # a user's prompt file: ids are line numbers, so its content
        raw["task.data_sha256"] = data_sha256   # (shipped task files never change under a study)
    if tuple(concurrency) != (1,):   # one request at a time: the key every older study lacks
        raw["budget.concurrency"] = list(concurrency)
    if traffic is not None:
        raw["traffic"] = dict(traffic)
    if engine is not None:           # engine=hf (every older study): not a key
        raw["engine"] = dict(engine)
    head = (method.get("params") or {}).get("head")
    if head is not None:     # method=eagle: the head's files, not just its name
        from decoding.eagle_weights import head_identity
        raw["method.head"] = head_identity(head)
    return {key: _canonical(value) for key, value in raw.items()}


def short_hash(print_: Mapping[str, str]) -> str:
    return hashlib.sha256(_canonical(dict(print_)).encode()).hexdigest()[:8]


def differences(stored: Mapping[str, str], wanted: Mapping[str, str]) -> list[str]:
    keys = sorted(set(stored) | set(wanted))
    return [k for k in keys if stored.get(k) != wanted.get(k)]


def check_resume(study_name: str, stored: Mapping[str, str] | None, wanted: Mapping[str, str],
                 force: bool, ignore: tuple[str, ...] = ()) -> list[str]:
    """Raise ``StudyMismatch`` when a stored fingerprint differs (unless forced); returns diffs.

    ``ignore``: keys allowed to differ (a worker with per-trial baselines on another GPU model
    measures its own paired vanilla timings and records its hardware on every trial).
    """
    if stored is None:
        raise StudyMismatch(f"study {study_name!r} exists but records no settings fingerprint (made "
                            "by an older version): use a new study_name=..., or resume=force")
    diff = [k for k in differences(stored, wanted) if k not in ignore]
    if diff and not force:
        shown = "; ".join(f"{k}: {_short(stored.get(k))} -> {_short(wanted.get(k))}"
                          for k in diff[:4])
        more = f" (+{len(diff) - 4} more)" if len(diff) > 4 else ""
        raise StudyMismatch(f"study {study_name!r} was measured under other settings ({shown}"
                            f"{more}); its trials and baseline do not apply. Use a new "
                            "study_name=... (or leave study_name unset for one named after the "
                            "settings), or resume=force to continue it anyway"
                            + _objectives_hint(stored, wanted, diff))
    return diff


def _objectives_hint(stored: Mapping[str, str], wanted: Mapping[str, str],
                     diff: list[str]) -> str:
    """Where only the objectives differ: how to resume the study as it was measured (engine
    studies made before ``auto`` stood for ``decode_speedup`` recorded ``[speedup]``)."""
    if diff != ["search"]:
        return ""
    try:
        old, new = json.loads(stored.get("search", "{}")), json.loads(wanted.get("search", "{}"))
    except ValueError:
        return ""
    if old.get("objectives") == new.get("objectives") or \
            {**old, "objectives": None} != {**new, "objectives": None}:
        return ""
    given = ",".join(str(o) for o in old.get("objectives") or [])
    return (f"; only its objectives differ ({old.get('objectives')}, this run "
            f"{new.get('objectives')}; [auto] is decode_speedup for engine servers): to resume "
            f"it by what it was measured by, add search.objectives=[{given}]")


def _short(value: str | None, width: int = 60) -> str:
    if value is None:
        return "(absent)"
    return value if len(value) <= width else value[: width - 3] + "..."
