"""Verification rules as pure functions: probabilities in, ``Verdict`` out.

Notation (stated once, Leviathan et al.): **p = target**, **q = draft**. For a chain draft of γ tokens
``x`` ([γ]):
  * ``target_probs`` ([γ+1, V]): row i is p(· | prefix, x[:i]); row γ is the bonus row;
  * ``draft_probs`` ([γ, V]): row i is q(· | prefix, x[:i]), the distribution x[i] was drawn from,
    or None for point-mass drafts (greedy drafting, n-grams): q = δ_{x[i]} (requirement R2).
All rows are the *warped* distributions (temperature/top-k/top-p already applied, requirement R1).

Rules (exact specs and proofs by enumeration in docs/verification.md):
  * ``greedy_match``: temperature 0; accept while x[i] == argmax p_i, then emit argmax at the stop.
  * ``token_verify`` (Leviathan/Chen): accept x[i] iff u·q(x) < p(x); on the first rejection draw
    from norm(max(p − q, 0)); if all accepted, the bonus from row γ.
  * ``block_verify`` (Sun et al. 2024): weights w_i = min(w_{i−1}·p(x_i)/q(x_i), 1) in log space,
    thresholds h_i = ρ_i/σ_i (h_γ = w_γ), τ = the *last* i with η_i < h_i, then draw from
    norm(max(w_τ·p_τ − q_τ, 0)) (or the bonus row if τ = γ).
The random wrappers draw everything in a fixed order from one ``torch.Generator`` and synchronise
with the host once (a single ``.tolist()``).

Token trees (docs/verification.md §3): ``greedy_tree`` (SpecInfer VerifyGreedy) and ``tree_verify``
(multi-round speculative sampling at every node, SpecInfer VerifyStochastic / EAGLE). At a node the
children are tried in draw order; ``sibling_round`` is one round, with the residual update that
matches how the siblings were drawn:
  * i.i.d. with replacement, or each child from its own drafter q_j: accept x with probability
    min(1, p(x)/q_j(x)); on rejection p ← norm(max(p − q_j, 0)), q unchanged;
  * without replacement from q: the same, then q ← norm(q with x zeroed) for the next sibling;
  * deterministic top-k siblings: q_j = δ_x (``draft_probs`` None): accept with probability p(x);
    on rejection p(x) ← 0, renormalised (the i.i.d. rule with a point mass).
If every child is rejected the token is drawn from the final residual; at a leaf from the target row.

Joint acceptance (MJSD, Qin et al. 2024; LOSSY by design, docs/verification.md §4): W beams of γ
tokens ``x_w`` with joint probabilities P(x_{w,1:i}) = Π_{d≤i} p(x_{w,d} | x_{w,<d}) (target) and
Q(x_{w,1:i}) (draft); the prefix x_{w,1:i} passes iff min(1, P/Q) ≥ τ, a fixed threshold (no coin).
``longest_joint_prefix`` takes the longest passing prefix over all beams (every prefix is tested: a
prefix may pass after a shorter one failed; ties go to the earlier beam); ``joint_verify`` then
draws the next token from the plain target row after that prefix (no residual).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from decoding.base import Verdict
from decoding.tree import trials_by_slot

_TINY = 1e-30  # a residual with less mass than this is round-off: fall back to the target row


def greedy_match(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy verification (temperature 0).

    Args:
        draft_tokens: [γ] int64 draft token ids.
        target_logits: [γ+1, V] target logits (or probabilities: only the argmax is used).
    """
    gamma = int(draft_tokens.shape[0])
    both = torch.cat([target_logits.argmax(dim=-1), draft_tokens]).tolist()
    target_choice, draft = both[: gamma + 1], both[gamma + 1:]
    accepted = 0
    while accepted < gamma and draft[accepted] == target_choice[accepted]:
        accepted += 1
    return Verdict(accepted=accepted, next_token=target_choice[accepted])


def draft_distribution(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[γ, V] draft distributions, materialising point masses when ``draft_probs`` is None."""
    if draft_probs is not None:
        return draft_probs.to(dtype)
    rows = torch.zeros(draft_tokens.shape[0], vocab, dtype=dtype, device=draft_tokens.device)
    return rows.scatter_(1, draft_tokens[:, None], 1.0)


def normalized_residual(target_rows: torch.Tensor, draft_rows: torch.Tensor) -> torch.Tensor:
    """norm(max(p − q, 0)) per row ([n, V]); a row with no mass (round-off only) falls back to p."""
    residual = torch.clamp(target_rows - draft_rows, min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > _TINY, residual / mass.clamp_min(_TINY), target_rows)


def _pick(outcome_rows: torch.Tensor, index: torch.Tensor,
          generator: torch.Generator | None) -> tuple[int, int]:
    """Draw one token from every row of ``outcome_rows`` ([γ+1, V]) and keep the one at ``index``.

    The unused draws are independent of everything else, so this is the same law as drawing only
    at ``index``, without a host sync before the draw.
    """
    draws = torch.multinomial(outcome_rows, 1, generator=generator).squeeze(1)   # [γ+1]
    accepted, token = torch.stack([index, draws[index]]).tolist()
    return int(accepted), int(token)


def token_acceptance(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor) -> torch.Tensor:
    """min(1, p(x_i)/q(x_i)) per draft position ([γ]): the probability each token passes."""
    gamma = draft_tokens.shape[0]
    p_x = target_probs[:gamma].gather(1, draft_tokens[:, None]).squeeze(1)
    if draft_probs is None:
        return p_x.clamp(max=1.0)
    q_x = draft_probs.to(p_x.dtype).gather(1, draft_tokens[:, None]).squeeze(1)
    return torch.where(p_x >= q_x, torch.ones_like(p_x), p_x / q_x.clamp_min(_TINY))


def token_residuals(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                    target_probs: torch.Tensor) -> torch.Tensor:
    """The distribution of the emitted token after n accepted, n = 0..γ ([γ+1, V]).

    Row n < γ: the residual norm(max(p_n − q_n, 0)); row γ: the bonus row p_γ.
    """
    gamma, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    draft_rows = draft_distribution(draft_tokens, draft_probs, vocab, target_probs.dtype)
    return torch.cat([normalized_residual(target_probs[:gamma], draft_rows),
                      target_probs[gamma:]])


def token_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Token verification (Leviathan et al. 2023 Alg. 1; Chen et al. 2023).

    Args:
        draft_tokens: [γ] int64.
        draft_probs: [γ, V] or None (point masses).
        target_probs: [γ+1, V].
        generator: source of all randomness.
    """
    gamma, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    draft_rows = draft_distribution(draft_tokens, draft_probs, vocab, target_probs.dtype)
    p_x = target_probs[:gamma].gather(1, draft_tokens[:, None]).squeeze(1)           # [γ]
    q_x = draft_rows.gather(1, draft_tokens[:, None]).squeeze(1)                      # [γ]
    u = torch.rand(gamma, generator=generator, device=target_probs.device, dtype=p_x.dtype)
    passed = (u * q_x < p_x).to(torch.int64)                                          # no division
    accepted = torch.cumprod(passed, dim=0).sum()                                     # leading passes
    outcomes = token_residuals(draft_tokens, draft_probs, target_probs)               # [γ+1, V]
    n, token = _pick(outcomes, accepted, generator)
    return Verdict(accepted=n, next_token=token)


def bv_log_weights(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                   target_probs: torch.Tensor) -> torch.Tensor:
    """log w_i for i = 0..γ ([γ+1], log w_0 = 0).

    w_i = min(w_{i−1}·p(x_i)/q(x_i), 1), computed in closed form: with S_i the cumulative log
    ratio (S_0 = 0), log w_i = S_i − max_{j≤i} S_j (the minimum over suffixes of the likelihood ratio).
    """
    gamma = draft_tokens.shape[0]
    log_p = torch.log(target_probs[:gamma].gather(1, draft_tokens[:, None]).squeeze(1))
    if draft_probs is not None:
        log_q = torch.log(draft_probs.to(log_p.dtype).gather(1, draft_tokens[:, None]).squeeze(1))
        log_p = log_p - log_q
    cumulative = torch.cat([log_p.new_zeros(1), torch.cumsum(log_p, dim=0)])        # [γ+1]
    return cumulative - torch.cummax(cumulative, dim=0).values


def bv_thresholds(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                  target_probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Stop thresholds h_1..h_γ ([γ]; element i−1 is h_i).

    h_i = ρ_i / σ_i with ρ_i = Σ (w_i p_i − q_i)_+ and σ_i = Σ (q_i − w_i p_i)_+ (= ρ_i + 1 − w_i,
    the cancellation-free form); 0/0 := 1. The last position uses h_γ = w_γ.
    """
    gamma, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    draft_rows = draft_distribution(draft_tokens, draft_probs, vocab, target_probs.dtype)
    scaled = weights[1:gamma, None] * target_probs[1:gamma]                           # [γ−1, V]
    rho = torch.clamp(scaled - draft_rows[1:gamma], min=0.0).sum(dim=-1)
    sigma = torch.clamp(draft_rows[1:gamma] - scaled, min=0.0).sum(dim=-1)
    middle = torch.where(sigma > 0, rho / sigma.clamp_min(_TINY), torch.ones_like(rho))
    return torch.cat([middle, weights[gamma:]])


def bv_residuals(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 target_probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The distribution of the emitted token for each τ = 0..γ ([γ+1, V]).

    Row τ < γ: norm(max(w_τ·p_τ − q_τ, 0)) (falls back to p_τ on round-off); row γ: the bonus row p_γ.
    """
    gamma, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    draft_rows = draft_distribution(draft_tokens, draft_probs, vocab, target_probs.dtype)
    scaled = weights[:gamma, None] * target_probs[:gamma]
    residual = torch.clamp(scaled - draft_rows, min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    rows = torch.where(mass > _TINY, residual / mass.clamp_min(_TINY), target_probs[:gamma])
    return torch.cat([rows, target_probs[gamma:]])


def block_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Block verification (Sun, Mendlovic, Leviathan et al., ICLR 2025).

    Args: as ``token_verify``. τ is the **last** passing index (not the first failure).
    """
    gamma = draft_tokens.shape[0]
    weights = torch.exp(bv_log_weights(draft_tokens, draft_probs, target_probs))      # [γ+1]
    thresholds = bv_thresholds(draft_tokens, draft_probs, target_probs, weights)      # [γ]
    eta = torch.rand(gamma, generator=generator, device=target_probs.device,
                     dtype=thresholds.dtype)
    positions = torch.arange(1, gamma + 1, device=target_probs.device)
    # strict: torch.rand can return exactly 0.0, and h_i = 0 (a zero-probability token) must fail
    tau = torch.where(eta < thresholds, positions, 0).max() if gamma else positions.sum()
    outcomes = bv_residuals(draft_tokens, draft_probs, target_probs, weights)         # [γ+1, V]
    n, token = _pick(outcomes, tau, generator)
    return Verdict(accepted=n, next_token=token)


# ----------------------------------------------------------------------------------------------
# Token trees


def greedy_tree(tokens: Sequence[int], parents: Sequence[int], slot_of: Sequence[int],
                target_logits: torch.Tensor) -> Verdict:
    """Greedy tree verification: descend while a child's token is the target's argmax.

    Args:
        tokens, parents: [n] draft nodes (``Draft.tokens``/``parents`` as lists).
        slot_of: [n] forward slot of every node (``decoding.tree.merge_duplicates``).
        target_logits: [S+1, V]; row 0 after the root, row s+1 after slot s.
    """
    choice = target_logits.argmax(dim=-1).tolist()
    trials = trials_by_slot(parents, slot_of)
    slot, path = -1, []
    while True:
        want = choice[slot + 1]
        node = next((c for c in trials.get(slot, ()) if tokens[c] == want), None)
        if node is None:
            return Verdict(accepted=len(path), next_token=want, path=tuple(path))
        path.append(node)
        slot = slot_of[node]


def sibling_round(target_row: torch.Tensor, token: int, draft_row: torch.Tensor | None,
                  without_replacement: bool
                  ) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    """One round of multi-round speculative sampling at a node (docs/verification.md §3.1).

    Args:
        target_row: [V] current (residual) target distribution p.
        token: the sibling x tried in this round.
        draft_row: [V] the distribution x was drawn from (None: a point mass δ_x).
        without_replacement: siblings were drawn without replacement (update q too).

    Returns:
        (acceptance probability min(1, p(x)/q(x)), p after a rejection, q for the next sibling).
    """
    p_x = float(target_row[token])
    if draft_row is None:
        draft_row = torch.zeros_like(target_row)
        draft_row[token] = 1.0
    q_x = float(draft_row[token])
    accept = 1.0 if p_x >= q_x else p_x / q_x
    residual = normalized_residual(target_row[None], draft_row[None])[0]
    if not without_replacement:
        return accept, residual, draft_row
    rest = draft_row.clone()
    rest[token] = 0.0
    mass = float(rest.sum())
    return accept, residual, rest / mass if mass > _TINY else rest


def tree_verify(tokens: Sequence[int], parents: Sequence[int], slot_of: Sequence[int],
                draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                without_replacement: bool, generator: torch.Generator | None) -> Verdict:
    """Stochastic tree verification: ``sibling_round`` at every node along the accepted path.

    Args:
        tokens, parents, slot_of: as ``greedy_tree``; children of a slot are tried in node order.
        draft_probs: [n, V] the distribution each node was drawn from, or None (point masses).
        target_probs: [S+1, V] warped target rows (row 0 after the root, row s+1 after slot s).
        without_replacement: the sibling scheme of the draft.
        generator: source of all randomness.
    """
    trials = trials_by_slot(parents, slot_of)
    slot, path = -1, []
    while True:
        probs = target_probs[slot + 1].double()                               # [V]
        draft_row, chosen = None, None
        for node in trials.get(slot, ()):
            if draft_probs is not None and (draft_row is None or not without_replacement):
                draft_row = draft_probs[node].double()
            accept, residual, draft_row = sibling_round(probs, tokens[node], draft_row,
                                                        without_replacement)
            coin = float(torch.rand((), generator=generator, dtype=torch.float64,
                                    device=probs.device))
            if coin < accept:
                chosen = node
                break
            probs = residual
            if draft_probs is None:
                draft_row = None
        if chosen is None:
            token = torch.multinomial(probs, 1, generator=generator)
            return Verdict(accepted=len(path), next_token=int(token), path=tuple(path))
        path.append(chosen)
        slot = slot_of[chosen]


# ----------------------------------------------------------------------------------------------
# Joint acceptance over beams (MJSD)


def joint_log_ratios(beam_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor) -> torch.Tensor:
    """log P(x_{w,1:i}) − log Q(x_{w,1:i}) for every prefix of every beam ([W, γ], float64).

    Args:
        beam_tokens: [W, γ] int64 beam tokens.
        draft_probs: [W, γ, V] the draft rows each token was scored under (Q = the product of the
            gathered entries), or None for point masses (Q = 1).
        target_probs: [W, γ+1, V]; row d of beam w is p(· | prefix, x_{w,<d}).
    """
    gamma = beam_tokens.shape[1]
    index = beam_tokens[..., None]                                                  # [W, γ, 1]
    log_ratio = torch.log(target_probs[:, :gamma].gather(2, index).squeeze(2).double())
    if draft_probs is not None:
        log_ratio = log_ratio - torch.log(draft_probs.gather(2, index).squeeze(2).double())
    return torch.cumsum(log_ratio, dim=1)


def longest_joint_prefix(log_ratios: torch.Tensor, tau: float) -> tuple[int, int]:
    """(beam, n): the longest prefix over all beams with min(1, P/Q) ≥ τ; (0, 0) if none passes.

    Args:
        log_ratios: [W, γ] from ``joint_log_ratios``.
        tau: τ in [0, 1]; τ = 0 passes every prefix (even P = 0).
    """
    width, gamma = log_ratios.shape
    if gamma == 0:
        return 0, 0
    passed = log_ratios >= math.log(tau) if tau > 0 else torch.ones_like(log_ratios, dtype=bool)
    positions = torch.arange(1, gamma + 1, device=log_ratios.device)
    # [W]; amax, not max(dim): that one costs milliseconds when CPU threads contend
    longest = torch.where(passed, positions, 0).amax(dim=1)
    beam = torch.argmax(longest)                                 # the first beam on ties
    beam, n = torch.stack([beam, longest[beam]]).tolist()
    return int(beam), int(n)


def joint_verify(beam_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 target_probs: torch.Tensor, tau: float, generator: torch.Generator | None,
                 greedy: bool = False) -> tuple[int, Verdict]:
    """MJSD verification (arXiv 2407.09722 Alg. 1, over several beams as the authors' code does).

    Args: as ``joint_log_ratios``, plus τ and the generator of the single draw; ``greedy``: the
        target rows are one-hot (temperature 0), so the draw is the row's argmax (what a draw
        from a one-hot row gives, without a multinomial's one exponential per vocabulary entry).

    Returns:
        (the accepted beam, Verdict(n, y)) with y ~ target_probs[beam, n] (the bonus row if n = γ).
    """
    beam, n = longest_joint_prefix(joint_log_ratios(beam_tokens, draft_probs, target_probs), tau)
    row = target_probs[beam, n]                                                     # [V]
    token = row.argmax() if greedy else torch.multinomial(row, 1, generator=generator)
    return beam, Verdict(accepted=n, next_token=int(token))
