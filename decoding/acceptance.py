"""``AcceptanceCounts``: what was drafted and accepted over some target forwards, and the one
definition of every figure read from it.

One record for every counter of speculation in the project: a generation's statistics in our
own loops (``decoding.api.GenerationStats.counts``), a measurement's, a concurrency level's, an
engine server's ``/metrics`` counters and a watch window's. Terms as vLLM's (``decoding.base``):
a *draft* is one verification step that checked drafted tokens, *drafted* the tokens it checked,
*accepted* the drafted tokens the target kept (the bonus or recovered token not included).

Two kinds of step, and every figure names which it divides by:

* a *forward*: every target forward, the prompt's prefill included (``steps``). Tokens per
  forward ``L_fwd = 1 + accepted / steps`` is vLLM's and Spec-Bench's mean acceptance length
  (vanilla scores 1; a short generation reads low by its prefill).
* a *decode step*: a forward after the prefill (``steps - prefills``): what a decode phase pays
  for. Tokens per decode step ``L = 1 + accepted_in_decode / decode_steps`` is what prices a
  decode step (``tuner.predict``) and bounds a decode-phase speedup (``tuner.measure.bounds``).
  ``prefill_accepted``: tokens accepted in a forward that was also the prefill (our loops verify
  their first draft together with the prompt); engines count none there.

With no step counted every length is 1.0 (nothing was accepted) and every rate 0.0.
Per position i (from 0): ``c_i`` steps accepted position i; the acceptance there is
``c_i / drafted_per_position[i]`` (of the tokens drafted there; ``drafts`` where the engine does
not count them, exact where every draft had full length) and ``p_i = c_i / decode_steps`` is the
chance a decode step accepts it (``Σ p_i = L − 1``). The variance of the accepted count X per
step (or per draft) comes from the same counts, since ``P(X > i) = p_i``:
``Var X = Σ (2i + 1) p_i − (Σ p_i)²``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class AcceptanceCounts:
    """Counts of speculation over some forwards (see the module docstring)."""

    steps: int = 0                          # target forwards, the prefills included
    prefills: int = 0                       # of them, prefills (one per request counted)
    drafts: int = 0                         # verification steps that checked a draft (D)
    drafted: int = 0                        # drafted tokens checked (T)
    accepted: int = 0                       # drafted tokens kept (A)
    accepted_per_position: tuple[int, ...] = ()   # [k] c_i: steps that accepted position i
    drafted_per_position: tuple[int, ...] = ()    # [k] tokens drafted at position i (empty:
    #                                                 not counted; ``drafts`` stands in)
    prefill_accepted: int = 0               # accepted in forwards that were also a prefill

    # -- steps -----------------------------------------------------------------------------------

    @property
    def decode_steps(self) -> int:
        """Forwards after the prefill."""
        return max(self.steps - self.prefills, 0)

    @property
    def tokens_per_forward(self) -> float:
        """``1 + accepted / steps``: tokens per target forward, the prefill counted as one
        (vLLM's and Spec-Bench's mean acceptance length; 1.0 without a step)."""
        return 1.0 + self.accepted / self.steps if self.steps else 1.0

    @property
    def tokens_per_decode_step(self) -> float:
        """``1 + accepted in the decode phase / decode steps`` (1.0 without a decode step): the
        most a decode phase can gain over one token per forward."""
        steps = self.decode_steps
        return 1.0 + (self.accepted - self.prefill_accepted) / steps if steps else 1.0

    @property
    def drafted_per_decode_step(self) -> float:
        """Drafted tokens per decode step (0.0 without one): the rows a step verifies, minus 1."""
        return self.drafted / self.decode_steps if self.decode_steps else 0.0

    # -- drafts ----------------------------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float:
        """``accepted / drafted`` (0.0 without a drafted token)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_draft(self) -> float:
        """``1 + accepted / drafts``: a draft's mean length, its bonus token included (1.0
        without a draft)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    def position_drafted(self, i: int) -> int:
        """Tokens drafted at position ``i`` (``drafts`` where they were not counted)."""
        if self.drafted_per_position:
            return self.drafted_per_position[i] if i < len(self.drafted_per_position) else 0
        return self.drafts

    def position_rates(self) -> tuple[float, ...]:
        """Per position i: ``c_i`` over the tokens drafted there (0.0 where none was)."""
        out = []
        for i, c in enumerate(self.accepted_per_position):
            d = self.position_drafted(i)
            out.append(c / d if d else 0.0)
        return tuple(out)

    def step_fractions(self) -> tuple[float, ...]:
        """``p_i = c_i / decode_steps``: the chance a decode step accepts position i."""
        steps = self.decode_steps
        return tuple(c / steps for c in self.accepted_per_position) if steps else ()

    def draft_fractions(self) -> tuple[float, ...]:
        """``c_i / drafts``: the chance a draft has position i accepted."""
        return tuple(c / self.drafts for c in self.accepted_per_position) if self.drafts else ()

    def step_variance(self) -> float:
        """The variance of the tokens one decode step accepts (module docstring)."""
        return variance_of(self.step_fractions())

    def draft_variance(self) -> float:
        """The variance of the tokens one draft has accepted (module docstring)."""
        return variance_of(self.draft_fractions())

    def full_length(self, k: int) -> bool:
        """Every draft had ``k`` tokens (so per-position acceptance is exact below k)."""
        return self.drafts > 0 and self.drafted == self.drafts * k

    # -- combining -------------------------------------------------------------------------------

    def __add__(self, other: AcceptanceCounts) -> AcceptanceCounts:
        return AcceptanceCounts(
            self.steps + other.steps, self.prefills + other.prefills,
            self.drafts + other.drafts, self.drafted + other.drafted,
            self.accepted + other.accepted,
            add_positions(self.accepted_per_position, other.accepted_per_position),
            self._drafted_positions(other),
            self.prefill_accepted + other.prefill_accepted)

    @property
    def has_positions(self) -> bool:
        """Whether acceptance was counted per position (an engine may count it only at some
        concurrency levels)."""
        return bool(self.accepted_per_position)

    def _drafted_positions(self, other: AcceptanceCounts) -> tuple[int, ...]:
        """The sum's tokens drafted per position, written out: a side that did not count
        positions adds none there (its drafts are not the positions' denominators)."""
        sides = [c for c in (self, other) if c.has_positions]
        if not sides:
            return ()
        width = max(max(len(c.accepted_per_position), len(c.drafted_per_position))
                    for c in sides)
        return tuple(sum(c.position_drafted(i) for c in sides) for i in range(width))

    def minus(self, earlier: AcceptanceCounts) -> AcceptanceCounts:
        """The counts since ``earlier`` (counters read twice); positions ``earlier`` lacks count
        from 0."""
        return AcceptanceCounts(
            self.steps - earlier.steps, self.prefills - earlier.prefills,
            self.drafts - earlier.drafts, self.drafted - earlier.drafted,
            self.accepted - earlier.accepted,
            subtract_positions(self.accepted_per_position, earlier.accepted_per_position),
            subtract_positions(self.drafted_per_position, earlier.drafted_per_position)
            if self.drafted_per_position else (),
            self.prefill_accepted - earlier.prefill_accepted)


def total(counts: Sequence[AcceptanceCounts]) -> AcceptanceCounts:
    """The sum of ``counts`` (empty: all zero)."""
    out = AcceptanceCounts()
    for c in counts:
        out = out + c
    return out


def variance_of(fractions: Sequence[float]) -> float:
    """``Σ (2i + 1) q_i − (Σ q_i)²`` for ``q_i = P(X > i)`` (positions from 0), at least 0."""
    mean = sum(fractions)
    return max(sum((2 * i + 1) * q for i, q in enumerate(fractions)) - mean * mean, 0.0)


def add_positions(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    width = max(len(a), len(b))
    return tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(width))


def subtract_positions(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    return tuple(x - (b[i] if i < len(b) else 0) for i, x in enumerate(a))
