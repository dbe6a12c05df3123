"""``python -m tuner.profile``: measure this machine's cost surface for our own loops
(``engine=hf``) and write it as a hardware profile (``tuner.predict.surface``), to predict
speculative speed from acceptance here or on another machine.

    python -m tuner.profile --models smollm2 --out profiles/smollm2-cpu.json

Times KV-cached forwards of the target (and of the draft model, where the preset has one) on a
grid of contexts × rows and prompt prefills, and the loop's own time per step
(``tuner.predict.loops``). Bad input gets one line before any model loads; a quiet machine is
wanted (the contention check of a study is not run here: check ``uptime`` first).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path
from typing import Sequence

from tuner.config.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"


def preset_models(name: str) -> dict:
    """The ``models=<name>`` config's target and draft specs (conf/models/<name>.yaml)."""
    import yaml
    path = CONF / "models" / f"{name}.yaml"
    if not path.is_file():
        allowed = sorted(p.stem for p in (CONF / "models").glob("*.yaml"))
        raise ConfigError(f"--models={name!r} is unknown: allowed are {allowed}")
    data = yaml.safe_load(path.read_text())
    return {"target": data["target"], "draft": data.get("draft")}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tuner.profile", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--models", default="smollm2", help="a conf/models preset")
    parser.add_argument("--out", default=None, help="the profile JSON to write "
                        "(default profiles/<models>-<machine>.json)")
    parser.add_argument("--threads", default="auto", help="torch threads (auto: one per CPU)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per cell")
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        models = preset_models(args.models)
        from tuner.measure.hygiene import check_threads
        check_threads(None if args.threads == "auto" else args.threads)
        if args.repeats < 1:
            raise ConfigError(f"--repeats={args.repeats} is invalid: allowed is an integer >= 1")
        for name, values in (("--contexts", args.contexts), ("--rows", args.rows)):
            if values is not None and (min(values) < 1 or sorted(set(values)) != values):
                raise ConfigError(f"{name}={values} is invalid: allowed are distinct ascending "
                                  "integers >= 1")
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    profile = make_profile(models, args)
    out = Path(args.out or f"profiles/{args.models}-{slug(profile.machine)}.json")
    profile.save(out)
    vanilla = profile.target.step_s(profile.target.contexts[0], 1)
    print(f"wrote {out}: {profile.describe()}; target forward {1e3 * vanilla:.1f} ms for one "
          f"token, {profile.target.step_s(profile.target.contexts[0], 5) / vanilla:.2f}x that "
          f"for 5 tokens; the loop's own time per step: " + ", ".join(
              f"{key} {1e3 * value:.2f} ms" for key, value in profile.step_overhead_s.items()))
    return 0


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:48]


def make_profile(models: dict, args: argparse.Namespace):
    import torch

    from decoding.hardware import hardware
    from decoding.models import load_pair
    from tuner.engines import DEFAULT  # our own loops (engine=hf)
    from tuner.measure.hygiene import configure_threads
    from tuner.predict import loops
    from tuner.predict.surface import HardwareProfile
    threads = configure_threads(None if args.threads == "auto" else args.threads)
    draft_spec = models["draft"] or {"kind": "none"}
    pair = load_pair(models["target"], draft_spec)
    grid = {"contexts": tuple(args.contexts or loops.CONTEXTS)}
    device = next(pair.target.parameters()).device
    print(f"profiling {pair.target_name} on {hardware(device)}, {threads} threads")
    target = loops.measure_surface(pair.target, rows=tuple(args.rows or loops.TARGET_ROWS),
                                   repeats=args.repeats, progress=print, **grid)
    draft = None
    if pair.draft is not None:
        print(f"draft {pair.draft_name}:")
        draft = loops.measure_surface(pair.draft, rows=loops.DRAFT_ROWS, repeats=args.repeats,
                                      progress=print, **grid)
    prompt = list(range(100, 164)) + list(range(100, 132))   # repeats: prompt lookup drafts
    overheads = loops.step_overheads(pair.target, target, prompt, pair.draft, draft)
    import transformers
    return HardwareProfile(
        kind="measured", machine=hardware(device), engine=DEFAULT,
        build={"torch": torch.__version__, "transformers": transformers.__version__,
               "python": platform.python_version()},
        threads=threads, models=loops.describe_models(models), target=target, draft=draft,
        step_overhead_s=overheads,
        made=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


if __name__ == "__main__":
    sys.exit(main())
