"""Output quality of a trial against vanilla on the same prompts, and the search's quality bound.

Scored after the timed window (and outside the energy window), for every trial of a lossy method
(``lossless: false`` in its YAML) and whenever an objective needs it:
  * perplexity, the MJSD paper's measure (§2.1 eq. 1, the authors' ``get_score``): per output the
    mean log p(x_t | prompt, x_<t) under the *unwarped* target (one forward over prompt + output),
    then PPL = exp(−mean over outputs); ``perplexity_ratio`` = the method's / vanilla's;
  * the task's metrics for the method and for vanilla on the same prompts; ``quality_drop`` is
    vanilla's minus the method's on the task's first metric (accuracy, pass@1, rouge1, bleu).
At temperature > 0 vanilla is one sampled output per prompt (fixed seed, so the same in every
trial): with few prompts both numbers are noisy.

The bound (``search.max_quality_drop``, ``search.max_perplexity_ratio``; null = none) becomes one
Optuna constraint per bound, measured − bound, feasible when ≤ 0 (Optuna's convention), set with
``Trial.set_constraint``: TPE (c-TPE), NSGA-II (constrained domination), GP and
``Study.best_trials`` honour it. Lossless methods satisfy it by construction (value 0): their
outputs follow vanilla's law (and equal vanilla's tokens at temperature 0, checked per trial), so
any measured difference is sampling noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch


def mean_log_prob(model: Any, prompt_ids: Sequence[int], tokens: Sequence[int]) -> float:
    """Mean log p(token_t | prompt, tokens_<t) under ``model``'s unwarped distribution.

    Args:
        prompt_ids: [L] the prompt the tokens were generated after.
        tokens: [n ≥ 1] the generated tokens.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(tokens)], device=device)
    with torch.inference_mode():
        logits = model(ids, logits_to_keep=len(tokens) + 1).logits[0, :-1]       # [n, V]
    index = torch.tensor(list(tokens), device=device)[:, None]
    return float(torch.log_softmax(logits.float(), dim=-1).gather(1, index).mean())


def perplexity(mean_log_probs: Sequence[float]) -> float:
    """exp(−mean over outputs of each output's mean log-probability)."""
    return math.exp(-sum(mean_log_probs) / len(mean_log_probs))


def compare(method_quality: Mapping[str, float], vanilla_quality: Mapping[str, float],
            method_log_probs: Sequence[float] | None,
            vanilla_log_probs: Sequence[float] | None) -> dict[str, float]:
    """Quality of the method next to vanilla's on the same prompts (keys as in the module doc)."""
    out = {f"quality_{k}": float(v) for k, v in method_quality.items()}
    out.update({f"vanilla_quality_{k}": float(v) for k, v in vanilla_quality.items()})
    if method_quality and vanilla_quality:
        primary = next(iter(method_quality))
        out["quality_drop"] = float(vanilla_quality[primary] - method_quality[primary])
    if method_log_probs and vanilla_log_probs:
        out["perplexity"] = perplexity(method_log_probs)
        out["vanilla_perplexity"] = perplexity(vanilla_log_probs)
        out["perplexity_ratio"] = out["perplexity"] / out["vanilla_perplexity"]
    return out


@dataclass(frozen=True)
class QualityBound:
    """The search's quality constraint (None: no bound on that measure)."""

    max_quality_drop: float | None = None
    max_perplexity_ratio: float | None = None

    @classmethod
    def from_search(cls, search: Mapping[str, Any]) -> QualityBound:
        return cls(search.get("max_quality_drop"), search.get("max_perplexity_ratio"))

    @property
    def active(self) -> bool:
        return self.max_quality_drop is not None or self.max_perplexity_ratio is not None

    def bounds(self) -> dict[str, float]:
        return {key: float(value) for key, value in (("quality_drop", self.max_quality_drop),
                                                     ("perplexity_ratio",
                                                      self.max_perplexity_ratio))
                if value is not None}

    def constraints(self, record: Mapping[str, float], lossless: bool) -> dict[str, float]:
        """Optuna constraint values (feasible ≤ 0): measured − bound; 0 for a lossless method."""
        return {key: 0.0 if lossless else float(record[key]) - bound
                for key, bound in self.bounds().items()}

    def describe(self) -> str:
        parts = [f"{key} <= {bound:g}" for key, bound in self.bounds().items()]
        return ", ".join(parts) if parts else "none"


def feasible(constraints: Mapping[str, float]) -> bool:
    return all(value <= 0.0 for value in constraints.values())
