"""Random-weight models of real shapes, for the benches that need no trained weights (or cannot
carry them: a GPU machine gets at most 64 MiB of files, the embedded default model alone is 93 MB).

A shape is a Llama config; the weights are drawn from a seeded generator directly on the device
(``torch.device`` context), so a 7B-shaped bf16 model costs seconds on a GPU and no host memory.
Acceptance on such a model is a property of the construction (random weights, an early-exit draft
of its first layers), not of a trained pair: read per-forward costs, loop overheads and losslessness
from it, never the speed-ups a trained pair would reach.
"""

from __future__ import annotations

import torch
from torch import nn

from decoding.models import ModelPair, early_exit_draft

SHAPES: dict[str, dict] = {
    # Llama-2-7B
    "7b": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32},
    # TinyLlama-1.1B
    "1b": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
           "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4},
    # SmolLM2-135M (the embedded default's shape)
    "135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
             "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3},
    # the test suite's scale: a harness check on a CPU in seconds
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2},
}
DRAFT_FRACTION = 8          # the early-exit draft keeps 1/8 of the layers (at least 1)


def random_model(shape: str, device: str | torch.device, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> nn.Module:
    """A Llama-shaped model with seeded random weights (initializer_range 0.02), built on device."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is unknown: allowed are {sorted(SHAPES)}")
    config = AutoConfig.for_model("llama", bos_token_id=None, pad_token_id=None,
                                  eos_token_id=None, tie_word_embeddings=False,
                                  max_position_embeddings=4096, initializer_range=0.02,
                                  **SHAPES[shape])
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def random_pair(shape: str, device: str | torch.device, dtype: torch.dtype = torch.bfloat16
                ) -> ModelPair:
    """The random target and its early-exit draft (first 1/8 of its layers, LM head shared)."""
    target = random_model(shape, device, dtype)
    layers = max(1, target.config.num_hidden_layers // DRAFT_FRACTION)
    layers = min(layers, target.config.num_hidden_layers - 1)
    return ModelPair(target, early_exit_draft(target, layers), None,
                     f"{shape}-shaped {str(dtype).removeprefix('torch.')} (random weights)",
                     f"early_exit {layers}/{target.config.num_hidden_layers}")


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 1) -> list[list[int]]:
    """Seeded random token-id prompts (a random model has no tokenizer worth using)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=gen).tolist() for _ in range(count)]
