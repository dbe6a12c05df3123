"""CLI: ``python -m tuner +task=gsm8k [method=block] [search=grid] [models=tiny] ...``."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

TASKS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "task").glob("*.yaml"))


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    if "task" not in cfg:
        sys.exit(f"choose a task: python -m tuner +task=NAME, with NAME one of {TASKS}")
    from tuner.run import run
    result = run(cfg)
    return result.get("held_out_speedup", result.get("value"))


if __name__ == "__main__":
    main()
