"""Acceptance replay at temperature 0: what a lossless draft → verify loop *would* accept at every
step, computed from one vanilla generation instead of running the loop.

At T = 0 a lossless method commits exactly vanilla's tokens y_1..y_N (``trajectory``: vanilla run
to ``max_new_tokens`` without stopping at EOS, since a draft may reach past an EOS that its step
then truncates). For drafters whose drafts depend only on the committed prefix (``replayable``:
no target states, no feedback from the target's logits) every step is a function of y:

* ``drafter_steps`` (exact, any replayable drafter: draft-model chains of ``speculative`` and
  ``block``, ``tree``'s static and dynamic trees, prompt lookup's chains and tries): the method's
  own drafter proposes from the committed prefix with the loop's budgets and is rolled back as
  the loop rolls it back, so its forwards have the loop's shapes and numerics (an int8-dynamic
  draft quantises each forward's activations with one scale: shapes matter); the loop's greedy
  verification (``greedy_match``, ``greedy_tree``) runs on rows whose argmax is y's next token.
  One drafter pass per setting and no target forward;
* ``chain_steps`` (every γ at once): a draft model's j-th draft after position p is, while the
  drafts match, its argmax after x, y_<p+j, which one teacher-forced pass gives for every
  position (``draft_agreement``); a step accepts the leading run of agreements capped at γ_eff.
  Exact where the teacher-forced argmax is the loop's (fp32 drafts away from near-ties); not for
  drafts whose numerics depend on the forward's rows (use ``drafter_steps`` there);

The step arithmetic is the loop's (``decoding.loop``): γ_eff = min(γ, max_new − produced − 1), the
target forward takes the uncached committed tokens (the prompt on the first step, then the last
committed token) plus the draft, and a step stops the generation at the first committed EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from decoding.base import Draft, DraftContext, Drafter
from decoding.runtime import forward_logits, new_cache, truncate_at_eos
from decoding.tree import merge_duplicates, node_depths
from decoding.verify import greedy_match, greedy_tree

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ReplayedStep:
    """One verification step of a replayed generation (what ``decoding.base.Step`` records, plus
    the shapes its cost depends on)."""

    accepted: int                 # leading draft tokens (tree depth) accepted
    drafted: int                  # draft tokens (tree nodes) verified in the target forward
    committed: int                # tokens committed (accepted + 1, or fewer at EOS)
    context: int                  # committed tokens before the step (prompt + generated)
    fed: int                      # target forward rows: uncached committed tokens + draft
    draft_forwards: int = 0       # draft-model forwards spent on this step's draft
    level_sizes: tuple[int, ...] | None = None   # [depth] tree nodes per depth (None: a chain)


@torch.inference_mode()
def trajectory(target: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Vanilla's greedy tokens to exactly ``max_new_tokens``, not stopping at EOS ([N] ids)."""
    from decoding.vanilla import Vanilla
    method = Vanilla(target, eos_token_ids=[])
    return [t for step in method.stream(torch.as_tensor(prompt_ids), max_new_tokens)
            for t in step.tokens]


@torch.inference_mode()
def draft_agreement(draft: nn.Module, prompt_ids: torch.Tensor, tokens: Sequence[int],
                    token_by_token: bool = False) -> list[bool]:
    """a_i = [the draft's argmax after prompt + tokens[:i] equals tokens[i]] for every i.

    ``token_by_token`` False: one teacher-forced forward over prompt + tokens[:-1]. True: the
    prompt in one forward, then one forward per token, the shape the loop's drafting has (it
    feeds a draft model one token at a time, two after a step that accepted every draft): for
    drafts whose numerics depend on the rows of a forward (int8-dynamic quantises each forward's
    activations with one scale), at the cost of one draft forward per token."""
    prompt = torch.as_tensor(prompt_ids).to(next(draft.parameters()).device)
    rest = torch.as_tensor(list(tokens[:-1]), dtype=torch.long, device=prompt.device)  # [N − 1]
    if not token_by_token:
        ids = torch.cat([prompt, rest])                                       # [L + N − 1]
        logits = forward_logits(draft, ids[None], new_cache(draft), 0, len(tokens))   # [N, V]
        guesses = logits.argmax(dim=-1).tolist()
    else:
        cache = new_cache(draft, len(prompt) + len(tokens))
        guesses = [int(forward_logits(draft, prompt[None], cache, 0, 1)[-1].argmax())]
        for i, token in enumerate(rest):
            logits = forward_logits(draft, token.view(1, 1), cache, len(prompt) + i, 1)
            guesses.append(int(logits[-1].argmax()))
    return [g == t for g, t in zip(guesses, tokens)]


def chain_steps(agreement: Sequence[bool], tokens: Sequence[int], prompt_len: int,
                num_draft_tokens: int, max_new_tokens: int,
                eos_ids: Sequence[int] = ()) -> list[ReplayedStep]:
    """The steps of a draft-model chain with γ = ``num_draft_tokens`` (see the module docstring):
    ``agreement`` and ``tokens`` ([max_new_tokens] each) from ``draft_agreement`` and
    ``trajectory``."""
    if len(tokens) < max_new_tokens or len(agreement) < max_new_tokens:
        raise ValueError(f"a replay of {max_new_tokens} tokens needs a trajectory that long "
                         f"(got {len(tokens)} tokens, {len(agreement)} agreements)")
    steps: list[ReplayedStep] = []
    produced, uncached = 0, prompt_len
    while produced < max_new_tokens:
        gamma = min(num_draft_tokens, max_new_tokens - produced - 1)
        accepted = 0
        while accepted < gamma and agreement[produced + accepted]:
            accepted += 1
        emitted, stop = truncate_at_eos(list(tokens[produced: produced + accepted + 1]),
                                        eos_ids)
        committed = len(emitted)
        steps.append(ReplayedStep(accepted, gamma, committed, prompt_len + produced,
                                  uncached + gamma, gamma))
        produced, uncached = produced + committed, 1
        if stop:
            break
    return steps


def replayable(drafter: Drafter) -> bool:
    """A drafter whose drafts depend only on the committed prefix: it reads no target states
    (``needs_hidden``) and takes no feedback from the target's logits (``observe``)."""
    return not drafter.needs_hidden and type(drafter).observe is Drafter.observe


@torch.inference_mode()
def drafter_steps(drafter: Drafter, prompt_ids: torch.Tensor, tokens: Sequence[int],
                  max_new_tokens: int, eos_ids: Sequence[int] = (),
                  generator: torch.Generator | None = None,
                  device: torch.device | str | None = None) -> list[ReplayedStep]:
    """The loop's steps (``decoding.loop.DraftVerifyLoop.stream`` at T = 0) with the target's
    forwards replaced by the trajectory: the real drafter proposes from the committed prefix with
    the loop's budgets and is rolled back as the loop rolls it back, so its forwards have the
    loop's shapes (exact for drafters whose numerics depend on them); the loop's own greedy
    verification (``greedy_match``, ``greedy_tree`` over merged slots) runs on rows whose argmax
    is the trajectory's next token. One drafter pass per setting, no target forward.
    ``device``: where the drafter's model is (default: ``prompt_ids``'s device)."""
    from decoding.loop import DraftVerifyLoop
    if not replayable(drafter):
        raise ValueError(f"{type(drafter).__name__} reads the target's states or logits: its "
                         "drafts are not a function of the committed prefix (not replayable)")
    if len(tokens) < max_new_tokens:
        raise ValueError(f"a replay of {max_new_tokens} tokens needs a trajectory that long "
                         f"(got {len(tokens)})")
    prompt = torch.as_tensor(prompt_ids)
    prompt = prompt.to(device if device is not None else prompt.device)
    ahead = torch.as_tensor(list(tokens[:max_new_tokens]), dtype=torch.long,
                            device=prompt.device)                               # [N]
    sequence = torch.cat([prompt, ahead])
    vocab = int(sequence.max()) + 1
    drafter.reset()
    steps: list[ReplayedStep] = []
    produced, uncached, verdict = 0, len(prompt), None
    while produced < max_new_tokens:
        budget = max_new_tokens - produced - 1
        length = len(prompt) + produced
        draft = Draft(tokens=prompt.new_zeros(0))
        if budget:
            draft = drafter.propose(DraftContext(sequence[:length], budget, generator, verdict))
        want = ahead[produced: produced + budget + 1]            # the target's argmax chain
        if draft.parents is None or not draft.size:
            rows = torch.nn.functional.one_hot(want[: draft.size + 1], vocab).float()
            verdict = greedy_match(draft.tokens, rows)
            slots = None
        else:
            node_tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
            slot_of, _, _ = merge_duplicates(node_tokens, parents)
            depth = node_depths(parents)
            row_of_slot = {slot_of[n]: depth[n] for n in range(len(node_tokens))}
            depths = [0] + [row_of_slot[s] for s in range(len(row_of_slot))]
            rows = torch.nn.functional.one_hot(want[[min(d, len(want) - 1) for d in depths]],
                                               vocab).float()           # [S+1, V]
            verdict = greedy_tree(node_tokens, parents, slot_of, rows)
            slots = slot_of
        emitted = [int(t) for t in draft.tokens[list(verdict.nodes)].tolist()] + \
            [verdict.next_token]
        emitted, stop = truncate_at_eos(emitted, eos_ids)
        committed = len(emitted)
        drafter.commit(length + verdict.accepted)
        step = DraftVerifyLoop._step(emitted, draft, verdict, slots, None)
        steps.append(ReplayedStep(step.accepted, step.drafted, committed, length,
                                  uncached + step.drafted, draft.forwards, step.level_sizes))
        produced, uncached = produced + committed, 1
        if stop:
            break
    return steps
