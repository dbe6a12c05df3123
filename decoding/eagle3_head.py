"""EAGLE-3 draft heads (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"): the network and its configuration.

What changed from EAGLE-1/2 (``decoding.eagle_head``):

  * the head reads the target's states at THREE depths (low, middle, high), not only the last
    layer's: ``layer_ids`` index transformers' ``hidden_states`` tuple (0 = the embeddings, j = the
    input of decoder layer j, L = the last layer's normed output). The authors' code and vLLM/SGLang
    take the inputs of layers 2, L//2 and L−3; a checkpoint may pin its own
    (``eagle_aux_hidden_state_layer_ids``). The states are concatenated ([..., 3·H_t]) and fused by
    ``fc`` (3·H_t → H, no bias) into the head's input feature g_i;
  * its one decoder layer (``midlayer``) reads [norm(embed(t_{i+1})); norm(g_i)] side by side (2·H
    into the attention projections) with g_i as the residual;
  * it predicts tokens, not features: ``lm_head(norm(x))`` over its own draft vocabulary of
    ``draft_vocab_size`` tokens, mapped to target ids by ``d2t`` (target id = draft id +
    d2t[draft id]); ``t2d`` marks which target ids the draft vocabulary holds;
  * from the second draft step on the head is fed its own output x (pre-norm, [H]) in place of g.

Probabilities: ``logits`` scatters the draft logits into the target vocabulary with −inf
elsewhere, so a draft distribution is zero outside the draft vocabulary and verification (which
reads only the target's logits) stays exact: the target can still emit any token.

Weights in the published layout: ``fc.weight``, ``midlayer.{hidden_norm,input_layernorm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``,
``t2d`` (both absent when the draft vocabulary is the target's), often ``embed_tokens.weight`` (a
copy of the target's embedding: shape-checked, the target's own is used).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from decoding.eagle_head import (HeadAttention, HeadCache, HeadMLP, RMSNorm, Rotary, llama_json,
                                 llama_shape)

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The authors' (and vLLM's, SGLang's) choice: the inputs of layers 2, L//2 and L−3. Targets
    shallower than 6 layers (test models) take the embeddings, the middle and the last output."""
    if num_layers >= 6:
        return 2, num_layers // 2, num_layers - 3
    return 0, num_layers // 2, num_layers


@dataclass(frozen=True)
class Eagle3Config:
    """The shape of an EAGLE-3 head; read from / written to the published ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    layer_ids: tuple[int, ...] | None = None     # None: ``default_layer_ids`` of the target
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_linear_factor: float = 1.0
    qkv_bias: bool = False
    hidden_act: str = "silu"

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Eagle3Config:
        shape = llama_shape(raw, "EAGLE-3 head")
        layers = int(raw.get("num_hidden_layers", 1))
        if layers != 1:
            raise ValueError(f"EAGLE-3 head num_hidden_layers={layers} is not supported "
                             "(allowed: 1, the published heads' single midlayer)")
        ids = (raw.get("eagle_aux_hidden_state_layer_ids")
               or (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
        return cls(**shape,
                   draft_vocab_size=int(raw.get("draft_vocab_size") or shape["vocab_size"]),
                   target_hidden_size=int(raw.get("target_hidden_size")
                                          or shape["hidden_size"]),
                   layer_ids=tuple(int(i) for i in ids) if ids else None)

    @classmethod
    def for_target(cls, config: Any, draft_vocab_size: int | None = None,
                   layer_ids: Sequence[int] | None = None) -> Eagle3Config:
        """A head shaped like the target's decoder layers (a transformers config), reading
        ``layer_ids`` (default: ``default_layer_ids``)."""
        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        ids = tuple(layer_ids) if layer_ids else default_layer_ids(int(raw["num_hidden_layers"]))
        return cls.from_json({**raw, "num_hidden_layers": 1, "qkv_bias": False,
                              "draft_vocab_size": draft_vocab_size or raw["vocab_size"],
                              "eagle_aux_hidden_state_layer_ids": list(ids)})

    def to_json(self) -> dict[str, Any]:
        """The published ``config.json`` (what the authors' code, vLLM and SGLang read)."""
        raw = {"architectures": [ARCHITECTURE], **llama_json(self), "num_hidden_layers": 1,
               "draft_vocab_size": self.draft_vocab_size,
               "target_hidden_size": self.target_hidden_size}
        if self.layer_ids is not None:
            raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.layer_ids),
                                   "use_aux_hidden_state": True}
        return raw


class Eagle3Layer(nn.Module):
    """The head's one decoder layer (published name ``midlayer``): attention over
    [input_layernorm(embedding); hidden_norm(feature)] (2·H), the feature as the residual."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = HeadAttention(cfg, input_size=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = HeadMLP(cfg)

    def forward(self, embedded: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None, cache: HeadCache | None
                ) -> torch.Tensor:
        joined = torch.cat([self.input_layernorm(embedded), self.hidden_norm(feature)], dim=-1)
        x = feature + self.self_attn(joined, cos, sin, mask, cache, 0)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(Rotary, nn.Module):
    """The head's own weights (fc, midlayer, norm, lm_head, d2t/t2d) and the target's embedding.

    The target's embedding is referenced, never owned (not in ``parameters()``/``state_dict()``).
    Same calling convention as ``decoding.eagle_head.EagleHead``: ``features`` turns the target's
    states into input features, ``forward`` runs the layer, ``logits`` gives target-vocabulary
    logits.
    """

    version = 3

    def __init__(self, cfg: Eagle3Config, embed_tokens: nn.Module) -> None:
        super().__init__()
        if cfg.layer_ids is None:
            raise ValueError("an EAGLE-3 head needs its target layer ids (Eagle3Config.layer_ids)")
        self.config = cfg
        self.fc = nn.Linear(len(cfg.layer_ids) * cfg.target_hidden_size, cfg.hidden_size,
                            bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        identity = cfg.draft_vocab_size == cfg.vocab_size
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.full((cfg.vocab_size,), identity, dtype=torch.bool))
        # [Vd] the target id of every draft id (arange + d2t), kept in step with d2t: set by
        # ``set_vocabulary`` and after every ``load_state_dict``; not saved (d2t is)
        self.register_buffer("target_ids", torch.arange(cfg.draft_vocab_size), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, _keys: module._map_vocabulary())
        self.shared = (embed_tokens,)                  # a tuple: not registered as a submodule
        self._inv_freq = None

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(self.config.layer_ids or ())

    def new_cache(self) -> HeadCache:
        return HeadCache(1)

    def _map_vocabulary(self) -> None:
        self.target_ids.copy_(torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t)

    def set_vocabulary(self, target_ids: Sequence[int] | torch.Tensor) -> None:
        """Make the draft vocabulary the ascending target ids given ([Vd]); writes d2t and t2d."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values.to(self.d2t.device)
        if ids.shape != self.d2t.shape or bool((ids[1:] == ids[:-1]).any()):
            raise ValueError(f"a draft vocabulary needs {self.d2t.shape[0]} distinct target ids")
        self.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True
        self._map_vocabulary()

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """Fuse the target's concatenated states [..., k·H_t] into input features [..., H]."""
        return self.fc(hidden.to(self.fc.weight.device, self.fc.weight.dtype))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache: HeadCache | None = None) -> torch.Tensor:
        """The head's outputs x_i (what the next draft step is fed, and what ``logits`` reads).

        Args:
            features: [B, n, H] fused target features g_i (``features``) or the head's own
                outputs of the parent rows.
            tokens: [B, n] the tokens one step ahead, t_{i+1}.
            positions: [n] sequence positions i.
            mask: additive float mask [1, 1, n, T+n], or None for causal attention (no cache).
            cache: the head's KV cache (extended in place), or None.

        Returns:
            [B, n, H] x_i (pre-norm).
        """
        dtype, device = self.fc.weight.dtype, self.fc.weight.device
        embed = self.shared[0]
        embedded = embed(tokens.to(embed.weight.device)).to(device, dtype)
        cos, sin = self.rotary(positions, device, dtype)
        return self.midlayer(embedded, features.to(device, dtype), cos, sin, mask, cache)

    def draft_logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """[..., H] head outputs -> [..., Vd] logits over the draft vocabulary."""
        return self.lm_head(self.norm(outputs.to(self.lm_head.weight.dtype)))

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] target-vocabulary logits, −inf outside the draft vocabulary."""
        draft = self.draft_logits(outputs)
        if self.config.draft_vocab_size == self.config.vocab_size:
            return draft
        full = draft.new_full(draft.shape[:-1] + (self.config.vocab_size,), float("-inf"))
        return full.index_copy_(-1, self.target_ids, draft)


def parameter_count(head: Eagle3Head) -> int:
    return sum(p.numel() for p in head.parameters())
