"""What the heads learn from (recipe step 2, ``eagle_training.train``'s docstring): an ``Example``
per sequence, the target's states and its top-k next-token distribution at every position
(``extract``). Both trainers read it: ``eagle_training.train`` (EAGLE-1/2) and
``eagle_training.eagle3``."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from decoding.runtime import Hidden, hidden_rows


@dataclass(frozen=True)
class Example:
    """One sequence and what the target computed on it."""

    tokens: torch.Tensor      # [T] int64
    features: torch.Tensor    # [T, H] fp16 target features f_i (EAGLE-1/2: the last layer's),
    #                           or [T, k·H] the states entering an EAGLE-3 head's k layers
    top_ids: torch.Tensor     # [T, k] int64 target's most likely next tokens after position i
    top_probs: torch.Tensor   # [T, k] fp16 their probabilities


@torch.inference_mode()
def extract(target: torch.nn.Module, sequences: list[list[int]], topk: int, deadline: float,
            layers: Hidden = True, min_length: int = 3) -> list[Example]:
    """Target states (``layers`` as ``decoding.runtime.hidden_rows``: True the last layer's,
    else those layer ids side by side) and top-k next-token distributions, one forward per
    sequence of at least ``min_length`` tokens, until ``deadline`` (perf_counter)."""
    examples = []
    device = next(target.parameters()).device
    for ids in tqdm(sequences, desc="target states", unit="seq", mininterval=5):
        if time.perf_counter() > deadline:
            break
        if len(ids) < min_length:
            continue
        tokens = torch.tensor(ids, device=device)
        out = target(input_ids=tokens[None], output_hidden_states=True)
        top = torch.topk(torch.softmax(out.logits[0].float(), dim=-1), topk)
        examples.append(Example(tokens.cpu(), hidden_rows(out.hidden_states, layers).half().cpu(),
                                top.indices.cpu(), top.values.half().cpu()))
    return examples
