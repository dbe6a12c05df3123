"""Transformers model folders for engines that load them (vLLM), made from the study's model specs.

* ``gguf_file`` / ``gguf_package``: the GGUF de-quantised once into an fp32 safetensors folder (the
  same cache ``decoding.models`` loads for ``engine=hf``: exactly the weights the in-process loops
  measure);
* ``hub``: a local folder as it is, or a hub id (``id@revision`` becomes the id plus a revision
  the engine is told);
* draft ``{kind: early_exit, num_layers: k}``: a folder holding the target's first k decoder layers,
  final norm and LM head (weights copied from the target's folder: the same model
  ``decoding.models.early_exit_draft`` builds in memory), cached beside the target's.
Self-drafts that exist only in memory (``int8_dynamic``: torch dynamic quantisation; ``same``) have
no folder an engine can load and are refused by ``tuner.engines.vllm.VllmEngine``.

EAGLE-1/2 heads for vLLM (``vllm_head``): vLLM's EAGLE Llama head has an ``fc`` without bias, and
its Llama layer reads the config key ``bias`` — which the published EAGLE layout uses for the fc
bias — as the attention output's bias, which then has no weights and stays uninitialised (the
shipped SmolLM2 head, ``bias: true``, drafted 93 tokens and had 0 accepted that way). A head with
an fc bias is therefore copied once without it and with ``bias: false`` (cached by its weights'
sha256); the record says so. Dropping the fc bias changes the head slightly: with our own loop the
shipped head accepted 9 instead of 8 of 196 drafted tokens on two GSM8K prompts.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DRAFT_KINDS = ("gguf_file", "gguf_package", "hub", "early_exit")


@dataclass(frozen=True)
class Folder:
    """A model an engine loads: a local folder or a hub id, with where it came from."""

    path: str                   # a local folder, or a hub id
    revision: str | None        # hub ids only
    origin: str                 # for the records: what it was made from

    def describe(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.path}{rev} ({self.origin})"


def target_folder(spec: Mapping[str, Any]) -> Folder:
    kind = spec.get("kind")
    if kind in ("gguf_file", "gguf_package"):
        from decoding.models import convert_gguf
        from tuner.engines.gguf import source_gguf
        source = source_gguf(spec)
        return Folder(str(convert_gguf(source)), None, f"{source.name} de-quantised to fp32")
    if kind == "hub":
        path = str(spec.get("path") or "")
        if not path:
            raise ValueError("a model of kind=hub needs path: a hub id or a local folder")
        local = Path(path).expanduser()
        if local.is_dir():
            return Folder(str(local), None, "local folder")
        return Folder(path, spec.get("revision"), "hub id")
    raise ValueError(f"kind={kind!r} has no folder an engine can load")


def draft_folder(spec: Mapping[str, Any], target: Folder) -> Folder:
    if spec.get("kind") == "early_exit":
        return early_exit_folder(target, int(spec["num_layers"]))
    return target_folder(spec)


def early_exit_folder(target: Folder, num_layers: int) -> Folder:
    """The target's first ``num_layers`` layers + final norm + LM head, as a model folder."""
    source = Path(target.path)
    if not (source / "config.json").is_file():
        raise ValueError(f"draft kind=early_exit needs the target as a local folder, not "
                         f"{target.path!r}")
    config = json.loads((source / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers < total:
        raise ValueError(f"early_exit num_layers={num_layers} is invalid: allowed is an integer in "
                         f"[1, {total - 1}] for this {total}-layer target")
    out = source.with_name(f"{source.name}-early-exit-{num_layers}")
    _publish(out, lambda partial: _write_truncated(source, partial, config, num_layers))
    return Folder(str(out), None, f"first {num_layers} of {total} layers of {source.name}")


def _publish(out: Path, write: Callable[[Path], None]) -> None:
    """Make the folder ``out`` once: ``write`` fills a private partial folder, which is renamed
    into place (a process that loses the race to another drops its copy)."""
    if (out / "config.json").is_file():
        return
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write(partial)
    try:
        partial.rename(out)
    except OSError:                     # another process finished first
        shutil.rmtree(partial, ignore_errors=True)


def _write_truncated(source: Path, out: Path, config: dict, num_layers: int) -> None:
    from safetensors.torch import load_file, save_file
    config = {**config, "num_hidden_layers": num_layers}
    if config.get("layer_types"):
        config["layer_types"] = list(config["layer_types"])[:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(str(shard)).items():
            if ".layers." in name and int(name.split(".layers.", 1)[1].split(".", 1)[0]) \
                    >= num_layers:
                continue
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for extra in source.iterdir():          # tokenizer and generation config
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name != "config.json" \
                and not extra.name.endswith(".index.json"):
            shutil.copy(extra, out / extra.name)


def vllm_head(reference: str) -> Folder:
    """An EAGLE-1/2 head as vLLM loads it (see the module docstring): a hub id as it is; a
    shipped or local head with an fc bias copied without it."""
    from decoding.eagle_weights import head_files, head_folder, is_file_reference, load_state
    if not is_file_reference(reference):
        repo, _, revision = reference.partition("@")
        return Folder(repo, revision or None, "hub id, loaded by vLLM as published")
    folder = head_folder(reference)
    config = json.loads((folder / "config.json").read_text())
    _, weights = head_files(reference)
    state = load_state(weights)
    if "fc.bias" not in state and not config.get("bias"):
        return Folder(str(folder), None, "as published")
    from tuner.engines.gguf import cache_dir, sha256
    out = cache_dir().parent / "heads" / f"{folder.name}-{sha256(weights)[:12]}-vllm"

    def write(partial: Path) -> None:
        from safetensors.torch import save_file
        kept = {k: v.contiguous() for k, v in state.items() if k != "fc.bias"}
        save_file(kept, str(partial / "model.safetensors"), metadata={"format": "pt"})
        published = {k: v for k, v in config.items() if k != "spectune"}
        (partial / "config.json").write_text(json.dumps({**published, "bias": False}, indent=2))

    _publish(out, write)
    return Folder(str(out), None, f"{reference} without its fc bias (vLLM's EAGLE head has none)")
