"""Train an EAGLE head for a target on this CPU, from the text the repo ships; write it loadable.

    python -m eagle_training                         # SmolLM2-135M, 24 min + eval, -> decoding/heads/
    python -m eagle_training --minutes 5 --out /tmp/head
    python -m eagle_training --models tiny --steps 20 --out /tmp/tiny-head     (a smoke run)
    python -m eagle_training --version 3 --minutes 60   # an EAGLE-3 head (eagle_training.eagle3)

Recipe (EAGLE paper §3.2, scaled down to a CPU and a time budget):
  1. data (``eagle_training.data``): every task's records except its held-out slice, as chats with the
     reference answer; the last ``max_len`` tokens of each;
  2. features: one target forward per sequence (no grad) within ``extract_fraction`` of the budget,
     keeping the target's features f (post-norm last hidden states, fp16) and its top-``topk``
     next-token distribution at every position;
  3. training until the budget (or ``--steps``) is spent: AdamW, betas (0.9, 0.95), grad clip 0.5,
     lr warm-up then cosine decay over the time budget; loss = SmoothL1(f̂_{i+1}, f_{i+1})
     + w_cls · cross-entropy(target top-k distribution, head distribution), w_cls = 0.1; inputs
     f_i + U(−0.1, 0.1) noise (against error accumulation when the head reads its own outputs).
     The classification loss normalises over the sub-vocabulary of every token that appears in a
     target top-k on the corpus (a CPU saving: the 49k-row LM head is the costly part);
  4. the checkpoint: ``config.json`` + ``model.safetensors`` (fp16) in the published EAGLE layout
     (``decoding.eagle_weights``), the recipe and results under ``spectune`` in the config, and a
     README.md; then the held-out top-1 agreement (EAGLE's 0-α: teacher-forced features) on the
     bench's held-out GSM8K and CNN/DM prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from decoding.eagle_head import EagleHead, HeadConfig, parameter_count
from decoding.eagle_weights import save_head
from eagle_training import eagle3
from eagle_training.features import Example, extract

SHIPPED_NAMES = {("smollm2", 2): "smollm2-135m-instruct",
                 ("smollm2", 3): "smollm2-135m-instruct-eagle3"}
SIGNATURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size",
                  "intermediate_size")


@dataclass(frozen=True)
class TrainSettings:
    minutes: float = 24.0            # extraction + training (then ~2 min of held-out evaluation)
    extract_fraction: float = 0.35   # share of the budget for target forwards
    steps: int | None = None         # stop after this many optimizer steps instead (smoke runs)
    max_len: int = 384               # tokens kept per sequence (the last ones)
    tokens_per_step: int = 512       # sequences accumulated per optimizer step
    lr: float = 1e-3
    warmup: float = 0.03             # share of the schedule spent warming up
    cls_weight: float = 0.1          # w_cls
    noise: float = 0.1               # U(−noise, noise) added to input features
    topk: int = 20                   # target next-token distribution kept per position
    grad_clip: float = 0.5
    seed: int = 0
    version: int = 2                 # 2: EAGLE-1/2 head; 3: EAGLE-3 (eagle_training.eagle3)
    ttt_steps: int = 4               # EAGLE-3: training-time test unroll (the authors: 7)
    ttt_decay: float = 0.8           # EAGLE-3: step k's loss weight is decay^k
    draft_vocab: int = 8192          # EAGLE-3: draft vocabulary size (capped at the target's)


# --------------------------------------------------------------------------------------------
# 3. Training


def example_loss(head: EagleHead, example: Example, weight: torch.Tensor, remap: torch.Tensor,
                 settings: TrainSettings, generator: torch.Generator
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss on one sequence: inputs (f_i + noise, t_{i+1}) predict f_{i+1}.

    ``weight`` [S, H]: the LM head rows of the sub-vocabulary; ``remap`` [V]: id -> row.
    """
    dtype, device = head.fc.weight.dtype, head.fc.weight.device
    features = example.features.to(device, dtype)                                  # [T, H]
    noise = (torch.rand(features[:-1].shape, generator=generator) * 2 - 1) * settings.noise
    inputs = features[:-1] + noise.to(device, dtype)
    positions = torch.arange(features.shape[0] - 1, device=device)
    predicted = head(inputs[None], example.tokens[1:].to(device)[None], positions)[0]  # [T−1, H]
    regression = F.smooth_l1_loss(predicted, features[1:])
    log_q = torch.log_softmax(predicted @ weight.T, dim=-1)                         # [T−1, S]
    ids = remap[example.top_ids[1:].to(device)]                                     # [T−1, k]
    probs = example.top_probs[1:].to(device).float()
    probs = probs / probs.sum(-1, keepdim=True)
    classification = -(probs * log_q.gather(1, ids)).sum(-1).mean()
    loss = regression + settings.cls_weight * classification
    accuracy = (log_q.argmax(-1) == ids[:, 0]).float().mean()
    return loss, {"loss": loss.item(), "reg": regression.item(), "cls": classification.item(),
                  "acc": accuracy.item(), "tokens": float(positions.shape[0])}


def schedule(progress: float, warmup: float) -> float:
    """lr factor: linear warm-up, then cosine decay to 10 %."""
    if progress < warmup:
        return max(progress / warmup, 0.01)
    done = min((progress - warmup) / max(1 - warmup, 1e-9), 1.0)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))


def train(target: torch.nn.Module, examples: list[Example], settings: TrainSettings,
          deadline: float) -> tuple[EagleHead, list[dict[str, float]]]:
    """Train a fresh head until ``deadline`` or ``settings.steps``; returns it and per-step logs."""
    cfg = HeadConfig.for_target(target.config)
    generator = torch.Generator().manual_seed(settings.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        head = EagleHead(cfg, target.get_input_embeddings(), target.get_output_embeddings())
    target.requires_grad_(False)                    # shared embedding / LM head stay frozen
    device = head.fc.weight.device
    subset = torch.unique(torch.cat([e.top_ids.flatten() for e in examples])).to(device)  # [S]
    weight = head.shared[1].weight[subset].to(head.fc.weight.dtype)                    # [S, H]
    remap = torch.full((cfg.vocab_size,), -1, dtype=torch.long, device=device)
    remap[subset] = torch.arange(subset.shape[0], device=device)
    print(f"classification sub-vocabulary: {subset.shape[0]} of {cfg.vocab_size} tokens",
          flush=True)
    history = optimise(head, examples, lambda e: example_loss(head, e, weight, remap, settings,
                                                              generator),
                       settings, deadline, generator)
    return head.eval(), history


def optimise(head: torch.nn.Module, examples: list, loss_of, settings: Any, deadline: float,
             generator: torch.Generator) -> list[dict[str, float]]:
    """The training loop both head versions share: AdamW (0.9, 0.95), sequences accumulated to
    ``tokens_per_step`` tokens per step, grad clip, warm-up + cosine lr over the time budget (or
    ``settings.steps``), a progress bar; ``loss_of(example)`` -> (loss, logs with "tokens")."""
    head.train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    start, history, step, order = time.perf_counter(), [], 0, []
    total = settings.steps or max(deadline - start, 1.0)
    bar = tqdm(total=settings.steps or int(total), desc="training head", mininterval=5,
               unit="step" if settings.steps else "s")
    while (step < settings.steps) if settings.steps else (time.perf_counter() < deadline):
        progress = step / total if settings.steps else (time.perf_counter() - start) / total
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * schedule(progress, settings.warmup)
        logs, tokens = [], 0
        while tokens < settings.tokens_per_step:
            if not order:
                order = torch.randperm(len(examples), generator=generator).tolist()
            loss, log = loss_of(examples[order.pop()])
            (loss * log["tokens"] / settings.tokens_per_step).backward()
            logs.append(log)
            tokens += int(log["tokens"])
        torch.nn.utils.clip_grad_norm_(head.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        merged = {k: sum(g[k] * g["tokens"] for g in logs) / tokens for k in logs[0]}
        merged["tokens"] = float(tokens)
        history.append({**merged, "step": step, "seconds": time.perf_counter() - start})
        bar.set_postfix(loss=f"{merged['loss']:.3f}", acc=f"{merged['acc']:.2f}")
        bar.update(1 if settings.steps else int(time.perf_counter() - start) - bar.n)
    bar.close()
    return history


@torch.inference_mode()
def top1_agreement(head: EagleHead, examples: list[Example]) -> float:
    """Teacher-forced top-1 agreement with the target over the full vocabulary (EAGLE's 0-α)."""
    hits = total = 0
    dtype, device = head.fc.weight.dtype, head.fc.weight.device
    for e in examples:
        positions = torch.arange(e.features.shape[0] - 1, device=device)
        predicted = head(e.features[:-1][None].to(device, dtype), e.tokens[1:][None].to(device),
                         positions)[0]
        hits += int((head.logits(predicted).argmax(-1).cpu() == e.top_ids[1:, 0]).sum())
        total += int(positions.shape[0])
    return hits / max(total, 1)


# --------------------------------------------------------------------------------------------
# 4. CLI


def load_target(models: str) -> tuple[torch.nn.Module, Any, str]:
    from decoding.models import load_pair
    from decoding.tokenizers import ByteTokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pair = load_pair(models, {"kind": "none"})
    return pair.target, pair.tokenizer or ByteTokenizer(), pair.target_name


def write_readme(folder: Path, record: dict[str, Any]) -> None:
    r = record
    three = r["settings"]["version"] == 3
    if three:
        kind = (f"An EAGLE-3 draft head ({r['parameters']:,} parameters, fp16 safetensors; "
                f"draft vocabulary {r['draft_vocab_size']} tokens covering "
                f"{r['draft_vocab_coverage']:.1%} of the target's top-1 predictions on the "
                "training text) in the published EAGLE-3 layout, for `method=eagle3` or "
                "`method=eagle` (`decoding.eagle3`).")
        losses = (f"* loss {r['first_loss']:.3f} → {r['final_loss']:.3f} (Σ 0.8^k CE over "
                  f"{r['settings']['ttt_steps']} TTT steps); train top-1 per step "
                  f"{r['final_step_acc']}")
        recipe = ("Recipe: EAGLE-3 (Li et al. 2025) scaled to a CPU — target states entering "
                  "layers 2, L//2, L−3 fused by fc, training-time test unrolled "
                  f"{r['settings']['ttt_steps']} steps with loss weights 0.8^k, cross-entropy to "
                  "the target's top-20 distribution restricted to the draft vocabulary, LM head "
                  "and norm started from the target's; AdamW (0.9, 0.95), grad clip 0.5, "
                  "warm-up + cosine decay over the time budget; see `eagle_training/eagle3.py`.")
    else:
        kind = (f"A one-layer EAGLE-1/2 draft head ({r['parameters']:,} parameters, fp16 "
                "safetensors) in the published layout (`config.json` + `model.safetensors`), "
                "for `method=eagle` (`decoding.eagle`).")
        losses = (f"* loss {r['first_loss']:.3f} → {r['final_loss']:.3f} (regression "
                  f"{r['final_reg']:.3f}, classification {r['final_cls']:.3f}); train top-1 "
                  f"{r['final_acc']:.2f}")
        recipe = ("Recipe: EAGLE (Li et al. 2024) §3.2 scaled to a CPU — SmoothL1 feature "
                  "regression + 0.1 × cross-entropy to the target's top-20 distribution (over "
                  "the sub-vocabulary the corpus' top-20 sets cover), U(−0.1, 0.1) feature "
                  "noise, AdamW (0.9, 0.95), grad clip 0.5, warm-up + cosine decay over the time "
                  "budget; see `eagle_training/train.py`.")
    lines = [f"# EAGLE{'-3' if three else ''} head for {r['base_model']}", "",
             f"{kind} Licence: {r['license']}.", "",
             f"Trained by `{' '.join(r['command'])}` on {r['hardware']} "
             f"({r['threads']} threads):", "",
             f"* data: {r['data']}",
             f"* {r['sequences']} sequences, {r['tokens']} tokens of target features "
             f"({r['extract_seconds']:.0f} s); {r['steps']} optimizer steps, "
             f"{r['tokens_seen']} tokens seen ({r['train_seconds']:.0f} s)",
             losses,
             f"* held-out top-1 agreement with the target (teacher-forced, EAGLE's 0-α): "
             f"{r['held_out_top1']:.3f} on {r['held_out_sequences']} held-out GSM8K/CNN-DM chats",
             f"* settings: `{json.dumps(r['settings'])}`", "", recipe, "",
             f"Licence: {r['license']}. The training text is the repo's task data (see "
             "`data/README.md` for each dataset's licence); the held-out slices the bench and the "
             "tuner's confirmation use were excluded.", ""]
    (folder / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2", help="a decoding.models preset")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--minutes", type=float, default=TrainSettings.minutes)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--max-len", type=int, default=TrainSettings.max_len)
    parser.add_argument("--lr", type=float, default=TrainSettings.lr)
    parser.add_argument("--max-sequences", type=int, default=None, help="cap on training chats")
    parser.add_argument("--held-out", type=int, default=8, help="held-out chats per bench task")
    parser.add_argument("--version", type=int, choices=(2, 3), default=2,
                        help="2: an EAGLE-1/2 head; 3: an EAGLE-3 head (training-time test)")
    parser.add_argument("--ttt-steps", type=int, default=TrainSettings.ttt_steps)
    parser.add_argument("--draft-vocab", type=int, default=TrainSettings.draft_vocab)
    args = parser.parse_args(argv)
    from decoding.eagle_weights import HEADS_DIR
    from eagle_training.data import held_out_sequences, training_corpus
    from decoding.hardware import hardware
    shipped = SHIPPED_NAMES.get((args.models, args.version))
    out = args.out or (HEADS_DIR / shipped if shipped
                       else parser.error("--out is required for this --models"))
    if args.ttt_steps < 1 or args.draft_vocab < 2:
        parser.error(f"--ttt-steps={args.ttt_steps} / --draft-vocab={args.draft_vocab}: allowed "
                     "are ≥ 1 / ≥ 2")
    settings = TrainSettings(minutes=args.minutes, steps=args.steps, max_len=args.max_len,
                             lr=args.lr, version=args.version, ttt_steps=args.ttt_steps,
                             draft_vocab=args.draft_vocab)
    began = time.perf_counter()
    budget = settings.minutes * 60
    target, tokenizer, name = load_target(args.models)
    corpus = training_corpus(tokenizer, settings.max_len, settings.seed)
    sequences = corpus.sequences[: args.max_sequences]
    held_text = held_out_sequences(tokenizer, settings.max_len, args.held_out)
    extra: dict[str, Any] = {}
    if settings.version == 3:
        layer_ids = eagle3.default_layer_ids(int(target.config.num_hidden_layers))
        examples = extract(target, sequences, settings.topk,
                           began + settings.extract_fraction * budget, layer_ids, eagle3.MIN_LENGTH)
        extracted = time.perf_counter()
        head, history, extra = eagle3.train(target, examples, settings, began + budget, optimise)
        trained = time.perf_counter()
        held = extract(target, held_text, settings.topk, float("inf"), layer_ids,
                       eagle3.MIN_LENGTH)
        agreement = eagle3.top1_agreement(head, held)
    else:
        examples = extract(target, sequences, settings.topk,
                           began + settings.extract_fraction * budget)
        extracted = time.perf_counter()
        head, history = train(target, examples, settings, began + budget)
        trained = time.perf_counter()
        held = extract(target, held_text, settings.topk, float("inf"))
        agreement = top1_agreement(head, held)
    tail = history[-max(1, len(history) // 20):]
    last = {k: sum(h.get(k, 0.0) for h in tail) / len(tail) for k in ("loss", "reg", "cls", "acc")}
    if settings.version == 3:
        extra["final_step_acc"] = [round(sum(h.get(f"acc{k}", 0.0) for h in tail) / len(tail), 3)
                                   for k in range(settings.ttt_steps)]
    record = {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct" if args.models == "smollm2" else name,
        "license": "Apache-2.0 (as its base model, SmolLM2-135M-Instruct)"
        if args.models == "smollm2" else "that of its base model",
        "target_signature": {k: target.config.to_dict().get(k) for k in SIGNATURE_KEYS},
        "command": ["python -m eagle_training", *(argv if argv is not None else sys.argv[1:])],
        "hardware": hardware(next(target.parameters()).device),
        "data": f"{sum(corpus.counts.values())} task records {corpus.counts} "
                f"(held-out slices excluded; {corpus.dropped} records overlapping held-out "
                "GSM8K/CNN-DM text dropped)",
        "sequences": len(examples), "tokens": sum(int(e.tokens.shape[0]) for e in examples),
        "extract_seconds": extracted - began, "steps": len(history),
        "tokens_seen": int(sum(h["tokens"] for h in history)),
        "train_seconds": trained - extracted, "first_loss": history[0]["loss"],
        "final_loss": last["loss"], "final_reg": last["reg"], "final_cls": last["cls"],
        "final_acc": last["acc"], "held_out_top1": agreement,
        "held_out_sequences": len(held), "parameters": parameter_count(head),
        "threads": torch.get_num_threads(), "settings": asdict(settings), **extra,
    }
    save_head(head, out, torch.float16, extra=record)
    write_readme(out, record)
    (out / "history.json").write_text(json.dumps(history[:: max(1, len(history) // 200)]))
    print(json.dumps({k: v for k, v in record.items() if k != "settings"}, indent=1), flush=True)
    return record


if __name__ == "__main__":
    main()
