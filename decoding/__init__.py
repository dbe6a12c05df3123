"""Decoding library: vanilla and speculative decoding loops, verification rules, model loading.

Depends on torch and transformers only (never on the tuner, Optuna, MLflow or Hydra).
"""

from decoding.api import METHODS, Generation, GenerationStats, build_method, encode_prompt, generate
from decoding.base import Draft, Method, Step, Verdict
from decoding.models import PRESETS, ModelPair, load_model, load_pair
from decoding.sampling import SamplingConfig

__all__ = [
    "METHODS", "PRESETS", "Draft", "Generation", "GenerationStats", "Method", "ModelPair",
    "SamplingConfig", "Step", "Verdict", "build_method", "encode_prompt", "generate", "load_model",
    "load_pair",
]
