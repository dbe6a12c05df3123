"""Several workers on one study under stress: duplicates and lost points per repetition.

    python bench/stress_workers.py [--workers 2 3 4] [--repetitions 10]
                                   [--backends journal postgresql]
                                   [--old-checkout /path/to/an/older/tree] [--jitter 0.3]

Runs bench/stress.py's repetition (K production workers started together on a fresh study, the
claim/enqueue windows widened by bench/jitter.py) R times per K and backend, and prints, per
repetition, the completed points, duplicates, lost points, trial-0 runs and wall time, then the
failure rate. ``--old-checkout`` runs an older tree's tuner the same way (the before/after figure).
PostgreSQL needs the services (scripts/services.sh ensure).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.services import PG_URL  # noqa: E402
from bench.stress import CURRENT, ROOT as CODE, repetition  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--backends", nargs="+", default=["journal", "postgresql"])
    parser.add_argument("--old-checkout", type=Path, default=None)
    parser.add_argument("--jitter", type=float, default=0.3)
    args = parser.parse_args()
    code, extra = (args.old_checkout, ()) if args.old_checkout else (CODE, CURRENT)
    folder = Path(tempfile.mkdtemp(prefix="stress-"))
    for backend in args.backends:
        storage = PG_URL if backend == "postgresql" else None
        for workers in args.workers:
            bad = 0
            for i in range(args.repetitions):
                rep = repetition(folder / f"{backend}-{workers}-{i}", workers, code, storage,
                                 args.jitter, extra=extra)
                bad += bool(rep.duplicates or rep.lost or rep.default_runs != 1 or
                            rep.failed_workers)
                print(f"{backend} K={workers} rep {i}: completed {list(rep.completed)} "
                      f"duplicates {list(rep.duplicates)} lost {list(rep.lost)} trial-0 runs "
                      f"{rep.default_runs} failed workers {rep.failed_workers} "
                      f"{rep.seconds:.1f} s", flush=True)
                for error in rep.errors:
                    print("  failed worker: " + error.replace("\n", "\n    "), flush=True)
            print(f"== {backend} K={workers}: {bad} of {args.repetitions} repetitions "
                  "duplicated or lost a point", flush=True)


if __name__ == "__main__":
    main()
