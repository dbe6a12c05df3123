"""Records and interfaces shared by every decoding method.

Vocabulary (vLLM's, used everywhere in this project):
  * *drafted*: draft tokens proposed for one target forward (γ_eff of that step);
  * *accepted*: the leading draft tokens the verifier kept;
  * *recovered*: the token drawn from the residual distribution after a rejection;
  * *bonus*: the token drawn from the target's last row when every draft token was accepted.
One step (= one target forward) commits accepted + 1 tokens (the recovered or bonus token), before
truncation at EOS or ``max_new_tokens``.

Data flows one way: a ``Drafter`` proposes a ``Draft``; the target scores it; a verify function (pure,
``decoding.verify``) turns probabilities into a ``Verdict``; the method yields a ``Step``.
Methods whose drafting is fused into the verification forward (lookahead, Ouroboros) need not use
the Drafter seam; they only have to yield ``Step``s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping, Protocol

if TYPE_CHECKING:
    import torch

    from decoding.clock import PhaseClock


@dataclass(frozen=True)
class Step:
    """What one target forward committed."""

    tokens: tuple[int, ...]   # [≤ drafted + 1] committed token ids (after EOS/length truncation)
    drafted: int              # draft tokens verified in this forward (0 for vanilla)
    accepted: int             # leading draft tokens accepted (≤ drafted)
    draft_forwards: int = 0   # draft-model forwards spent proposing this step's draft
    extras: Mapping[str, float] | None = None   # method-specific counters (summed per generation)


@dataclass(frozen=True)
class Draft:
    """Proposed continuation: new tokens only.

    ``probs`` None means each token is a point mass (greedy or n-gram drafts): requirement R2 of
    notes/verification.md — q must be the distribution the token was actually drawn from.
    ``parents`` None means a chain; a token tree gives each node's parent index (-1 = the root, i.e.
    the last committed token), nodes in creation order (parents before children).
    """

    tokens: torch.Tensor                  # [n] int64
    probs: torch.Tensor | None = None     # [n, V] float32 draft distributions, or None
    parents: torch.Tensor | None = None   # [n] int64 parent index per node, or None (chain)
    forwards: int = 0                     # draft-model forwards spent

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying a chain draft: keep ``tokens[:accepted]`` then emit ``next_token``."""

    accepted: int     # τ (block) / n (token): number of leading draft tokens accepted
    next_token: int   # recovered (after a rejection) or bonus (all accepted) token id


class Drafter(Protocol):
    """Proposes drafts for a target model; owns (and rolls back) its own state."""

    def reset(self) -> None:
        """Forget everything about the previous sequence (called once per generation)."""

    def propose(self, context: torch.Tensor, num_tokens: int,
                generator: torch.Generator | None) -> Draft:
        """Propose up to ``num_tokens`` tokens continuing ``context`` ([L] committed ids)."""

    def commit(self, num_valid: int) -> None:
        """The first ``num_valid`` tokens of the last context + draft are now committed."""


class Method(Protocol):
    """A decoding method: the only thing the tuner sees."""

    name: str

    def stream(self, prompt_ids: torch.Tensor, max_new_tokens: int,
               clock: PhaseClock | None = None) -> Iterator[Step]:
        """Yield one ``Step`` per target forward until EOS or ``max_new_tokens``.

        Args:
            prompt_ids: [L] int64 prompt token ids.
            max_new_tokens: exact cap on generated tokens (≥ 1).
            clock: optional phase timer ("draft", "verify"); no device sync is added per step.
        """
