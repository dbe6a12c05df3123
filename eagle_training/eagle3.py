"""EAGLE-3's training recipe (Li et al. 2025), scaled to a CPU: ``python -m eagle_training --version 3``.

  1. features: one target forward per sequence (no grad), keeping the states entering the head's
     layers (``decoding.eagle3_head.default_layer_ids``: 2, L//2, L−3) side by side [T, 3·H] (fp16)
     and the target's top-``topk`` next-token distribution at every position;
  2. the draft vocabulary: the ``draft_vocab`` target ids that occur most often as the training
     text's tokens or the target's top-1 predictions on it (the authors count the training data's
     tokens; 32k of Llama-3's 128k), written as ``d2t``/``t2d``;
  3. training-time test (TTT): the head is unrolled ``ttt_steps`` steps on every sequence. Step 0
     reads the fused target features g_j and token t_{j+1} and predicts t_{j+2}; step k reads its
     own step-(k−1) output at row j with token t_{j+k+1}, sits at position j+k and predicts
     t_{j+k+2}. A step-k query attends to the step-0 keys of rows ≤ j (the committed prefix) and to
     its own row's keys of steps 1..k (its draft ancestors): exactly what a depth-k tree node sees
     at inference (``decoding.eagle.EagleSource``). Loss: Σ_k 0.8^k · cross-entropy(target's
     distribution restricted to the draft vocabulary and renormalised, head's distribution) over
     the rows whose target top-1 lies in the draft vocabulary; no feature regression;
  4. CPU-budget choices (the authors train 40 epochs on 68k ShareGPT chats on GPUs): the head's
     ``lm_head`` starts from the target's LM-head rows of the draft vocabulary and its ``norm``
     from the target's final norm, so the minutes go to ``fc`` and the layer; ``ttt_steps``
     defaults to 4, the default tree depth (the authors unroll 7).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from decoding.eagle3_head import Eagle3Config, Eagle3Head, default_layer_ids
from decoding.eagle_head import rotate_half
from eagle_training.features import Example

MIN_LENGTH = 4     # tokens a training sequence needs (``features.extract``'s ``min_length``)


def draft_vocabulary(examples: list[Example], size: int, vocab: int) -> tuple[torch.Tensor,
                                                                                float]:
    """The ``size`` most frequent ids among the text's tokens and the target's top-1 predictions
    (ascending), and the share of top-1 predictions they cover."""
    counts = torch.zeros(vocab, dtype=torch.long)
    top1 = torch.cat([e.top_ids[:, 0] for e in examples])
    for ids in (torch.cat([e.tokens for e in examples]), top1):
        counts += torch.bincount(ids, minlength=vocab)
    size = min(size, vocab)
    chosen = torch.topk(counts, size).indices.sort().values
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[chosen] = True
    return chosen, float(inside[top1].float().mean())


def new_head(target: torch.nn.Module, vocabulary: torch.Tensor, seed: int) -> Eagle3Head:
    """A fresh EAGLE-3 head over ``vocabulary`` (target ids), its LM head and norm started from
    the target's (module docstring, item 4)."""
    cfg = Eagle3Config.for_target(target.config, int(vocabulary.shape[0]),
                                  default_layer_ids(int(target.config.num_hidden_layers)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = Eagle3Head(cfg, target.get_input_embeddings())
    head.set_vocabulary(vocabulary)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocabulary])
        norm = getattr(target.get_decoder(), "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            head.norm.weight.copy_(norm.weight)
    return head.to(target.dtype)


def unrolled(head: Eagle3Head, example: Example, steps: int) -> list[torch.Tensor]:
    """The head unrolled ``steps`` steps over one sequence (training-time test): [T, H] outputs
    of every step (rows whose input token runs past the text carry padding)."""
    attn, layer = head.midlayer.self_attn, head.midlayer
    dtype, device = head.fc.weight.dtype, head.fc.weight.device
    tokens = example.tokens.to(device)
    length = int(tokens.shape[0])
    x = head.features(example.features.to(device))[None]                        # [1, T, H]
    group, scale = attn.heads // attn.kv_heads, 1.0 / math.sqrt(attn.dim)
    causal = torch.full((length, length), float("-inf"), device=device).triu(1).to(dtype)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outputs = []
    embed = head.shared[0]
    for k in range(steps):
        ahead = torch.cat([tokens[k + 1:], tokens.new_zeros(k + 1)])        # t_{j+k+1}  [T]
        embedded = embed(ahead)[None].to(dtype)
        joined = torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(x)], dim=-1)
        q = attn.q_proj(joined).view(1, length, attn.heads, attn.dim).transpose(1, 2)
        key = attn.k_proj(joined).view(1, length, attn.kv_heads, attn.dim).transpose(1, 2)
        value = attn.v_proj(joined).view(1, length, attn.kv_heads, attn.dim).transpose(1, 2)
        cos, sin = head.rotary(torch.arange(length, device=device) + k, device, dtype)
        q, key = q * cos + rotate_half(q) * sin, key * cos + rotate_half(key) * sin
        keys.append(key.repeat_interleave(group, dim=1))                    # [1, h, T, d]
        values.append(value.repeat_interleave(group, dim=1))
        prefix = q @ keys[0].transpose(-1, -2) * scale + causal              # [1, h, T, T]
        own = [(q * keys[i]).sum(-1, keepdim=True) * scale for i in range(1, k + 1)]
        weights = torch.softmax(torch.cat([prefix, *own], dim=-1).float(), dim=-1).to(dtype)
        mixed = weights[..., :length] @ values[0]                            # [1, h, T, d]
        for i in range(1, k + 1):
            mixed = mixed + weights[..., length + i - 1: length + i] * values[i]
        out = attn.o_proj(mixed.transpose(1, 2).reshape(1, length, attn.heads * attn.dim))
        x = x + out
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        outputs.append(x[0])
    return outputs


def ttt_loss(head: Eagle3Head, example: Example, remap: torch.Tensor, steps: int,
             decay: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Σ_k decay^k · CE(target restricted to the draft vocabulary, head) over valid rows.

    ``remap`` [V]: target id -> draft id, −1 outside the draft vocabulary.
    """
    device = head.fc.weight.device
    length = int(example.tokens.shape[0])
    ids = remap[example.top_ids.to(device)]                                   # [T, k]
    probs = example.top_probs.to(device).float() * (ids >= 0)
    total, logs = 0.0, {}
    for k, out in enumerate(unrolled(head, example, steps)):
        rows = length - 1 - k                   # row j predicts t_{j+k+2}: target row j+k+1
        if rows <= 0:
            break
        target_ids, target_p = ids[k + 1: k + 1 + rows], probs[k + 1: k + 1 + rows]
        valid = (target_ids[:, 0] >= 0) & (target_p.sum(-1) > 0)
        target_p = target_p / target_p.sum(-1, keepdim=True).clamp_min(1e-9)
        log_q = torch.log_softmax(head.draft_logits(out[:rows]).float(), dim=-1)  # [rows, Vd]
        picked = log_q.gather(1, target_ids.clamp_min(0)) * (target_ids >= 0)
        ce = -(target_p * picked).sum(-1)
        loss_k = (ce * valid).sum() / valid.sum().clamp_min(1)
        total = total + decay ** k * loss_k
        hits = ((log_q.argmax(-1) == target_ids[:, 0]) & valid).float().sum()
        logs[f"acc{k}"] = float(hits / valid.sum().clamp_min(1))
        logs[f"loss{k}"] = float(loss_k)
    logs.update(loss=float(total), acc=logs.get("acc0", 0.0), tokens=float(length))
    return total, logs


@torch.inference_mode()
def top1_agreement(head: Eagle3Head, examples: list[Example]) -> float:
    """Teacher-forced top-1 agreement with the target over the full vocabulary (EAGLE's 0-α):
    step 0 on the true features, the head's best draft-vocabulary token mapped to its target id."""
    hits = total = 0
    for e in examples:
        out = unrolled(head, e, 1)[0][:-2]                                       # [T−2, H]
        predicted = head.target_ids[head.draft_logits(out).argmax(-1)]
        hits += int((predicted.cpu() == e.top_ids[1:-1, 0]).sum())
        total += int(out.shape[0])
    return hits / max(total, 1)


def train(target: torch.nn.Module, examples: list[Example], settings: Any, deadline: float,
          optimise) -> tuple[Eagle3Head, list[dict[str, float]], dict[str, Any]]:
    """A fresh EAGLE-3 head trained until ``deadline`` or ``settings.steps`` (``optimise``: the
    shared loop of ``eagle_training.train``); returns it, per-step logs and the vocabulary's
    record."""
    vocab = int(target.config.vocab_size)
    vocabulary, coverage = draft_vocabulary(examples, settings.draft_vocab, vocab)
    print(f"draft vocabulary: {vocabulary.shape[0]} of {vocab} tokens, covering "
          f"{coverage:.1%} of the target's top-1 predictions on the training text", flush=True)
    target.requires_grad_(False)
    head = new_head(target, vocabulary, settings.seed)
    remap = torch.full((vocab,), -1, dtype=torch.long, device=head.fc.weight.device)
    remap[head.target_ids] = torch.arange(vocabulary.shape[0], device=remap.device)
    generator = torch.Generator().manual_seed(settings.seed)
    history = optimise(head, examples, lambda e: ttt_loss(head, e, remap, settings.ttt_steps,
                                                          settings.ttt_decay),
                       settings, deadline, generator)
    return head.eval(), history, {"draft_vocab_size": int(vocabulary.shape[0]),
                                  "draft_vocab_coverage": coverage}
