"""GGUF files for an engine that runs GGUF models (llama.cpp), made from the study's model specs.

The target is the spec's GGUF file (``gguf_file``, or the one a ``gguf_package`` ships), optionally
re-typed with ``llama-quantize --allow-requantize`` (``engine.target_type``: ``match_dtype`` gives
F32 for ``dtype: float32`` — exactly the weights the hf engine de-quantises and measures —, F16,
BF16; ``native`` keeps the file as shipped; or any llama-quantize type). A draft is a GGUF spec of
its own, or, for ``{kind: int8_dynamic}``, the target re-typed to ``engine.self_draft_type``.
Re-typed files are cached under ``~/.cache/spectune/engines/gguf/`` by the source's sha256 and
the type, so they are made once per machine.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

DTYPE_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class GGUF:
    """A model file for the engine, with where it came from (recorded with the study)."""

    path: Path
    source: Path                # the spec's own file
    source_sha256: str
    type: str                   # native | the llama-quantize type it was re-typed to

    def describe(self) -> str:
        kind = "as shipped" if self.type == "native" else f"re-typed to {self.type}"
        return (f"{self.path.name} ({kind} from {self.source.name} "
                f"sha256:{self.source_sha256[:12]})")


def source_gguf(spec: Mapping[str, Any]) -> Path:
    """The GGUF file a ``gguf_file`` / ``gguf_package`` spec names."""
    if spec.get("kind") == "gguf_file":
        path = Path(str(spec.get("path", ""))).expanduser()
        if not path.is_file():
            raise ValueError(f"path={spec.get('path')!r}: no such GGUF file")
        return path
    if spec.get("kind") == "gguf_package":
        from decoding.models import package_gguf
        return package_gguf(spec)
    raise ValueError(f"kind={spec.get('kind')!r} is not a GGUF model")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_dir() -> Path:
    root = os.environ.get("SPECTUNE_ENGINES") or Path.home() / ".cache" / "spectune" / "engines"
    return Path(root) / "gguf"


def prepare(spec: Mapping[str, Any], type_: str, quantize: Path) -> GGUF:
    """The spec's GGUF, re-typed to ``type_`` (``native``: as shipped) with ``quantize``."""
    source = source_gguf(spec)
    digest = sha256(source)
    if type_ == "native":
        return GGUF(source, source, digest, "native")
    out = cache_dir() / f"{source.stem}-{digest[:16]}-{type_}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        done = subprocess.run([str(quantize), "--allow-requantize", str(source), str(partial),
                               type_], capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-5:])
            raise RuntimeError(f"llama-quantize could not re-type {source.name} to {type_}:\n"
                               f"{tail}")
        partial.rename(out)                  # complete or absent, never half written
    return GGUF(out, source, digest, type_)


def target_type(engine: Mapping[str, Any], target: Mapping[str, Any]) -> str:
    """``engine.target_type`` resolved against the target's dtype."""
    wanted = str(engine.get("target_type") or "match_dtype")
    if wanted != "match_dtype":
        return wanted
    return DTYPE_TYPES.get(str(target.get("dtype") or "float32"), "native")


def model_files(engine: Mapping[str, Any], models: Mapping[str, Any], needs_draft: bool,
                quantize: Path) -> tuple[GGUF, GGUF | None]:
    """(target, draft or None) as the engine will load them."""
    target_spec = models["target"]
    target = prepare(target_spec, target_type(engine, target_spec), quantize)
    if not needs_draft:
        return target, None
    draft_spec = models["draft"]
    if draft_spec.get("kind") == "int8_dynamic":      # a self draft: the target, re-typed
        return target, prepare(target_spec, str(engine.get("self_draft_type", "Q8_0")), quantize)
    return target, prepare(draft_spec, str(draft_spec.get("type", "native")), quantize)
