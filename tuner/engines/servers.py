"""``ServerEngine``: what every engine server shares as an engine object (llama.cpp, vLLM).

A server engine offers some of our methods, each mapped onto its own knobs in
``conf/engine/<kind>.yaml`` (``methods.<method>``: fixed ``flags`` — llama.cpp's server flags,
vLLM's speculative-config entries —, ``knobs`` parameter → flag or config key, default ``params``
= trial 0, and the search ``space``). ``method`` returns that mapping in the shape every later
stage reads (``_target_``, ``lossless``, ``needs_draft``, ``params``, ``space``), so plans,
samplers, the fingerprint and the best YAML work unchanged. Its program is a cached build or
install (``scripts/engines.sh``) or ``engine.binary``. The measurement protocol of the servers is
``tuner.engines.serving``'s.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import DictConfig

from tuner.config.errors import ConfigError
from tuner.config.values import plain
from tuner.engines import DEFAULT
from tuner.engines.base import Engine

ROOT = Path(__file__).resolve().parents[2]
GGUF_KINDS = ("gguf_file", "gguf_package")
BASELINES = ("matched", "plain")     # engine.baseline (tuner.engines.serving)


class ServerEngine(Engine):
    """An engine that runs as a server the tuner starts (see the module docstring)."""

    program: ClassVar[str]              # the program in the cached install's bin/
    program_allowed: ClassVar[str]      # what engine.binary may be
    install_hint: ClassVar[str]         # how to install it when it is missing
    # flags the tuner sets itself on every server (slots from budget.concurrency, context, port,
    # models, threads, speculation): in engine.extra_args they would silently change what is
    # measured (e.g. -np 1 serves a concurrency-4 batch one request after another)
    managed_flags: ClassVar[dict[str, str]] = {}
    managed_prefixes: ClassVar[dict[str, str]] = {}     # whole flag families (speculation)
    # further knobs that make every step draft exactly k (the cost surface's steps)
    exact_draft: ClassVar[Mapping[str, Any]] = {}

    # -- config ------------------------------------------------------------------------------

    def check(self, cfg: DictConfig, choice: str) -> None:
        super().check(cfg, choice)
        if cfg.get("baseline") != "per_trial":
            raise ConfigError(f"baseline={cfg.get('baseline')!r} is invalid with "
                              f"engine={self.name}: allowed is per_trial (the baseline server "
                              "answers the same batches in every trial)")
        engine = plain(cfg.engine)
        offered = sorted(engine.get("methods") or {})
        if choice not in offered:
            raise ConfigError(f"method={choice} is not offered by engine={self.name}: it "
                              f"offers {offered}")
        self.no_method_overrides(choice)
        mapping = engine["methods"][choice]
        known = set(mapping.get("knobs") or {})
        for where in ("params", "space"):
            unknown = sorted(set(mapping.get(where) or {}) - known)
            if unknown:
                raise ConfigError(f"engine.methods.{choice}.{where}.{unknown[0]} is not a knob "
                                  f"of engine={self.name}: allowed are {sorted(known)}")
        self.check_extra_args(engine.get("extra_args"))
        if engine.get("baseline", "matched") not in BASELINES:
            raise ConfigError(f"engine.baseline={engine.get('baseline')!r} is invalid: allowed "
                              f"are {list(BASELINES)} (matched: the method server's line with "
                              "drafting made impossible; plain: no speculative flags)")
        self.binary(engine)
        self.check_models(plain(cfg.models), mapping, plain(cfg.method).get("params") or {})

    def check_prediction(self, cfg: DictConfig, choice: str, setting: str) -> None:
        """``search.profile``: this engine's own cost surface (``python -m tuner.profile
        --engine <name>``, one surface per level) prices each trial's own acceptance per level
        (``tuner.predict.served``); it is measured with a draft model's steps, so draft-model
        speculation only. Ranking points before measuring them (``search=predict``) and
        predicting for another machine (``search.predict_for``) need an acceptance known
        before the timed run: our own loops (engine=hf)."""
        if not self.synthetic_surface:
            raise ConfigError(f"{setting} is invalid for engine={self.name}: its cost surface "
                              "is not built yet; allowed is null here")
        search = plain(cfg.search)
        if setting.startswith("search.predict_for"):
            raise ConfigError(f"{setting} is invalid for engine={self.name}: a prediction for "
                              "another machine needs an acceptance known without the engine "
                              "(replayed in our own loops, engine=hf); allowed is null here "
                              "(search.profile predicts each level from the engine's own counts)")
        if search.get("kind") == "predict":
            raise ConfigError(f"search=predict is invalid for engine={self.name}: the engine's "
                              "acceptance is known only once a setting ran, so nothing can be "
                              "ranked before measuring; allowed are search=grid, heuristic, tpe, "
                              "pareto (each trial then records its prediction per level)")
        mapping = (plain(cfg.engine).get("methods") or {}).get(choice) or {}
        knob = self.draft_tokens_knob
        if knob not in (mapping.get("knobs") or {}) or not mapping.get("needs_draft"):
            raise ConfigError(f"{setting} is invalid for method={choice} in engine={self.name}: "
                              "the engine's cost surface is measured with a draft model's "
                              "steps; allowed is a draft-model method (method=speculative), "
                              "or null")

    def check_extra_args(self, extra: Any) -> None:
        """One line for an ``engine.extra_args`` that is not a list, or that holds a flag the
        tuner sets itself (``managed_flags``)."""
        if extra is None:
            return
        if not isinstance(extra, list):
            raise ConfigError(f"engine.extra_args={extra!r} is invalid: allowed is a list of "
                              f"{self.program} flags and values, e.g. [--flag, value]")
        for arg in extra:
            flag = str(arg).split("=", 1)[0]
            why = self.managed(flag)
            if why:
                raise ConfigError(f"engine.extra_args has {flag!r}: the tuner sets it ({why}); "
                                  f"allowed are other {self.program} flags")

    def managed(self, flag: str) -> str | None:
        """Why the tuner sets ``flag`` itself, or None (exact names, then flag families)."""
        if flag in self.managed_flags:
            return self.managed_flags[flag]
        return next((why for prefix, why in self.managed_prefixes.items()
                     if flag.startswith(prefix)), None)

    def refuse_levels(self, levels: list[int]) -> None:
        raise ConfigError(f"budget.concurrency={levels} is invalid for engine={self.name}: "
                          f"allowed are levels up to {self.max_concurrency} (one server slot "
                          "each)")

    # -- a running deployment (python -m tuner.watch): read from the study's launch line -------

    def launch_argv(self, deploy: Mapping[str, Any]) -> list[str]:
        """The deployed command (the outcome's ``deploy.launch``) as arguments."""
        import shlex
        return shlex.split(str(deploy.get("launch") or ""))

    def deployed_model(self, argv: list[str]) -> str | None:
        """The model name a server of ``argv`` answers ``/v1/models`` with (None: unknown)."""
        raise NotImplementedError

    def shipped_draft_size(self, method: str, params: Mapping[str, Any]) -> float | None:
        """``draft_size`` of ``params`` for ``method`` as this engine's shipped mapping
        (``conf/engine/<kind>.yaml``) declares its knobs, for a reader that has the parameters
        and not the study's composed config (``python -m tuner.watch``)."""
        import yaml
        conf = yaml.safe_load((ROOT / "conf" / "engine" / f"{self.name}.yaml").read_text())
        return self.draft_size((conf.get("methods") or {}).get(method) or {}, params)

    def deployed_k(self, argv: list[str]) -> tuple[int, str] | None:
        """(k, the flag or key that sets it) of the drafted tokens per step ``argv`` deploys;
        None where it deploys no speculation or leaves k to the engine's default."""
        raise NotImplementedError

    def drafts_with_model(self, argv: list[str]) -> bool:
        """``argv`` drafts with a draft model (else from the context, or not at all)."""
        raise NotImplementedError

    def least_drafting_k(self, argv: list[str]) -> int:
        """The least k > 0 at which ``argv``'s speculation, with only its k setting changed,
        drafts at all (a candidate below it would run as speculation off)."""
        return 1

    def candidate_form(self, argv: list[str], schedule: Any) -> dict[str, Any]:
        """A per-batch-size schedule (``tuner.predict.schedule.Schedule``) as this engine loads
        it, completing the deployed speculative settings of ``argv``: nested data."""
        raise NotImplementedError


    def check_models(self, models: Mapping[str, Any], mapping: Mapping[str, Any],
                     method_params: Mapping[str, Any]) -> None:
        """One line for a model this engine cannot load (a cheap look, nothing loaded)."""
        raise NotImplementedError

    def no_method_overrides(self, choice: str) -> None:
        """``method.params.x=...`` tunes the in-process method; with a server it would be
        ignored."""
        from hydra.core.hydra_config import HydraConfig
        try:
            given = list(HydraConfig.get().overrides.task)
        except ValueError:
            return
        bad = [o for o in given if re.match(r"^[+~]*method\.(params|space)\.", o)]
        if bad:
            name = bad[0].lstrip("+~").split("=")[0]
            raise ConfigError(f"{bad[0]}: with engine={self.name} the method's knobs are "
                              f"engine.methods.{choice}.params / .space (see "
                              f"conf/engine/{self.name}.yaml); {name} applies to "
                              f"engine={DEFAULT}")

    def method(self, cfg: DictConfig, choice: str) -> dict[str, Any]:
        method = plain(cfg.method)
        mapping = (plain(cfg.engine).get("methods") or {})[choice]
        return {"_target_": method["_target_"], "lossless": True,
                "needs_draft": bool(mapping.get("needs_draft", False)),
                "params": dict(mapping.get("params") or {}),
                "space": dict(mapping.get("space") or {}),
                "engine": {"flags": dict(mapping.get("flags") or {}),
                           "knobs": dict(mapping.get("knobs") or {}),
                           "needs_head": bool(mapping.get("needs_head", False))}}

    def identity(self, engine: Mapping[str, Any], concurrency: Sequence[int] = (1,)
                 ) -> dict[str, Any] | None:
        """Its settings (the method mappings and the start-up timeout aside) and what
        identifies the build that runs (``build_identity``). ``baseline: plain`` is left out:
        it is how every study measured before the key existed, so their journals resume with
        ``engine.baseline=plain`` (and refuse the matched default, whose vanilla differs)."""
        keep = {k: v for k, v in engine.items() if k not in ("methods", "startup_timeout_s")
                and not (k == "baseline" and v == "plain")}
        return {**keep, **self.build_identity(self.binary(engine))}

    def build_identity(self, binary: Path) -> dict[str, Any]:
        """The program's sha256 (an engine whose install has a better record overrides)."""
        from tuner.engines.gguf import sha256
        return {"binary_sha256": sha256(binary)}

    # -- the program -------------------------------------------------------------------------

    def binary(self, engine: Mapping[str, Any]) -> Path:
        """The engine's program: engine.binary, or the cached build / install for this
        machine."""
        given = engine.get("binary")
        if given:
            path = Path(str(given)).expanduser()
            if not (path.is_file() and path.stat().st_mode & 0o111):
                raise ConfigError(f"engine.binary={given!r} is not an executable file: allowed "
                                  f"is {self.program_allowed}")
            return path
        found = cached_build(self.name)
        if found is None:
            raise ConfigError(f"engine={self.name}: {self.install_hint}")
        return found / self.program

    # -- results -----------------------------------------------------------------------------

    def best_params(self, choice: str, params: Mapping[str, Any]) -> dict[str, Any]:
        return {"engine": {"methods": {choice: {"params": dict(params)}}}}


def cached_build(engine: str) -> Path | None:
    """``bin/`` of the cached build of ``engine`` for this machine (scripts/engines.sh), or
    None."""
    if shutil.which("bash") is None:
        return None
    done = subprocess.run(["bash", str(ROOT / "scripts" / "engines.sh"), "path", engine],
                          capture_output=True, text=True)
    return Path(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else None


def flag_value(argv: list[str], *names: str) -> str | None:
    """The value of the last of ``names`` in ``argv`` (``--flag value`` or ``--flag=value``, the
    last one given wins, as the engines' parsers read it); None where absent."""
    found = None
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            found = argv[i + 1]
        elif "=" in arg and arg.split("=", 1)[0] in names:
            found = arg.split("=", 1)[1]
    return found


def check_gguf(role: str, spec: Mapping[str, Any]) -> None:
    """A GGUF file starts with the magic bytes GGUF (a cheap check before any server starts)."""
    from tuner.engines.gguf import source_gguf
    try:
        path = source_gguf(spec)
    except (OSError, ValueError, ModuleNotFoundError) as err:
        raise ConfigError(f"{role}: {str(err).splitlines()[0]}") from None
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConfigError(f"{role}: {path} is not a GGUF file (no GGUF magic): allowed is "
                              "a model file llama.cpp can load")
