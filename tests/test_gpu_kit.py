"""The GPU kit without a GPU (docs/gpu.md): the manifest resolves against the package registry as
wheels for the GPU image's Python and fits the carry limit (dry run, nothing kept); the size rules
refuse or leave out what does not fit; and ``scripts/gpu_check.sh --cpu`` runs every part with tiny
models and writes its result files. The GPU figures themselves come from a lent GPU
(bench/results_gpu_h200/)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
MIB = 1024 * 1024


def load(name: str):
    """A module of scripts/ (not a package) by its path."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"scripts_{name}"] = module          # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_dry_run_resolves_every_wheel_for_the_gpu_python_and_fits(tmp_path):
    """Real downloads from the registry (as CI installs everything): every [[wheel]] exists as a
    CPython 3.12 manylinux wheel (or a pure-Python one built from its sdist), the sizes add up
    under the limit with the repository's files, the default model is left out with its size,
    and nothing is kept."""
    dest = tmp_path / "kit"
    done = run(str(SCRIPTS / "gpu_kit.py"), "--dry-run", "--dest", str(dest))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    manifest = tomllib.loads((SCRIPTS / "gpu_manifest.toml").read_text())
    carried = [w for w in manifest["wheel"] if w["group"] != "model"]
    head = lines[0]
    assert head.startswith(f"gpu_kit: {len(carried)} wheels (required, mlflow) = "), head
    total = float(head.split("together ")[1].split(" of ")[0])
    assert total <= manifest["limits"]["carry_mib"] - manifest["limits"]["margin_mib"]
    assert any(line.startswith("gpu_kit: left out group 'model': ") and "does not fit" in line
               for line in lines), lines
    assert lines[-1] == "gpu_kit: dry run, nothing kept"
    assert not dest.exists()


def wheel(folder: Path, name: str, version: str, mib: float, tag: str = "py3-none-any") -> None:
    (folder / f"{name}-{version}-{tag}.whl").write_bytes(b"\0" * int(mib * MIB))


def manifest_of(carry_mib: float, wheels: list[tuple[str, str, str]]) -> dict:
    return {"limits": {"carry_mib": carry_mib, "margin_mib": 1}, "target": {}, "image": {},
            "wheel": [{"name": n, "version": v, "group": g} for n, v, g in wheels]}


def test_assembly_keeps_required_and_each_optional_group_that_fits_whole(tmp_path):
    kit = load("gpu_kit")
    for name, mib in (("a", 2), ("b", 1), ("c", 3), ("d", 2), ("e", 0.5)):
        wheel(tmp_path, name, "1.0", mib)
    manifest = manifest_of(10, [("a", "1.0", "required"), ("c", "1.0", "big"),
                                ("d", "1.0", "big"), ("b", "1.0", "required"),
                                ("e", "1.0", "small")])
    result = kit.assemble(manifest, tmp_path, repo_bytes=int(3 * MIB))
    # room 9 MiB: repo 3 + required 3 = 6; big (5) does not fit whole; small (0.5) still does
    assert [w["name"] for w in result["wheels"]] == ["a", "b", "e"]
    assert result["total_mib"] == 6.5 and result["kit_mib"] == 3.5
    assert result["left_out_groups"] == [{"group": "big", "mib": 5.0,
                                          "why": "5.0 MiB does not fit in the 3.0 MiB left"}]


def test_assembly_refuses_when_the_required_wheels_do_not_fit(tmp_path):
    kit = load("gpu_kit")
    wheel(tmp_path, "a", "1.0", 4)
    with pytest.raises(kit.KitError, match=r"^gpu_kit: the repository's files \(6\.0 MiB\) \+ "
                       r"the required wheels \(4\.0 MiB\) = 10\.0 MiB exceed the 10 MiB"):
        kit.assemble(manifest_of(10, [("a", "1.0", "required")]), tmp_path, int(6 * MIB))


def test_wheel_names_are_matched_by_their_normalised_project_name(tmp_path):
    kit = load("gpu_kit")
    wheel(tmp_path, "Foo_Bar", "1.0", 0.1)
    wheel(tmp_path, "foo_bar", "1.1", 0.1)                  # another version: not this pin
    found = kit.wheel_file(tmp_path, kit.Wheel(kit.normalise("foo.bar"), "1.0", "required"))
    assert found.name == "Foo_Bar-1.0-py3-none-any.whl"
    with pytest.raises(kit.KitError, match=r"wheel foo-bar==2\.0: expected one file, found none"):
        kit.wheel_file(tmp_path, kit.Wheel("foo-bar", "2.0", "required"))


def test_a_wheel_built_from_an_sdist_must_be_pure_python(tmp_path):
    kit = load("gpu_kit")
    wheel(tmp_path, "x", "2.0", 0.1, tag="cp311-cp311-linux_x86_64")
    with pytest.raises(kit.KitError, match="not pure Python"):
        kit.wheel_file(tmp_path, kit.Wheel("x", "2.0", "required", sdist=True))


def test_bad_manifest_and_a_repository_over_the_limit_get_one_line(tmp_path):
    text = (SCRIPTS / "gpu_manifest.toml").read_text()
    twice = tmp_path / "twice.toml"
    twice.write_text(text + '[[wheel]]\nname = "Optuna"\nversion = "1"\ngroup = "required"\n')
    done = run(str(SCRIPTS / "gpu_kit.py"), "--dry-run", "--manifest", str(twice))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"manifest={twice}: wheel 'Optuna' is listed twice"
    unquoted = tmp_path / "unquoted.toml"
    unquoted.write_text(text.replace('version = "0.6.1"', "version = 0.61"))
    done = run(str(SCRIPTS / "gpu_kit.py"), "--dry-run", "--manifest", str(unquoted))
    assert done.returncode == 2 and "allowed is a quoted string" in done.stderr
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    done = run(str(SCRIPTS / "gpu_kit.py"), "--dest", str(other))
    assert done.returncode == 2 and done.stderr.startswith(f"--dest={other} is invalid")
    assert (other / "notes.txt").read_text() == "mine"
    small = tmp_path / "small.toml"
    small.write_text(text.replace("carry_mib = 64", "carry_mib = 2"))
    done = run(str(SCRIPTS / "gpu_kit.py"), "--dry-run", "--manifest", str(small))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "the repository's files alone" in done.stderr and "exceed the 2 MiB" in done.stderr


def test_gpu_check_refuses_bad_input_in_one_line(tmp_path):
    for argv, message in (
            (["cost", "--cpu"], "gpu_check: OUT is not set"),
            (["bogus", "--cpu", "--out", str(tmp_path)], "gpu_check: PART=bogus is not a part"),
            (["cost", "--cpu", "--out", str(tmp_path), "--limit", "cost=0"],
             "gpu_check: --limit='cost=0' is invalid")):
        done = run(str(SCRIPTS / "gpu_check.py"), *argv, env={"OUT": ""})
        assert done.returncode == 2 and done.stderr.startswith(message), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    if not __import__("torch").cuda.is_available():
        done = run(str(SCRIPTS / "gpu_check.py"), "cost", "--out", str(tmp_path))
        assert done.returncode == 2 and "no CUDA GPU is visible" in done.stderr


def test_a_collector_keeps_its_reserve_when_the_step_before_it_runs_out():
    check = load("gpu_check")
    study, collect = check.part_steps("study", cpu=True, default_model=False, tracking="none")
    plan = [study, collect]
    assert collect.reserve_s == 20 and study.reserve_s == 0
    assert check.step_limit(plan, 0, 150.0, 400.0) == 130.0   # the study leaves 20 s
    assert check.step_limit(plan, 1, 0.0, 400.0) == 20.0      # the collector runs anyway
    assert check.step_limit(plan, 1, 35.0, 400.0) == 35.0
    assert check.step_limit(plan, 0, 12.0, 400.0) < 5         # too little: not started
    assert check.step_limit(plan, 1, 0.0, 3.0) == 3.0         # never past the whole run's budget


def test_inventory_line_names_what_is_off_missing_and_added():
    check = load("gpu_check")
    manifest = {"image": {"python": ">=3.0", "packages": {
        "pytest": ">=1", "torch": ">=999", "surely-not-installed-pkg": ">=1"}}}
    record = {"wheels": [{"name": "optuna", "version": "5.0.0", "group": "required"},
                         {"name": "not-here-either", "version": "1.0", "group": "mlflow"}],
              "left_out_groups": [{"group": "model", "why": "88.7 MiB does not fit"}]}
    line = check.inventory_line(check.inventory(manifest, record))
    assert line.startswith("image: Python ") and "\n" not in line
    assert "| manifest 2/4 met |" in line                       # python and pytest
    assert "off: torch " in line and "(wants >=999)" in line
    assert "| missing: surely-not-installed-pkg |" in line
    assert "| kit adds 1: not-here-either 1.0 |" in line        # optuna is installed here
    assert "| image already has: optuna " in line
    assert line.endswith("| not in the kit: model (88.7 MiB does not fit)")


@pytest.mark.slow
def test_every_part_runs_on_the_cpu_and_writes_its_result_files(tmp_path):
    """The harness end to end, as on a GPU machine but with tiny models on this CPU and no kit
    installed (this environment has every package): each part's commands, time limits and JSON."""
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "all", "--cpu",
                           "--kit", str(tmp_path / "no-kit")],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(out), "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "aa.json", "compiled.json", "cost.json", "gpu_check.log", "image.json", "loops.json",
        "lossless.json", "methods.json", "study.json"]
    assert done.stdout.splitlines()[0].startswith("image: Python ")
    assert "kit: 0 wheels installed; no kit at" in done.stdout
    parts = {p: json.loads((out / f"{p}.json").read_text())
             for p in ("cost", "loops", "methods", "aa", "lossless", "compiled", "study")}
    assert all(r["ok"] and r["mode"] == "cpu" for r in parts.values())
    cost = parts["cost"]["results"]["cost"]
    assert [row["n"] for row in cost["cost"]] == [1, 4, 16] and cost["cost"][0]["chain_ratio"] == 1
    loops = parts["loops"]["results"]["loops"]["loops"]
    assert [row["loop"] for row in loops["timed"]] == [
        "vanilla", "bare forward + argmax", "block γ=4", "vanilla (again, last)"]
    assert set(loops["traces"]) == {"bare forward + argmax", "vanilla", "block γ=4"}
    vanilla = loops["traces"]["vanilla"]           # every token read back to test EOS: ≥ 1 sync
    assert vanilla["host_forward_ms_per_token"] > 0 and vanilla["host_syncs_per_token"] >= 1
    methods = {row["configuration"]: row for row in parts["methods"]["results"]["methods"]["methods"]}
    assert methods["vanilla"]["ratio"] == 1 and methods["vanilla"]["j_per_token"] is None
    assert all(row["identical"] == "1/1" for row in methods.values())     # fp32: lossless
    aa = parts["aa"]["results"]["aa"]["aa"]     # vanilla against itself, each suspect removed
    assert [row["setup"].split(":")[0] for row in aa] == [
        "as it ran", "order rotated per prompt", "warm-up as long as the runs",
        "no energy meter", "no other method resident", "the fixed harness"]
    assert all(row["twin_over_vanilla"] > 0 and row["vanilla_ms_per_token"] > 0 for row in aa)
    lossless = parts["lossless"]["results"]
    methods_yaml = (ROOT / "conf" / "method").glob("*.yaml")
    lossless_methods = [p.stem for p in methods_yaml if p.stem != "vanilla"
                        and "lossless: true" in p.read_text()]
    # one greedy-equality case per lossless method + the phase clock + the NVML counter
    assert lossless["pytest -m gpu"]["collected"] == len(lossless_methods) + 2
    near = lossless["near_ties"][0]
    assert near["dtype"] == "bf16" and "speculative" in near["methods"]
    compiled = parts["compiled"]["results"]["compiled"]
    assert compiled["rows"][0]["comparison"] == "vanilla" and compiled["rows"][0]["identical"] == "1/1"
    study = parts["study"]["results"]["collect"]
    assert parts["study"]["tracking"] == "mlflow" and study["study"] == "gpu-check"
    assert [t["state"] for t in study["trials"]] == ["COMPLETE"] * 3
    assert all(t["figures"]["speedup"] > 0 for t in study["trials"])
    assert "method=speculative +best=gpu-check" in study["best_yaml"]
    log = (out / "gpu_check.log").read_text()
    assert all(f"===== {p} (cpu) =====" in log for p in parts)


def test_a_step_past_its_limit_is_killed_with_what_it_started(tmp_path):
    """The leader sleeps past a 2 s limit; a grandchild it started in the background must go
    too. Then a leader that exits at once but leaves a child behind: the child is killed as
    well (nothing may run into the next part's timing)."""
    check = load("gpu_check")
    log = tmp_path / "log"
    log.write_text("")
    pid_file = tmp_path / "child.pid"
    spawn = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(300)']); open(sys.argv[1], 'w').write(str(p.pid)); ")
    for leader_waits, name in ((True, "sleeper"), (False, "leaver")):
        code = spawn + ("import time; time.sleep(300)" if leader_waits else "")
        step = check.Step(name, (sys.executable, "-c", code, str(pid_file)))
        run = check.run_step(step, tmp_path, dict(os.environ), 2.0 if leader_waits else 60.0,
                             log)
        assert run.timed_out is leader_waits and run.rc == (None if leader_waits else 0)
        assert gone(int(pid_file.read_text())), name
    assert log.read_text().count("$ (cd ") == 2


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether ``pid`` is dead (gone, or a zombie) within ``within_s``: SIGKILL is delivered
    asynchronously, so a killed process may still be running for a moment."""
    import time
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def make_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal valid pure-Python wheel holding module ``name`` (``VALUE = version``)."""
    import base64
    import hashlib
    import zipfile
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": f"VALUE = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},{len(text.encode())}"
              for path, text in files.items()] + [f"{dist}/RECORD,,"]
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
        archive.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path


def test_the_kit_installs_offline_only_what_the_image_lacks(tmp_path):
    """pip --no-index --no-deps --target with the manifest's Python: the wheel the image lacks is
    installed and importable from the target; the one the image has is not installed."""
    check = load("gpu_check")
    kit = tmp_path / "kit"
    (kit / "wheels").mkdir(parents=True)
    make_wheel(kit / "wheels", "spectune_kit_probe", "1.2")
    make_wheel(kit / "wheels", "pytest", "0.0.1")                  # the image has pytest
    record = {"wheels": [{"name": "spectune-kit-probe", "version": "1.2", "group": "required"},
                         {"name": "pytest", "version": "0.0.1", "group": "required"}]}
    (kit / "kit.json").write_text(json.dumps(record))
    manifest = tomllib.loads((SCRIPTS / "gpu_manifest.toml").read_text())
    inv = check.inventory(manifest, record)
    log = tmp_path / "log"
    log.write_text("")
    report = check.install_kit(manifest, kit, tmp_path / "target", inv, log)
    assert report["installed"] == ["spectune_kit_probe-1.2-py3-none-any.whl"]
    assert report["missing_files"] == []
    done = subprocess.run([sys.executable, "-c", "import spectune_kit_probe as m; print(m.VALUE)"],
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "target")})
    assert done.stdout.strip() == "1.2"
    assert not list((tmp_path / "target").glob("pytest*"))
    (kit / "kit.json").unlink()
    assert check.install_kit(manifest, kit, tmp_path / "t2", inv, log)["usable"] is False
