"""``python -m tuner.control +task=NAME [overrides]``: the A/A control of one measuring path.

Vanilla against itself through exactly the path the configured method's trials take
(``tuner.measure.control``): in process, a second vanilla after the method ran; in an engine
(``engine=llamacpp|vllm``), the baseline server beside the method's server against a second
server launched with the method's line and drafting off (``method=vanilla``: two plain servers).
On the study's tuning and held-out prompts together, at every ``budget.concurrency`` level and
``budget.request_rate``, with the study's budget and sampling; nothing is stored in a study.

Prints each ratio (end to end, the decode phase, the time to the first token; TPOT at a rate)
with its interval and whether it is within the bound, writes the report as JSON to
``<studies_dir>/control/<study name>.json`` and exits 0 when every ratio is within its bound,
1 when one is not (bad input: 2, as ``python -m tuner``). Several paths in one command: Hydra's
multirun, e.g. ``python -m tuner.control -m +task=gsm8k method=speculative,lookahead,ouroboros``
(in process, one after the other).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from tuner.__main__ import TASKS, refuse_bad_arguments


def control(cfg: DictConfig) -> bool:
    """One path's control (module docstring); True when within its bound."""
    from tuner.measure.timing import time_generation
    from tuner.run import quiet_third_parties
    from tuner.study.guard import measure_control
    from tuner.study.settings import StudySettings
    quiet_third_parties()
    settings = StudySettings.from_config(cfg)
    for notice in settings.notices:
        print(notice, flush=True)
    evaluator = settings.engine_object.evaluator(settings.measuring, time_generation, print)
    prompts = list(enumerate(settings.tuning + settings.held_out))
    print(f"A/A control of {settings.name}'s path on {len(prompts)} prompts "
          f"({settings.task.name}), {settings.budget['max_new_tokens']} new tokens, concurrency "
          f"{list(settings.concurrency)}"
          + (f", request rates {list(settings.traffic.rates)}/s" if settings.traffic.rates
             else ""), flush=True)
    evaluator.open()
    try:
        report = measure_control(settings, evaluator, dict(settings.default), prompts)
    finally:
        evaluator.close()
    for line in report.lines():
        print(line, flush=True)
    path = Path(settings.studies_dir) / "control" / f"{settings.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    print(f"report written to {path}", flush=True)
    return report.within


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    if "task" not in cfg:
        sys.exit(f"choose a task: python -m tuner.control +task=NAME, with NAME one of {TASKS}")
    from tuner.config.errors import ConfigError
    try:
        within = control(cfg)
    except ConfigError as err:
        if bool(cfg.get("debug")):
            raise
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    if not within:
        sys.exit(1)


if __name__ == "__main__":
    refuse_bad_arguments(sys.argv[1:])
    main()
