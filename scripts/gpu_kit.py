"""Assemble the GPU kit on a CPU machine: the wheels a bare GPU machine lacks, for its Python.

    scripts/gpu_kit.sh [--dry-run] [--manifest scripts/gpu_manifest.toml] [--dest .gpu_kit]

Reads ``scripts/gpu_manifest.toml``; downloads every ``[[wheel]]`` (pinned, ``--no-deps``, as a
wheel for the manifest's ``[target]``: CPython 3.12, manylinux x86_64; a pure-Python project that
publishes only an sdist is built into a wheel here) into a temporary folder, sums the sizes with the
repository's files that travel to a device machine (git's tracked files and untracked, not ignored
ones), and keeps the required wheels plus each optional group, in manifest order, that still fits
under ``carry_mib − margin_mib``. If the required wheels alone do not fit it refuses in one line
(exit 2). Otherwise it writes ``<dest>/wheels/*.whl`` and ``<dest>/kit.json`` (what was packed,
what was left out and why, sizes). ``--dry-run`` does all of this but keeps nothing.

Stdlib only (plus pip, run as ``python -m pip``): it runs before any environment exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "scripts" / "gpu_manifest.toml"
MIB = 1024 * 1024


class KitError(Exception):
    """A refusal: one line, exit 2."""


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    group: str
    sdist: bool = False

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


def normalise(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def load_manifest(path: Path) -> dict:
    """The manifest, checked: every wheel named once with a version and a group; required first."""
    try:
        manifest = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise KitError(f"manifest={path}: cannot be read ({err})") from err
    for key in ("limits", "target", "image", "wheel"):
        if key not in manifest:
            raise KitError(f"manifest={path}: section [{key}] is missing")
    seen = set()
    for entry in manifest["wheel"]:
        missing = [k for k in ("name", "version", "group") if not entry.get(k)]
        if missing:
            raise KitError(f"manifest={path}: a [[wheel]] entry lacks {missing}: {entry}")
        if not isinstance(entry["version"], str):
            raise KitError(f"manifest={path}: wheel {entry['name']!r} has version="
                           f"{entry['version']!r}: allowed is a quoted string (\"3.10\", not 3.10)")
        key = normalise(entry["name"])
        if key in seen:
            raise KitError(f"manifest={path}: wheel {entry['name']!r} is listed twice")
        seen.add(key)
    return manifest


def wheels(manifest: dict) -> list[Wheel]:
    return [Wheel(normalise(e["name"]), str(e["version"]), e["group"], bool(e.get("sdist")))
            for e in manifest["wheel"]]


def groups(manifest: dict) -> list[str]:
    """Group names in manifest order, ``required`` first."""
    order = list(dict.fromkeys(wheel.group for wheel in wheels(manifest)))
    return sorted(order, key=lambda g: g != "required")


def travelling_bytes(root: Path) -> int:
    """Bytes of the files a device call carries from ``root``: tracked + untracked, not ignored."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], capture_output=True, check=True).stdout
    total = 0
    for name in {n for n in out.decode().split("\0") if n}:
        path = root / name
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def pip_download(items: list[Wheel], target: dict, into: Path) -> None:
    """Download the binary wheels for the target platform; build sdist-only ones into wheels."""
    binary = [w.pin for w in items if not w.sdist]
    if binary:
        flags = ["--python-version", target["python_version"], "--implementation",
                 target["implementation"], "--abi", target["abi"], "--abi", "none",
                 "--abi", "abi3"]
        for platform in target["platforms"]:
            flags += ["--platform", platform]
        flags += ["--platform", "any"]
        run_pip(["download", "--no-deps", "--only-binary=:all:", *flags, "-d", str(into),
                 *binary])
    for wheel in (w for w in items if w.sdist):
        with tempfile.TemporaryDirectory() as src:
            run_pip(["download", "--no-deps", "--no-binary=:all:", "-d", src, wheel.pin])
            sdists = list(Path(src).iterdir())
            run_pip(["wheel", "--no-deps", "-w", str(into),
                     str(sdists[0])])


def run_pip(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "-q", *args], capture_output=True,
                          text=True)
    if done.returncode:
        lines = [line for line in (done.stderr or done.stdout).splitlines()
                 if line.strip() and not line.startswith("WARNING: Location")]
        raise KitError(f"pip {args[0]} failed: {lines[-1] if lines else done.returncode}")


def wheel_file(folder: Path, wheel: Wheel) -> Path:
    """The one downloaded file of ``wheel`` (its name and version), checked to be a usable wheel."""
    found = []
    for path in folder.glob("*.whl"):
        parts = path.name.split("-")
        if len(parts) >= 5 and normalise(parts[0]) == wheel.name and parts[1] == wheel.version:
            found.append(path)
    if len(found) != 1:
        raise KitError(f"wheel {wheel.pin}: expected one file, found "
                       f"{[p.name for p in found] or 'none'}")
    tags = found[0].name[:-4].split("-")[-3:]
    if wheel.sdist and tags[1:] != ["none", "any"]:
        raise KitError(f"wheel {wheel.pin}: built from its sdist as {found[0].name}, which is "
                       "not pure Python (it would not run on the GPU machine's interpreter)")
    return found[0]


def room_bytes(manifest: dict) -> int:
    limits = manifest["limits"]
    return int((limits["carry_mib"] - limits.get("margin_mib", 0)) * MIB)


def check_room(manifest: dict, repo_bytes: int) -> None:
    """Refuse before downloading anything when the repository alone leaves no room."""
    if repo_bytes > room_bytes(manifest):
        limits = manifest["limits"]
        raise KitError(f"gpu_kit: the repository's files alone ({repo_bytes / MIB:.1f} MiB) "
                       f"exceed the {limits['carry_mib']} MiB a device call carries (margin "
                       f"{limits.get('margin_mib', 0)} MiB): make the repository smaller")


def assemble(manifest: dict, folder: Path, repo_bytes: int) -> dict:
    """Choose what goes: required wheels always (or refuse), optional groups whole, in order."""
    limits = manifest["limits"]
    room = room_bytes(manifest)
    files = {w: wheel_file(folder, w) for w in wheels(manifest)}
    size = {w: p.stat().st_size for w, p in files.items()}
    packed, left = [], []
    total = repo_bytes
    for group in groups(manifest):
        members = [w for w in files if w.group == group]
        group_bytes = sum(size[w] for w in members)
        if group == "required" and total + group_bytes > room:
            raise KitError(
                f"gpu_kit: the repository's files ({repo_bytes / MIB:.1f} MiB) + the required "
                f"wheels ({group_bytes / MIB:.1f} MiB) = {(repo_bytes + group_bytes) / MIB:.1f} "
                f"MiB exceed the {limits['carry_mib']} MiB a device call carries (margin "
                f"{limits.get('margin_mib', 0)} MiB): make the repository or the kit smaller")
        if total + group_bytes <= room:
            packed += members
            total += group_bytes
        else:
            left.append({"group": group, "mib": round(group_bytes / MIB, 2),
                         "why": f"{group_bytes / MIB:.1f} MiB does not fit in the "
                                f"{(room - total) / MIB:.1f} MiB left"})
    return {
        "repo_mib": round(repo_bytes / MIB, 2),
        "kit_mib": round(sum(size[w] for w in packed) / MIB, 2),
        "total_mib": round(total / MIB, 2),
        "limit_mib": limits["carry_mib"], "margin_mib": limits.get("margin_mib", 0),
        "wheels": [{"name": w.name, "version": w.version, "group": w.group,
                    "file": files[w].name, "bytes": size[w],
                    "sha256": hashlib.sha256(files[w].read_bytes()).hexdigest()}
                   for w in packed],
        "left_out_groups": left,
        "left_out_packages": manifest.get("left_out", {}),
        "target": manifest["target"],
    }


def check_dest(dest: Path) -> None:
    """The kit replaces ``dest`` whole: only a missing or empty folder, or an earlier kit."""
    if dest.exists() and (not dest.is_dir() or (any(dest.iterdir())
                                                and not (dest / "kit.json").is_file())):
        raise KitError(f"--dest={dest} is invalid: it holds other files, and the kit replaces "
                       "the folder whole; allowed is a missing or empty folder, or an earlier kit")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="resolve the manifest and check the size; keep nothing")
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu_kit")
    args = parser.parse_args(argv)
    began = time.monotonic()
    try:
        manifest = load_manifest(args.manifest)
        repo_bytes = travelling_bytes(ROOT)
        check_room(manifest, repo_bytes)
        if not args.dry_run:
            check_dest(args.dest)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            pip_download(wheels(manifest), manifest["target"], folder)
            kit = assemble(manifest, folder, repo_bytes)
            kit["manifest_sha256"] = hashlib.sha256(args.manifest.read_bytes()).hexdigest()
            if not args.dry_run:
                shutil.rmtree(args.dest, ignore_errors=True)
                (args.dest / "wheels").mkdir(parents=True)
                for entry in kit["wheels"]:
                    shutil.copy2(folder / entry["file"], args.dest / "wheels" / entry["file"])
                (args.dest / "kit.json").write_text(json.dumps(kit, indent=1) + "\n")
    except KitError as err:
        print(err, file=sys.stderr)
        return 2
    groups_in = list(dict.fromkeys(w["group"] for w in kit["wheels"]))
    print(f"gpu_kit: {len(kit['wheels'])} wheels ({', '.join(groups_in)}) = "
          f"{kit['kit_mib']:.1f} MiB; repository {kit['repo_mib']:.1f} MiB; together "
          f"{kit['total_mib']:.1f} of {kit['limit_mib']} MiB"
          + ("" if args.dry_run else f"; written to {args.dest}")
          + f" ({time.monotonic() - began:.0f} s)")
    for left in kit["left_out_groups"]:
        print(f"gpu_kit: left out group {left['group']!r}: {left['why']}")
    if args.dry_run:
        print("gpu_kit: dry run, nothing kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
