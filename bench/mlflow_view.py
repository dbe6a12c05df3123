"""Does the MLflow link a study prints show the columns that matter without a click?

Checked the way a user sees it: a tiny study (tiny models, MLflow on SQLite) in a temporary
folder, then a real ``mlflow server`` on loopback over that database, and Debian's headless
Chromium opening the printed link (rendered with a virtual-time budget). The page's DOM gives the
runs table's column ids; every column of the study's saved view must be among them, and the
screenshot shows it. Writes ``view.png`` and ``view.json`` to ``--out``; exits 1 when a column is
missing. The server is always stopped.

    python bench/mlflow_view.py --out bench/results_mlflow_view

Needs ``chromium`` (``apt-get install chromium``); it is not a project dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDY = ["+task=gsm8k", "method=speculative", "models=tiny", "task.n_prompts=2",
         "task.n_held_out=2", "task.max_new_tokens=6", "warmup_prompts=1", "contention=warn",
         "search=grid", "search.n_trials=2", "study_name=view", "tracking.experiment=view"]
CHROMIUM = ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1600,1000",
            "--virtual-time-budget=30000"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results_mlflow_view")
    parser.add_argument("--chromium", default="chromium")
    args = parser.parse_args()
    chromium = shutil.which(args.chromium)
    if chromium is None:
        print(f"error: --chromium={args.chromium!r} is not on PATH: allowed is a Chromium "
              "binary (Debian: apt-get install chromium)")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "tuner", *STUDY], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
        link = re.search(r"its runs, best first: (\S+)$", done.stdout, re.M)
        if done.returncode != 0 or link is None:
            print(done.stdout[-2000:] + done.stderr[-2000:])
            return 1
        port = free_port()
        url = link.group(1).replace("http://127.0.0.1:5000", f"http://127.0.0.1:{port}")
        key = url.rsplit("viewStateShareKey=", 1)[1]
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
             f"sqlite:///{work}/mlruns/mlflow.db", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"], cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        try:
            wait_healthy(port, server)
            view = saved_view(port, key)
            subprocess.run([chromium, *CHROMIUM, f"--screenshot={args.out / 'view.png'}", url],
                           capture_output=True, timeout=180, check=True)
            dom = subprocess.run([chromium, *CHROMIUM, "--dump-dom", url], capture_output=True,
                                 text=True, timeout=180, check=True).stdout
            version = subprocess.run([chromium, "--version"], capture_output=True,
                                     text=True).stdout.strip()
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    shown = sorted(set(re.findall(r'col-id="((?:metrics|params)\.`[^`]+`)"', dom)))
    wanted = view["selectedColumns"]
    missing = [c for c in wanted if c not in shown]
    import mlflow
    result = {"mlflow": mlflow.__version__, "chromium": version, "link": url,
              "columns_wanted": wanted, "columns_shown": shown, "missing": missing,
              "ok": not missing, "shared_view_banner": "viewing a shared view" in dom}
    (args.out / "view.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"MLflow {result['mlflow']}, {version}: {len(wanted) - len(missing)} of {len(wanted)} "
          f"columns of the study's view in the rendered runs table, no click"
          + (f"; MISSING {missing}" if missing else "") + f" ({args.out / 'view.png'})")
    return 0 if not missing else 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, server: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"mlflow server exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"mlflow server on port {port} not healthy after {timeout_s:.0f} s")


def saved_view(port: int, key: str) -> dict:
    """The view the link names, read back from the experiment's tags through the server."""
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=f"http://127.0.0.1:{port}")
    experiment = client.get_experiment_by_name("view")
    return json.loads(experiment.tags[f"mlflow.sharedViewState.{key}"])


if __name__ == "__main__":
    sys.exit(main())
