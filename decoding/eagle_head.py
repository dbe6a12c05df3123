"""EAGLE draft heads (the EAGLE-1 / EAGLE-2 format): the network and its configuration.

An EAGLE head (Li et al. 2024) autoregresses on the target's *features*: the last hidden states,
after the final norm (what the target's LM head reads; EAGLE's "second-to-top layer"). At sequence
position i its input is the feature f_i and the embedding of the token one step ahead, t_{i+1}
("feature & shifted token"); its output predicts f_{i+1}, which the target's own LM head turns into
the distribution of t_{i+2}. The network:

    x = fc(cat(embed(t_{i+1}), f_i))          # Linear 2H -> H (embedding first, as published)
    x = decoder layer(s)(x)                   # Llama-style; layer 0 has no input norm
    f̂_{i+1} = x                               # no final norm; embed and LM head are the target's

``HeadConfig`` is the network's shape, read from and written to the published ``config.json``.
The weights' files, references (shipped, local, hub, random), checks and identity live in
``decoding.eagle_weights``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn


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
        return cls(**llama_shape(raw, "EAGLE head"),
                   num_layers=int(raw.get("num_hidden_layers", 1)),
                   fc_bias=bool(raw.get("bias", True)))

    @classmethod
    def for_target(cls, config: Any, num_layers: int = 1) -> HeadConfig:
        """A one-layer head shaped like the target's decoder layers (a transformers config)."""
        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        return cls.from_json({**raw, "num_hidden_layers": num_layers, "bias": True,
                              "qkv_bias": False})

    def to_json(self) -> dict[str, Any]:
        """The published ``config.json`` (a LlamaConfig EAGLE's own loader reads too)."""
        return {"architectures": ["LlamaForCausalLM"], **llama_json(self),
                "num_hidden_layers": self.num_layers, "bias": self.fc_bias}


def llama_shape(raw: Mapping[str, Any], label: str) -> dict[str, Any]:
    """The Llama-layer fields every head config shares, from a published ``config.json``;
    ``label`` names the head kind in the one-line refusal of an unsupported activation."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{label} hidden_act={raw.get('hidden_act')!r} is not supported "
                         "(allowed: silu)")
    heads = int(raw["num_attention_heads"])
    theta, factor = _rope(raw)
    return {"hidden_size": int(raw["hidden_size"]),
            "intermediate_size": int(raw["intermediate_size"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(raw.get("num_key_value_heads") or heads),
            "head_dim": int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            "vocab_size": int(raw["vocab_size"]),
            "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)), "rope_theta": theta,
            "rope_linear_factor": factor, "qkv_bias": bool(raw.get("qkv_bias", False))}


def llama_json(cfg: Any) -> dict[str, Any]:
    """``llama_shape``'s fields of ``cfg`` (a head config) under their published keys."""
    raw = {"model_type": "llama", "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.intermediate_size,
           "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
           "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
           "rope_theta": cfg.rope_theta, "hidden_act": cfg.hidden_act, "qkv_bias": cfg.qkv_bias,
           "max_position_embeddings": 8192, "tie_word_embeddings": False}
    if cfg.rope_linear_factor != 1.0:
        raw["rope_scaling"] = {"type": "linear", "factor": cfg.rope_linear_factor}
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
    """Llama attention over the head's KV cache; ``input_size`` is EAGLE-3's 2H (embedding and
    feature side by side), the hidden size otherwise."""

    def __init__(self, cfg: Any, input_size: int | None = None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                               cfg.head_dim)
        h = cfg.hidden_size
        inputs = input_size or h
        self.q_proj = nn.Linear(inputs, self.heads * self.dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(inputs, self.kv_heads * self.dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(inputs, self.kv_heads * self.dim, bias=cfg.qkv_bias)
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
    def __init__(self, cfg: Any) -> None:
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


class Rotary:
    """RoPE tables from ``self.config`` (rope_theta, head_dim, rope_linear_factor), the inverse
    frequencies computed once per device (float32; not a buffer, so dtype casts never touch
    them). Shared by the EAGLE-1/2 and EAGLE-3 heads."""

    _inv_freq: torch.Tensor | None = None

    def rotary(self, positions: torch.Tensor, device: torch.device, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (cos, sin) [n, d] at ``positions`` [n]; angles in float32 whatever the head's
        dtype (bf16 positions would be coarse)."""
        cfg, inv_freq = self.config, self._inv_freq
        if inv_freq is None or inv_freq.device != device:     # fixed per head: computed once
            inv_freq = cfg.rope_theta ** -(torch.arange(0, cfg.head_dim, 2, device=device,
                                                        dtype=torch.float32) / cfg.head_dim)
            self._inv_freq = inv_freq
        angles = (positions.to(device).float() / cfg.rope_linear_factor)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)                                  # [n, d]
        return angles.cos().to(dtype), angles.sin().to(dtype)


class EagleHead(Rotary, nn.Module):
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
        dtype = self.fc.weight.dtype
        embed = self.shared[0]      # may sit on another device than the head (device_map="auto")
        embedded = embed(tokens.to(embed.weight.device)).to(self.fc.weight.device, dtype)
        x = self.fc(torch.cat([embedded, features.to(embedded.device, dtype)], dim=-1))
        cos, sin = self.rotary(positions, x.device, dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache)
        return x

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's input features from the target's states: EAGLE-1/2 read the last layer's
        states as they are ([..., H])."""
        return hidden

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's LM head over (predicted) features: [..., H] -> [..., V]."""
        lm_head = self.shared[1]
        return lm_head(features.to(lm_head.weight.device, lm_head.weight.dtype))


def parameter_count(head: EagleHead) -> int:
    return sum(p.numel() for p in head.parameters())
