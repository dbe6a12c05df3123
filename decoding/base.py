"""Records and interfaces shared by every decoding method.

Vocabulary (vLLM's, used everywhere in this project):
  * *drafted*: draft tokens proposed for one target forward (γ_eff of that step);
  * *accepted*: the leading draft tokens the verifier kept;
  * *recovered*: the token drawn from the residual distribution after a rejection;
  * *bonus*: the token drawn from the target's last row when every draft token was accepted.
One step (= one target forward) commits accepted + 1 tokens (the recovered or bonus token), before
truncation at EOS or ``max_new_tokens``.

Data flows one way: a ``Drafter`` proposes a ``Draft`` from a ``DraftContext``; the target scores
it in one forward; a verify function (pure, ``decoding.verify``) turns probabilities into a
``Verdict``; the shared loop (``decoding.loop``) shows it to the drafter (``Drafter.observe``,
the only feedback path), commits it and yields a ``Step``. A chain is the
special case ``Draft.parents is None``. Lookahead fuses its Jacobi window into the verification
forward and keeps its own loop (see ``decoding.lookahead``); it still yields ``Step``s.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from decoding.reserved_cache import RESERVE_SLACK
from decoding.runtime import stop_ids
from decoding.sampling import SamplingConfig
from decoding.target_cache import EagerTargetCache

if TYPE_CHECKING:
    import torch
    from torch import nn

    from decoding.clock import PhaseClock
    from decoding.compiled import CompiledTarget
    from decoding.target_cache import TargetCache


@dataclass(frozen=True)
class Step:
    """What one target forward committed."""

    tokens: tuple[int, ...]   # [≤ drafted + 1] committed token ids (after EOS/length truncation)
    drafted: int              # draft tokens verified in this forward (0 for vanilla)
    accepted: int             # leading draft tokens accepted (≤ drafted)
    draft_forwards: int = 0   # draft-model forwards spent proposing this step's draft
    extras: Mapping[str, float] | None = None   # method-specific counters (summed per generation)
    level_sizes: tuple[int, ...] | None = None   # [depth] tree tokens verified at each depth
    #                                                (None: a chain, one token per position)

    @property
    def drafted_per_depth(self) -> tuple[int, ...]:
        return (1,) * self.drafted if self.level_sizes is None else self.level_sizes


@dataclass(frozen=True)
class Draft:
    """Proposed continuation: new tokens only.

    ``probs`` None means each token is a point mass (greedy, top-k or n-gram drafts): requirement R2
    of docs/verification.md — q must be the distribution the token was actually drawn from.
    ``parents`` None means a chain; a token tree gives each node's parent index (-1 = the root, i.e.
    the last committed token), nodes in creation order (parents before children). Sibling nodes
    that are separate draws of the same token (i.i.d. drafts) may repeat: the forward merges them,
    the verifier counts each draw (``decoding.tree``).
    ``without_replacement``: siblings were drawn without replacement from their parent's q (then
    ``probs`` holds that q before any exclusion), so the verifier also updates q (§3.1).
    """

    tokens: torch.Tensor                  # [n] int64
    probs: torch.Tensor | None = None     # [n, V] float32 draft distributions, or None
    parents: torch.Tensor | None = None   # [n] int64 parent index per node, or None (chain)
    forwards: int = 0                     # draft-model forwards spent
    without_replacement: bool = False     # sibling scheme of a tree (ignored for chains)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying a draft (chain or tree): keep the accepted path, then ``next_token``.

    For a chain the path is ``0..accepted−1`` and ``path`` may be left None; a tree gives the node
    indices of the accepted root-to-node path.
    """

    accepted: int                       # τ (block) / n (token) / accepted tree depth
    next_token: int                     # recovered (after a rejection) or bonus token id
    path: tuple[int, ...] | None = None  # [accepted] accepted node indices (None: a chain prefix)

    @property
    def nodes(self) -> tuple[int, ...]:
        return self.path if self.path is not None else tuple(range(self.accepted))


@dataclass(frozen=True)
class DraftContext:
    """Everything a drafter may read, in one object (new drafters need no new arguments)."""

    ids: torch.Tensor                    # [L] committed token ids (prompt + generated)
    budget: int                          # most tokens a draft path may hold (≥ 1)
    generator: torch.Generator | None    # the generation's only source of randomness
    verdict: Verdict | None = None       # the last verdict (None on the first step)
    hidden: torch.Tensor | None = None   # [m, H] target last-layer states (what its LM head
    #   reads) of the m rows the target fed in its last forward and kept: committed positions
    #   L−1−m .. L−2 (L = len(ids)); only when the drafter sets ``needs_hidden``; [m, k·H] of
    #   the layers it names in ``hidden_layers`` when it sets those


class Drafter:
    """Proposes drafts for a target model; owns (and rolls back) its own state.

    One required method, ``propose``; the others are hooks with no-op defaults. Capabilities are
    class attributes the loop reads directly:
      * ``needs_hidden``: the loop passes the target's hidden states in ``DraftContext.hidden``
        (feature-level drafters such as EAGLE heads); such a drafter is first asked after the
        target's first forward (the prompt's prefill).
    """

    needs_hidden: ClassVar[bool] = False
    # which target states ``DraftContext.hidden`` holds: None = the last layer's [m, H]; layer ids
    # (entries of transformers' ``hidden_states``: j = the input of layer j) = those side by side
    # [m, k·H] (EAGLE-3 heads; set per instance, since it depends on the head)
    hidden_layers: tuple[int, ...] | None = None

    def reset(self) -> None:
        """Forget everything about the previous sequence (called once per generation)."""

    def propose(self, context: DraftContext) -> Draft:
        """Propose a chain or tree whose paths hold at most ``context.budget`` tokens."""
        raise NotImplementedError(f"{type(self).__name__} does not implement propose()")

    def observe(self, draft: Draft, verdict: Verdict, logits: torch.Tensor
                ) -> dict[str, float] | None:
        """Feedback after verification: the only way a drafter sees how its draft fared.

        Args:
            draft: the draft just verified (empty when the step had no budget for one).
            verdict: its verdict.
            logits: the target's rows the verdict came from: [γ+1, V] for a chain, [S+1, V]
                by forward slot for a tree (row 0 after the last committed token, row s+1
                after slot s; ``decoding.tree.merge_duplicates``).

        Returns:
            The step's method-specific counters (``Step.extras``), or None.
        """
        return None

    def commit(self, num_valid: int) -> None:
        """The first ``num_valid`` tokens of the last context + accepted path are committed."""


class DecodingMethod:
    """Shared constructor arguments of every method: sampling, seed and stop ids.

    Args:
        target: the target causal LM.
        temperature, top_k, top_p: sampling settings (temperature 0 = greedy).
        seed: seeds the ``torch.Generator`` created for each generation.
        eos_token_ids: stop ids; default: the target's generation config.
    """

    name = "base"
    # Capabilities: the ``ClassVar``s below, read by the tuner from the class or an instance,
    # never probed; every method class declares each one in its own body, even where it keeps
    # the default (tests/test_capabilities.py checks both).
    #
    # at T = 0 its per-step acceptance is replayed exactly from one vanilla generation
    # (``decoding.replay.drafter_steps``: its drafter reads only the committed prefix)
    replayable: ClassVar[bool] = False
    # every forward it makes is the target's or a draft model's, so an untimed run of it, its
    # forwards traced, can be priced by their cost surfaces (opt-in per method: EAGLE's head is
    # neither, vanilla has nothing to predict)
    traceable: ClassVar[bool] = False
    # its acceptance on a prompt depends on the prompts generated before it since ``reset``
    # (Ouroboros's phrase pool with reuse_history): an untimed run must follow the timed order.
    # A method whose constructor decides it declares a read-only property instead (Ouroboros)
    keeps_history: ClassVar[bool] = False
    # the loop drives the target through ``decoding.target_cache.TargetCache`` (so it can run on
    # a ``decoding.compiled.CompiledTarget``); lookahead keeps its own cache arithmetic
    supports_compiled: ClassVar[bool] = False
    # EAGLE heads: the head format the method runs (3: EAGLE-3 heads only; None: no head, or
    # either format)
    head_version: ClassVar[int | None] = None
    # the keyword arguments whose product is the draft tokens one target forward verifies (γ;
    # SpecInfer's drafts × γ; a trie's matches × γ): what orders its settings by cost where
    # their speed ties (``tuner.search.racing.tie_break``); () where it drafts nothing
    draft_size_params: ClassVar[tuple[str, ...]] = ()
    # the drafter the shared loop asks for drafts (``decoding.loop.DraftVerifyLoop``); None for
    # a method without one (vanilla, lookahead's fused Jacobi window)
    drafter: Drafter | None = None

    @classmethod
    def compiled_refusal(cls, params: Mapping[str, Any]) -> str | None:
        """Why a method built from ``params`` cannot run on a compiled target, or None.

        The reason names the method by ``{method}`` and the setting that asks for compiling by
        ``{compile}``, so a caller can refuse in its own words before any model loads."""
        if cls.supports_compiled:
            return None
        return ("{method} keeps its own decoding loop and cannot run with {compile}: allowed "
                "are every other method, or {off}")

    def __init__(self, target: nn.Module, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        self.target = target
        self.sampling = SamplingConfig(temperature, top_k, top_p)
        self.seed = seed
        self.eos_ids = stop_ids(target, eos_token_ids)
        self.compiled: CompiledTarget | None = None

    def reset(self) -> None:
        """Forget state kept across generations (no-op unless a method keeps history)."""

    def use_compiled(self, compiled: CompiledTarget | None) -> None:
        """Run the target's forwards on ``compiled`` (a static cache, graphs per shape bucket),
        or eagerly again with None. Draft models stay eager."""
        if compiled is not None and not self.supports_compiled:
            raise ValueError(f"method {self.name} keeps its own decoding loop and cannot run on "
                             f"a compiled target: every other method can")
        if compiled is not None and compiled.model is not self.target:
            raise ValueError("the compiled target wraps another model than this method's target")
        self.compiled = compiled

    def target_cache(self, total_len: int) -> TargetCache:
        """The target with a fresh cache for a generation of ``total_len`` positions."""
        if self.compiled is not None:
            return self.compiled.start(total_len)
        return EagerTargetCache(self.target, total_len + RESERVE_SLACK)


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
