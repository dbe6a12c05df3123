"""EAGLE head weights: the published layout, head references, loading, saving and identity.

Published layout (SafeAILab/EAGLE; yuhuili/EAGLE-* on the hub), one directory holding
  * ``config.json``: a LlamaConfig with ``num_hidden_layers: 1``, plus ``bias`` (fc bias, default
    true) and ``qkv_bias`` (Qwen2 heads); RoPE from ``rope_theta`` / ``rope_scaling`` (none or
    linear) or transformers-5 ``rope_parameters``;
  * ``model.safetensors`` or ``pytorch_model.bin`` with keys ``fc.weight``, ``fc.bias``,
    ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
    ``layers.0.post_attention_layernorm.weight`` (``layers.i.input_layernorm.weight`` for i ≥ 1),
    and often ``embed_tokens.weight`` (ignored: the target's embedding is used; its shape is checked).
EAGLE-3 heads (``decoding.eagle3_head``; the authors' ``LlamaForCausalLMEagle3`` layout, which vLLM
and SGLang load too) are recognised by ``midlayer.*`` / ``d2t`` keys or ``draft_vocab_size``:
  * ``config.json`` with ``draft_vocab_size``, optional ``target_hidden_size`` and
    ``eagle_aux_hidden_state_layer_ids`` (top level or under ``eagle_config``; default: the inputs
    of target layers 2, L//2 and L−3);
  * weights ``fc.weight`` (3·H_t → H), ``midlayer.*``, ``norm.weight``, ``lm_head.weight``
    ([draft_vocab_size, H]), ``d2t`` / ``t2d`` (absent when the vocabularies are equal), optional
    ``embed_tokens.weight`` (shape-checked; the target's embedding is used).
They are checked against the target: hidden size, vocabulary, the layer ids within its depth,
``d2t`` mapping every draft id to a distinct target id that ``t2d`` marks.

A head reference (``head=`` of ``method=eagle``) is one of: a shipped head name (``SHIPPED``),
``"random"`` / ``"random:<seed>"`` (random init sized from the target: tests and smoke runs),
``"auto"`` (the shipped head made for this target, else a random head with a warning), a local
directory, or a Hugging Face hub id (optionally ``id@revision``).

The network itself (``EagleHead``, ``HeadConfig``) is ``decoding.eagle_head``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from decoding.eagle3_head import Eagle3Config, Eagle3Head, default_layer_ids
from decoding.eagle_head import EagleHead, HeadConfig

log = logging.getLogger(__name__)

HEADS_DIR = Path(__file__).resolve().parent / "heads"
SHIPPED = {"smollm2-135m-instruct": HEADS_DIR / "smollm2-135m-instruct",            # EAGLE-2
           "smollm2-135m-instruct-eagle3": HEADS_DIR / "smollm2-135m-instruct-eagle3"}  # EAGLE-3
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LOCAL_PREFIXES = ("/", "./", "../", "~")
RANDOM = re.compile(r"random(?::(\d+))?")
AnyHead = EagleHead | Eagle3Head


def random_seed(reference: str) -> int | None:
    """The seed of a ``"random"`` / ``"random:<seed>"`` reference; None for any other reference
    (a hub id or directory that merely starts with "random" is not a random head)."""
    match = RANDOM.fullmatch(reference)
    return None if match is None else int(match.group(1) or 0)


def head_folder(reference: str) -> Path:
    """The directory of a shipped name or local path."""
    return SHIPPED.get(reference) or Path(reference).expanduser()


def is_file_reference(reference: str) -> bool:
    """A shipped name or a local directory (not random, auto or a hub id)."""
    return random_seed(reference) is None and reference != "auto" and \
        (reference in SHIPPED or is_local(reference))


def is_local(reference: str) -> bool:
    return reference.startswith(LOCAL_PREFIXES) or Path(reference).expanduser().is_dir()


def _split_revision(reference: str) -> tuple[str, str | None]:
    repo, _, revision = reference.partition("@")
    return repo, revision or None


def head_files(reference: str) -> tuple[Path, Path]:
    """(config.json, weights file) of a shipped name, local directory or hub id (downloaded)."""
    if reference in SHIPPED or is_local(reference):
        folder = head_folder(reference)
        check_local_head(reference)
        weights = next(folder / f for f in WEIGHT_FILES if (folder / f).is_file())
        return folder / "config.json", weights
    from transformers.utils import cached_file
    repo, revision = _split_revision(reference)
    try:
        config = Path(cached_file(repo, "config.json", revision=revision))
    except OSError as err:
        raise OSError(f"could not load EAGLE head {reference!r}: {err}. If the Hugging Face Hub is "
                      "not reachable from this machine, give a local directory instead") from err
    for name in WEIGHT_FILES:
        try:
            return config, Path(cached_file(repo, name, revision=revision))
        except OSError:
            continue
    raise OSError(f"EAGLE head {reference!r} has neither {' nor '.join(WEIGHT_FILES)}")


def check_local_head(reference: str) -> None:
    """Raise ValueError unless a shipped name or local path is a head directory (files only)."""
    folder = head_folder(reference)
    if not folder.is_dir():
        raise ValueError(f"head={reference!r}: no such local directory")
    if not (folder / "config.json").is_file() or not any((folder / f).is_file()
                                                         for f in WEIGHT_FILES):
        raise ValueError(f"head={reference!r} is not an EAGLE head directory: it needs "
                         f"config.json and {' or '.join(WEIGHT_FILES)}")


def read_config(reference: str) -> dict[str, Any] | None:
    """The raw config of a shipped or local head (None for hub ids and random heads)."""
    if not is_file_reference(reference):
        return None
    check_local_head(reference)
    folder = head_folder(reference)
    return json.loads((folder / "config.json").read_text())


def load_state(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def fit_problems(head_hidden: Any, head_vocab: Any, hidden: int, vocab: int) -> list[str]:
    """What keeps a head from fitting a target: hidden size and vocabulary, each naming both."""
    problems = []
    if head_hidden != hidden:
        problems.append(f"hidden size {head_hidden} (head) vs {hidden} (target)")
    if head_vocab != vocab:
        problems.append(f"vocabulary {head_vocab} (head) vs {vocab} (target)")
    return problems


def check_fits(cfg: HeadConfig | Eagle3Config, state: Mapping[str, torch.Tensor] | None,
               target: nn.Module, head_name: str, target_name: str) -> None:
    """Raise ValueError naming both models unless the head's features and vocabulary fit (and,
    for EAGLE-3, its layer ids lie within the target's depth and ``d2t``/``t2d`` are sound)."""
    hidden = int(target.get_input_embeddings().embedding_dim)
    vocab = int(target.get_output_embeddings().weight.shape[0])
    problems = fit_problems(cfg.hidden_size, cfg.vocab_size, hidden, vocab)
    if isinstance(cfg, Eagle3Config):
        if not problems and cfg.target_hidden_size != hidden:
            problems.append(f"target_hidden_size {cfg.target_hidden_size} (head) vs {hidden} "
                            "(target)")
        depth = int(target.config.num_hidden_layers)
        outside = [i for i in cfg.layer_ids or () if not 0 <= i <= depth]
        if outside:
            problems.append(f"layer ids {list(cfg.layer_ids or ())} (head) vs {depth} layers "
                            f"(target; allowed ids 0..{depth})")
    embed = (state or {}).get("embed_tokens.weight")
    if not problems and embed is not None and tuple(embed.shape) != (vocab, hidden):
        problems.append(f"embed_tokens {tuple(embed.shape)} (head) vs {(vocab, hidden)} (target)")
    if problems:
        raise ValueError(f"EAGLE head {head_name!r} does not fit target {target_name!r}: "
                         f"{'; '.join(problems)}. A head is trained for one target model: use the "
                         "head published for this target (or train one: python -m eagle_training)")


def is_eagle3(state: Mapping[str, Any], raw: Mapping[str, Any]) -> bool:
    """An EAGLE-3 checkpoint (``midlayer.*`` / ``d2t`` keys, or ``draft_vocab_size``)."""
    return (any(k.startswith("midlayer.") for k in state) or "d2t" in state
            or "draft_vocab_size" in raw or "LlamaForCausalLMEagle3" in raw.get("architectures", ()))


def check_vocabulary(cfg: Eagle3Config, state: Mapping[str, torch.Tensor], name: str) -> None:
    """``d2t`` ([Vd] offsets) maps every draft id to a distinct target id in range, and ``t2d``
    ([V] bool) marks exactly those; absent both, the vocabularies must be equal."""
    d2t, t2d = state.get("d2t"), state.get("t2d")
    draft, vocab = cfg.draft_vocab_size, cfg.vocab_size
    if d2t is None or t2d is None:
        if draft != vocab:
            raise ValueError(f"EAGLE-3 head {name!r} has draft_vocab_size={draft} < vocab_size="
                             f"{vocab} but no d2t/t2d mapping: allowed is both or equal sizes")
        return
    if tuple(d2t.shape) != (draft,) or tuple(t2d.shape) != (vocab,):
        raise ValueError(f"EAGLE-3 head {name!r}: d2t {tuple(d2t.shape)} / t2d "
                         f"{tuple(t2d.shape)} do not fit draft_vocab_size={draft}, vocab_size="
                         f"{vocab} (allowed: d2t [{draft}], t2d [{vocab}])")
    ids = torch.arange(draft) + d2t.long()
    if bool((ids < 0).any() | (ids >= vocab).any()) or ids.unique().numel() != draft:
        raise ValueError(f"EAGLE-3 head {name!r}: d2t maps draft ids outside the target "
                         f"vocabulary of {vocab} or onto one id twice (allowed: {draft} distinct "
                         f"target ids in 0..{vocab - 1})")
    marked = torch.zeros(vocab, dtype=torch.bool)
    marked[ids] = True
    if not torch.equal(marked, t2d.bool()):
        raise ValueError(f"EAGLE-3 head {name!r}: t2d does not mark the target ids d2t maps to")


def target_name(target: nn.Module) -> str:
    return str(getattr(target.config, "name_or_path", "") or type(target).__name__)


def load_head(reference: str, target: nn.Module, version: int | None = None) -> AnyHead:
    """Resolve a head reference for ``target`` (see the module docstring), checked against it.

    ``version``: 3 makes "random"/"auto" EAGLE-3 heads and refuses EAGLE-1/2 files; None
    (``method=eagle``) loads either format and makes EAGLE-1/2 heads for "random"/"auto".
    """
    if reference == "auto":
        reference = default_head(target, version or 2)
    seed = random_seed(reference)
    if seed is not None:
        return random_head(target, seed, version or 2)
    config_path, weights_path = head_files(reference)
    raw = json.loads(config_path.read_text())
    # a DataParallel-saved checkpoint prefixes every key with "module."
    state = {key.removeprefix("module."): value for key, value in load_state(weights_path).items()}
    if is_eagle3(state, raw):
        cfg = Eagle3Config.from_json(raw)
        if cfg.layer_ids is None:
            cfg = replace(cfg, layer_ids=default_layer_ids(int(target.config.num_hidden_layers)))
        check_fits(cfg, state, target, reference, target_name(target))
        check_vocabulary(cfg, state, reference)
        head: AnyHead = Eagle3Head(cfg, target.get_input_embeddings())
    else:
        if version == 3:
            raise ValueError(f"EAGLE head {reference!r} is an EAGLE-1/2 head, not EAGLE-3: run "
                             "it with method=eagle")
        cfg = HeadConfig.from_json(raw)
        check_fits(cfg, state, target, reference, target_name(target))
        head = EagleHead(cfg, target.get_input_embeddings(), target.get_output_embeddings())
    own = head_state(state)
    missing, unexpected = head.load_state_dict(own, strict=False)
    missing = [key for key in missing if key not in ("d2t", "t2d")]   # equal vocabularies
    if missing or unexpected:
        raise ValueError(f"EAGLE head {reference!r} has an unexpected layout: missing "
                         f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
    return place(head, target)


def head_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The head's own tensors: the shared embedding (shape-checked by ``check_fits``) and derived
    RoPE buffers (``*.rotary_emb.inv_freq``, recomputed from the config) dropped, as the EAGLE
    authors' non-strict load ignores them; any other unknown or missing key fails the load."""
    return {key: value for key, value in state.items()
            if key != "embed_tokens.weight" and not key.endswith("rotary_emb.inv_freq")}


def random_head(target: nn.Module, seed: int = 0, version: int = 2) -> AnyHead:
    """A randomly initialised head sized from the target (seeded; global RNG untouched): a
    one-layer EAGLE-1/2 head, or (``version=3``) an EAGLE-3 head over the full vocabulary."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if version == 3:
            head: AnyHead = Eagle3Head(Eagle3Config.for_target(target.config),
                                       target.get_input_embeddings())
        else:
            head = EagleHead(HeadConfig.for_target(target.config), target.get_input_embeddings(),
                             target.get_output_embeddings())
    return place(head, target)


def place(head: AnyHead, target: nn.Module) -> AnyHead:
    weight = target.get_output_embeddings().weight
    return head.to(device=weight.device, dtype=weight.dtype).eval()


def head_version(reference: str) -> int:
    """3 for a shipped or local EAGLE-3 head directory, else 2 (random and hub heads: unknown
    before download, reported as 2; a directory that is not a head: 2, its own check reports)."""
    try:
        raw = read_config(reference) if is_file_reference(reference) else None
    except (OSError, ValueError):
        return 2
    return 3 if raw is not None and is_eagle3({}, raw) else 2


def default_head(target: nn.Module, version: int = 2) -> str:
    """The shipped head of ``version`` made for this target's architecture, else "random" (with a
    warning)."""
    raw = target.config.to_dict()
    for name in SHIPPED:
        if not SHIPPED[name].is_dir() or head_version(name) != version:
            continue
        made_for = (read_config(name) or {}).get("spectune", {}).get("target_signature", {})
        if made_for and all(raw.get(k) == v for k, v in made_for.items()):
            return name
    log.warning("no EAGLE%s head given and none shipped for target %s: using a random head "
                "(acceptance near zero); pass head=<hub id or head directory>",
                "-3" if version == 3 else "", target_name(target))
    return "random"


def save_head(head: AnyHead, folder: Path, dtype: torch.dtype = torch.float16,
              extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the published layout; returns the folder
    (floating tensors in ``dtype``; EAGLE-3's ``d2t``/``t2d`` keep their integer types)."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = {**head.config.to_json(), "torch_dtype": str(dtype).removeprefix("torch.")}
    if extra:
        raw["spectune"] = dict(extra)
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def head_identity(reference: Any) -> dict[str, Any]:
    """What identifies a head for a study's fingerprint: the reference and, for files, a hash."""
    reference = str(reference)
    if not is_file_reference(reference):
        return {"head": reference}
    try:
        _, weights = head_files(reference)
    except (OSError, ValueError):
        return {"head": reference, "missing": True}
    digest = hashlib.sha256()
    with open(weights, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"head": reference, "weights": weights.name, "sha256": digest.hexdigest()}


def head_source(reference: Any, identity: Mapping[str, Any] | None = None) -> str:
    """One line saying which weights a reference loaded: a random seed, a file and its sha256, or
    a hub snapshot's commit (with a warning when the id carries no ``@revision`` pin).

    ``identity``: ``head_identity(reference)`` if already computed (it hashes the weights).
    """
    reference = str(reference)
    seed = random_seed(reference)
    if seed is not None:
        return f"random initialisation (seed {seed}): acceptance near zero, a smoke test only"
    ident = identity if identity is not None else head_identity(reference)
    if "sha256" in ident:
        folder = head_folder(reference)
        return f"{folder / ident['weights']} (sha256 {ident['sha256'][:12]})"
    try:
        config, _ = head_files(reference)
    except (OSError, ValueError):
        return "files not found"
    commit = config.parent.name if config.parent.parent.name == "snapshots" else "unknown"
    pinned = "@" in reference
    return (f"hub snapshot {commit}" + ("" if pinned else
            f" (not pinned: the study records the id only; pin it with {reference}@{commit})"))
