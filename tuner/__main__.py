"""CLI: ``python -m tuner +task=gsm8k [method=block] [search=grid] [models=tiny] ...``.

Bad input ends in one line on stderr (exit 2) naming the setting, the value and what is allowed;
``debug=true`` or ``HYDRA_FULL_ERROR=1`` shows the traceback. Ctrl-C / SIGTERM ends in one line
(exit 130): the study is saved and the same command resumes it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import warnings

import hydra
from omegaconf import DictConfig

# a missing studies/ folder (no best configs yet) is normal, not worth a warning
warnings.filterwarnings("ignore", message=".*hydra.searchpath.*is not available")
warnings.filterwarnings("ignore", message=".*is experimental.*")   # Optuna's WilcoxonPruner notice
warnings.filterwarnings("ignore", message=".*Heartbeat of storage is supposed to be used with.*")
warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
CONF = Path(__file__).resolve().parents[1] / "conf"
TASKS = sorted(p.stem for p in (CONF / "task").glob("*.yaml"))


def _best_choice() -> str | None:
    from hydra.core.hydra_config import HydraConfig
    try:     # from the overrides: Hydra drops a +best whose search path folder is missing
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:
        return None
    found = [o.split("=", 1)[1] for o in overrides if o.lstrip("+~").startswith("best=")]
    return found[-1] if found else None


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    if "task" not in cfg:
        sys.exit(f"choose a task: python -m tuner +task=NAME, with NAME one of {TASKS}")
    from tuner.config.errors import ConfigError, Interrupted
    best = _best_choice()
    if best is not None and not cfg.get("replay"):
        sys.exit(f"error: +best={best}: {cfg.studies_dir}/best/{best}.yaml is not a best-config "
                 "file written by a finished study")
    debug = bool(cfg.get("debug")) or os.environ.get("HYDRA_FULL_ERROR") == "1"
    try:
        from tuner.run import run
        result = run(cfg)
    except ConfigError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt as err:
        detail = str(err) if isinstance(err, Interrupted) else "interrupted"
        print(f"{detail}; the running trial is marked FAIL (interrupted). Re-run the same "
              "command to resume.", file=sys.stderr, flush=True)
        sys.exit(130)
    return result.get("held_out_speedup", result.get("value"))


def check_run_folder(argv: list[str]) -> str | None:
    """The one-line refusal of a ``studies_dir`` that cannot hold Hydra's run folder
    (``<studies_dir>/.hydra/...``, created before ``main`` runs), or None when it can."""
    from tuner.config.errors import ConfigError
    from tuner.config.stores import check_folder
    if any(a.split("=")[0] in ("-h", "--help", "--hydra-help", "--info", "-c", "--cfg",
                               "--version", "--shell-completion", "-sc") for a in argv):
        return None                                      # Hydra creates no run folder then
    given = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("studies_dir=")]
    value = given[-1] if given else "studies"            # conf/config.yaml's default
    if "${" in value:                                    # an interpolation: Hydra resolves it
        return None
    try:
        check_folder("studies_dir", value, "a folder (created if missing) for the studies, their "
                                           "best configs and Hydra's run logs")
    except ConfigError as err:
        return str(err)
    return None


def check_group_options(argv: list[str], searched: tuple[Path, ...] = (CONF, Path("studies"))
                        ) -> str | None:
    """The one-line refusal of ``GROUP=OPTION`` naming an option that no config group folder
    holds (Hydra would list its whole search path), or None. Only plain options of conf/'s groups
    are checked (``engine=sglang``, ``+task=nope``); sweeps, interpolations and deletions are
    Hydra's to read. Files whose name starts with ``_`` are a group's shared base, not options."""
    groups = sorted(p.name for p in CONF.iterdir() if p.is_dir())
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if not sep or key not in groups or arg.startswith("~") or value == "null" or \
                not value.replace("_", "").replace("-", "").replace(".", "").isalnum():
            continue
        options = sorted({f.stem for folder in searched for f in (folder / key).glob("*.yaml")
                          if not f.stem.startswith("_")})
        if value not in options:
            return f"{arg} is unknown: allowed are {', '.join(options)}"
    return None


def refuse_bad_arguments(argv: list[str]) -> None:
    """Exit 2 with one line where ``argv`` names an unknown group option or an unusable run
    folder (before Hydra composes anything)."""
    refusal = check_group_options(argv) or check_run_folder(argv)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    refuse_bad_arguments(sys.argv[1:])
    main()
