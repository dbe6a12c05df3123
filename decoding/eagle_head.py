"""EAGLE draft heads (the EAGLE-1 / EAGLE-2 format): the network, its published layout, loading.

An EAGLE head (Li et al. 2024) autoregresses on the target's *features*: the last hidden states,
after the final norm (what the target's LM head reads; EAGLE's "second-to-top layer"). At sequence
position i its input is the feature f_i and the embedding of the token one step ahead, t_{i+1}
("feature & shifted token"); its output predicts f_{i+1}, which the target's own LM head turns into
the distribution of t_{i+2}. The network:

    x = fc(cat(embed(t_{i+1}), f_i))          # Linear 2H -> H (embedding first, as published)
    x = decoder layer(s)(x)                   # Llama-style; layer 0 has no input norm
    f̂_{i+1} = x                               # no final norm; embed and LM head are the target's

Published layout (SafeAILab/EAGLE; yuhuili/EAGLE-* on the hub), one directory holding
  * ``config.json``: a LlamaConfig with ``num_hidden_layers: 1``, plus ``bias`` (fc bias, default
    true) and ``qkv_bias`` (Qwen2 heads); RoPE from ``rope_theta`` / ``rope_scaling`` (none or
    linear) or transformers-5 ``rope_parameters``;
  * ``model.safetensors`` or ``pytorch_model.bin`` with keys ``fc.weight``, ``fc.bias``,
    ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
    ``layers.0.post_attention_layernorm.weight`` (``layers.i.input_layernorm.weight`` for i ≥ 1),
    and often ``embed_tokens.weight`` (ignored: the target's embedding is used; its shape is checked).
EAGLE-3 heads (fused low/mid/high-layer features, ``midlayer.*``, their own LM head over a draft
vocabulary with ``d2t``) are recognised and refused with a clear message: not supported yet.

A head reference (``head=`` of ``method=eagle``) is one of: a shipped head name (``SHIPPED``),
``"random"`` / ``"random:<seed>"`` (random init sized from the target: tests and smoke runs),
``"auto"`` (the shipped head made for this target, else a random head with a warning), a local
directory, or a Hugging Face hub id (optionally ``id@revision``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

HEADS_DIR = Path(__file__).resolve().parent / "heads"
SHIPPED = {"smollm2-135m-instruct": HEADS_DIR / "smollm2-135m-instruct"}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LOCAL_PREFIXES = ("/", "./", "../", "~")


# --------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class HeadConfig:
    """The shape of a head; read from / written to the published ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_linear_factor: float = 1.0        # linear RoPE scaling (1 = none)
    fc_bias: bool = True                   # published key "bias"
    qkv_bias: bool = False
    hidden_act: str = "silu"

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> HeadConfig:
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"EAGLE head hidden_act={raw.get('hidden_act')!r} is not supported "
                             "(allowed: silu)")
        heads = int(raw["num_attention_heads"])
        theta, factor = _rope(raw)
        return cls(hidden_size=int(raw["hidden_size"]),
                   intermediate_size=int(raw["intermediate_size"]),
                   num_attention_heads=heads,
                   num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                   head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
                   num_layers=int(raw.get("num_hidden_layers", 1)),
                   vocab_size=int(raw["vocab_size"]),
                   rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta,
                   rope_linear_factor=factor, fc_bias=bool(raw.get("bias", True)),
                   qkv_bias=bool(raw.get("qkv_bias", False)))

    @classmethod
    def for_target(cls, config: Any, num_layers: int = 1) -> HeadConfig:
        """A one-layer head shaped like the target's decoder layers (a transformers config)."""
        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        return cls.from_json({**raw, "num_hidden_layers": num_layers, "bias": True,
                              "qkv_bias": False})

    def to_json(self) -> dict[str, Any]:
        """The published ``config.json`` (a LlamaConfig EAGLE's own loader reads too)."""
        raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
               "num_attention_heads": self.num_attention_heads,
               "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
               "num_hidden_layers": self.num_layers, "vocab_size": self.vocab_size,
               "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
               "hidden_act": self.hidden_act, "bias": self.fc_bias, "qkv_bias": self.qkv_bias,
               "max_position_embeddings": 8192, "tie_word_embeddings": False}
        if self.rope_linear_factor != 1.0:
            raw["rope_scaling"] = {"type": "linear", "factor": self.rope_linear_factor}
        return raw


def _rope(raw: Mapping[str, Any]) -> tuple[float, float]:
    """(theta, linear factor) from EAGLE-style or transformers-5 RoPE keys."""
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default")
                                          != "default" else None)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return theta, 1.0
    if kind == "linear":
        return theta, float(scaling["factor"])
    raise ValueError(f"EAGLE head RoPE scaling {kind!r} is not supported (allowed: none, linear)")


# --------------------------------------------------------------------------------------------
# The network


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class HeadCache:
    """Keys and values of every head layer: [1, kv_heads, T, d] each; ``crop`` rolls back."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[-2])

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            keys = torch.cat([self.keys[layer], keys], dim=-2)
            values = torch.cat([self.values[layer], values], dim=-2)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def crop(self, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None and k.shape[-2] > length:
                self.keys[i], self.values[i] = k[..., :length, :], v[..., :length, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class HeadAttention(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                               cfg.head_dim)
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: HeadCache | None, layer: int) -> torch.Tensor:
        batch, n, _ = x.shape                                                       # [B, n, H]
        q = self.q_proj(x).view(batch, n, self.heads, self.dim).transpose(1, 2)     # [B, h, n, d]
        k = self.k_proj(x).view(batch, n, self.kv_heads, self.dim).transpose(1, 2)  # [B, kv, n, d]
        v = self.v_proj(x).view(batch, n, self.kv_heads, self.dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is not None:
            if mask is None and n > 1 and cache.keys[layer] is not None:
                raise ValueError("a cached head forward over several rows needs an explicit "
                                 "mask (is_causal would align it to the cache's first row)")
            k, v = cache.update(layer, k, v)                                        # [B, kv, T+n, d]
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             is_causal=mask is None and n > 1)
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, self.heads * self.dim))


class HeadMLP(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HeadLayer(nn.Module):
    """A Llama decoder layer; EAGLE's first layer has no input norm (its input is fc's output)."""

    def __init__(self, cfg: HeadConfig, index: int) -> None:
        super().__init__()
        self.index = index
        if index > 0:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = HeadAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = HeadMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: HeadCache | None) -> torch.Tensor:
        normed = self.input_layernorm(x) if self.index > 0 else x
        x = x + self.self_attn(normed, cos, sin, mask, cache, self.index)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """The head's own weights (fc + decoder layers) and the target's embedding and LM head.

    The target's modules are referenced, never owned: they are not in ``parameters()`` or
    ``state_dict()``, and moving the head does not touch them.
    """

    def __init__(self, cfg: HeadConfig, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList(HeadLayer(cfg, i) for i in range(cfg.num_layers))
        self.shared = (embed_tokens, lm_head)          # a tuple: not registered as submodules
        self._inv_freq: torch.Tensor | None = None     # RoPE frequencies (float32; not a buffer,
                                                       # so dtype casts never touch them)

    def new_cache(self) -> HeadCache:
        return HeadCache(len(self.layers))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache: HeadCache | None = None) -> torch.Tensor:
        """Predicted next features.

        Args:
            features: [B, n, H] target (or predicted) features f_i.
            tokens: [B, n] the tokens one step ahead, t_{i+1}.
            positions: [n] sequence positions i.
            mask: additive float mask [1, 1, n, T+n] over the cache's T rows and these n, or None
                for plain causal attention over these n rows (training, no cache).
            cache: the head's KV cache (extended in place), or None.

        Returns:
            [B, n, H] f̂_{i+1}.
        """
        dtype, cfg = self.fc.weight.dtype, self.config
        embed = self.shared[0]      # may sit on another device than the head (device_map="auto")
        embedded = embed(tokens.to(embed.weight.device)).to(self.fc.weight.device, dtype)
        x = self.fc(torch.cat([embedded, features.to(embedded.device, dtype)], dim=-1))
        # RoPE angles in float32 whatever the head's dtype (bf16 positions would be coarse)
        inv_freq = self._inv_freq
        if inv_freq is None or inv_freq.device != x.device:     # fixed per head: computed once
            inv_freq = cfg.rope_theta ** -(torch.arange(0, cfg.head_dim, 2, device=x.device,
                                                        dtype=torch.float32) / cfg.head_dim)
            self._inv_freq = inv_freq
        angles = (positions.float() / cfg.rope_linear_factor)[:, None] * inv_freq   # [n, d/2]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache)
        return x

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's LM head over (predicted) features: [..., H] -> [..., V]."""
        lm_head = self.shared[1]
        return lm_head(features.to(lm_head.weight.device, lm_head.weight.dtype))


# --------------------------------------------------------------------------------------------
# References, files, checks


RANDOM = re.compile(r"random(?::(\d+))?")


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


def check_fits(cfg: HeadConfig, state: Mapping[str, torch.Tensor] | None, target: nn.Module,
               head_name: str, target_name: str) -> None:
    """Raise ValueError naming both models unless the head's features and vocabulary fit."""
    hidden = int(target.get_input_embeddings().embedding_dim)
    vocab = int(target.get_output_embeddings().weight.shape[0])
    problems = fit_problems(cfg.hidden_size, cfg.vocab_size, hidden, vocab)
    embed = (state or {}).get("embed_tokens.weight")
    if not problems and embed is not None and tuple(embed.shape) != (vocab, hidden):
        problems.append(f"embed_tokens {tuple(embed.shape)} (head) vs {(vocab, hidden)} (target)")
    if problems:
        raise ValueError(f"EAGLE head {head_name!r} does not fit target {target_name!r}: "
                         f"{'; '.join(problems)}. A head is trained for one target model: use the "
                         "head published for this target (or train one: python -m eagle_training)")


def _refuse_eagle3(state: Mapping[str, torch.Tensor], raw: Mapping[str, Any], name: str) -> None:
    if any(k.startswith("midlayer.") for k in state) or "d2t" in state or "draft_vocab_size" in raw:
        raise ValueError(f"EAGLE head {name!r} is an EAGLE-3 head (fused low/mid/high-layer "
                         "features, midlayer.*, draft vocabulary d2t): not supported yet; "
                         "EAGLE-1 and EAGLE-2 heads load")


def target_name(target: nn.Module) -> str:
    return str(getattr(target.config, "name_or_path", "") or type(target).__name__)


def load_head(reference: str, target: nn.Module) -> EagleHead:
    """Resolve a head reference for ``target`` (see the module docstring), checked against it."""
    if reference == "auto":
        reference = default_head(target)
    seed = random_seed(reference)
    if seed is not None:
        return random_head(target, seed)
    config_path, weights_path = head_files(reference)
    raw = json.loads(config_path.read_text())
    # a DataParallel-saved checkpoint prefixes every key with "module."
    state = {key.removeprefix("module."): value for key, value in load_state(weights_path).items()}
    _refuse_eagle3(state, raw, reference)
    cfg = HeadConfig.from_json(raw)
    check_fits(cfg, state, target, reference, target_name(target))
    head = EagleHead(cfg, target.get_input_embeddings(), target.get_output_embeddings())
    own = head_state(state)
    missing, unexpected = head.load_state_dict(own, strict=False)
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


def random_head(target: nn.Module, seed: int = 0) -> EagleHead:
    """A randomly initialised one-layer head sized from the target (seeded; global RNG untouched)."""
    cfg = HeadConfig.for_target(target.config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = EagleHead(cfg, target.get_input_embeddings(), target.get_output_embeddings())
    return place(head, target)


def place(head: EagleHead, target: nn.Module) -> EagleHead:
    weight = target.get_output_embeddings().weight
    return head.to(device=weight.device, dtype=weight.dtype).eval()


def default_head(target: nn.Module) -> str:
    """The shipped head made for this target's architecture, else "random" (with a warning)."""
    raw = target.config.to_dict()
    for name in SHIPPED:
        if not SHIPPED[name].is_dir():
            continue
        made_for = (read_config(name) or {}).get("spectune", {}).get("target_signature", {})
        if made_for and all(raw.get(k) == v for k, v in made_for.items()):
            return name
    log.warning("no EAGLE head given and none shipped for target %s: using a random head "
                "(acceptance near zero); pass head=<hub id or head directory>", target_name(target))
    return "random"


def save_head(head: EagleHead, folder: Path, dtype: torch.dtype = torch.float16,
              extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the published layout; returns the folder."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = {**head.config.to_json(), "torch_dtype": str(dtype).removeprefix("torch.")}
    if extra:
        raw["spectune"] = dict(extra)
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
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


def parameter_count(head: EagleHead) -> int:
    return sum(p.numel() for p in head.parameters())


__all__ = ["EagleHead", "HeadCache", "HeadConfig", "SHIPPED", "check_fits", "fit_problems", "head_identity", "head_source",
           "load_head", "place", "random_head", "random_seed", "read_config", "save_head"]
