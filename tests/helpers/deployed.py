"""A study's deployment started for real: its ``deploy.launch`` line from ``outcome.json`` run
on loopback (a free port, the cached engine build, the model file or folder as the engine
prepares it on this machine: the recorded paths are the machine's that ran the study), as a user
would deploy the answer.

``deployed(outcome_path, log_dir)`` returns an ``EngineServer`` (always stopped by its ``with``
block or ``stop()``, and by the kernel should the test process die).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from tuner.engines import engine_named
from tuner.engines.server import EngineServer


def launch_argv(outcome_path: Path) -> tuple[str, list[str]]:
    """(engine kind, the deployed command with the installed program and ``{port}``)."""
    import yaml
    outcome_path = Path(outcome_path)
    outcome = json.loads(outcome_path.read_text())
    best = yaml.safe_load(outcome_path.with_name(
        outcome_path.name.removesuffix(".outcome.json") + ".yaml").read_text())
    kind = outcome["engine"]["kind"]
    argv = shlex.split(outcome["deploy"]["launch"])
    engine = engine_named(kind)
    binary = engine.binary({})
    port = argv.index("--port")
    argv[port + 1] = "{port}"
    if kind == "llamacpp":       # the target file as the engine prepares it on this machine
        from tuner.engines.gguf import model_files
        drafted = "-md" in argv         # a self draft: the target re-typed, as its file says
        draft_type = Path(argv[argv.index("-md") + 1]).stem.rsplit("-", 1)[-1] if drafted \
            else "Q8_0"
        target, draft = model_files({"target_type": "match_dtype",
                                     "self_draft_type": draft_type}, best["models"], drafted,
                                    binary.parent / "llama-quantize")
        argv[argv.index("-m") + 1] = str(target.path)
        if drafted:
            argv[argv.index("-md") + 1] = str(draft.path)
        return kind, [str(binary), *argv[1:]]
    if kind == "vllm":           # `vllm serve MODEL ...` as the module the install runs
        from tuner.engines.folders import target_folder
        model = target_folder(best["models"]["target"]).path
        return kind, [str(binary.parent / "python"), "-m", "vllm.entrypoints.openai.api_server",
                      "--model", model, *argv[3:]]
    raise ValueError(f"no server for engine {kind}")


def deployed(outcome_path: Path, log_dir: Path, name: str = "deployed") -> EngineServer:
    kind, argv = launch_argv(outcome_path)
    env = None
    if kind == "vllm":
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    return EngineServer(argv, name, log_dir, health="/health", startup_timeout_s=300, env=env)
