"""MJSD, multi-token joint speculative decoding (Qin et al. 2024, arXiv 2407.09722): LOSSY by design.

    python -m tuner +task=cnndm method=mjsd search.max_perplexity_ratio=1.05
    build_method("mjsd", pair, num_beams=8, width=1, num_draft_tokens=4, tau=0.9,
                 temperature=1.0, top_k=20, top_p=0.9)          # the paper's setting

One step (one target forward, ``decoding.loop``):
  1. ``BeamDrafter`` beam-samples γ = ``num_draft_tokens`` steps with M = ``num_beams`` beams under
     the warped draft conditionals q̃ (temperature, top-k, top-p: the method's sampling settings)
     and returns the W = ``width`` beams with the largest joint draft probability, with the q̃ row
     every token was scored under, so Q(x_{1:i}) = Π_{d≤i} q̃(x_d | x_<d) for every prefix;
  2. the target scores all W beams in ONE forward (a chain when W = 1, else a token tree: beams
     that share a prefix share its forward slots), giving P(x_{1:i}) = Π_{d≤i} p̃(x_d | x_<d);
  3. ``decoding.verify.joint_verify``: the prefix x_{w,1:i} passes iff min(1, P/Q) ≥ τ, a fixed
     threshold (no random draw); the longest passing prefix over all beams is accepted (every
     prefix is tested, one may pass after a shorter one failed; ties: the beam with larger Q);
     then one token y ~ p̃(· | accepted prefix), the plain target row (no residual).

Beam sampling (the form of MTAD's ``BatchMTADStrategy``): step 1 draws M distinct tokens without
replacement from q̃(· | prefix); step s draws M distinct (beam b, token v) pairs without
replacement with probability ∝ Q(beam_b)·q̃(v | beam_b), the joint draft probability of the
extended sequence (fewer when the warped support holds fewer candidates). Beams are kept in
descending Q (draw order on ties); one draft forward per step feeds every beam (tree mask over the
draft's own cache). A beam may run past an EOS; the loop truncates the committed tokens there.

Temperature 0 (MTAD's greedy variant): deterministic beam search (the M best extensions by the
draft's unwarped log-probability, lowest (beam, token) index on ties) and one-hot target rows, so
P ∈ {0, 1}: for τ > 0 a prefix passes iff it matches the target's argmax and MJSD emits exactly
vanilla's greedy tokens; the beams only change how many are accepted per forward. With
M = W = 1 it is greedy speculative decoding, step for step.

At temperature > 0 the output law is neither the target's nor greedy (docs/verification.md §4.4):
the tuner scores its perplexity and task quality against vanilla instead of checking tokens.
Differences from the paper and the authors' code are listed in docs/mjsd.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import torch

from decoding.base import Draft, DraftContext, Drafter, Verdict
from decoding.cached_model import CachedModel
from decoding.loop import DraftVerifyLoop
from decoding.runtime import check_positive_int
from decoding.sampling import SamplingConfig, logits_to_probs
from decoding.speculative import single_draft
from decoding.tree import Forest
from decoding.verify import joint_verify

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Beams:
    """The best beams of one beam sampling, largest joint draft probability first."""

    tokens: torch.Tensor          # [W, γ] int64
    log_q: torch.Tensor           # [W, γ] float32 log q̃(x_d | x_<d); its cumsum is log Q(x_{1:i})
    rows: torch.Tensor | None     # [W, γ, V] q̃ rows the tokens were scored under (None: T = 0)
    forwards: int                 # draft-model forwards spent


class BeamDrafter(Drafter):
    """M beams, γ steps of beam sampling (beam search at temperature 0) with its own KV cache."""

    def __init__(self, model: nn.Module, sampling: SamplingConfig, num_beams: int, width: int,
                 num_tokens: int) -> None:
        self.model, self.sampling = CachedModel(model), sampling
        self.num_beams, self.width, self.num_tokens = num_beams, width, num_tokens

    def reset(self) -> None:
        self.model.reset()

    def commit(self, num_valid: int) -> None:
        self.model.rollback(num_valid)

    def propose(self, context: DraftContext) -> Draft:
        """The W best beams of γ_eff = min(γ, budget) tokens: a chain, or W chains as a tree."""
        gamma = min(self.num_tokens, context.budget)
        beams = self.search(context.ids, gamma, context.generator)
        count = beams.tokens.shape[0]
        parents = None
        if count > 1:    # node w·γ + d is token d of beam w (beam-major)
            node = torch.arange(count * gamma, device=beams.tokens.device).view(count, gamma)
            parents = torch.cat([torch.full_like(node[:, :1], -1), node[:, :-1]], 1).reshape(-1)
        probs = None if beams.rows is None else beams.rows.reshape(count * gamma, -1)
        return Draft(tokens=beams.tokens.reshape(-1), probs=probs, parents=parents,
                     forwards=beams.forwards)

    def search(self, ids: torch.Tensor, gamma: int, generator: torch.Generator | None) -> Beams:
        """Beam sampling of ``gamma`` tokens after ``ids`` ([L]); γ draft forwards."""
        logits = self.model.feed(ids)[None]             # [1, V] after the committed tokens
        tokens = ids.new_zeros(1, 0)                    # [B, s] tokens of each beam
        log_q = torch.zeros(1, 0, device=ids.device)    # [B, s] log q̃ of each token
        row_of = ids.new_zeros(1, 0)                    # [B, s] index of each token's q̃ row
        joint = torch.zeros(1, device=ids.device)       # [B] log Q of each beam
        tree = Forest()                                 # every beam token fed so far, as nodes
        newest: list[int] = []                          # [B] tree node of each beam's last token
        rows, seen = [], 0
        for step in range(gamma):
            count = tokens.shape[0]
            if step:   # feed every beam's newest token; its ancestors are in the cache already
                depths = [step] * len(tree.tokens)      # (read for the fed nodes only)
                logits = self.model.extend_tree(newest, tree.tokens, tree.parents,
                                                depths)                               # [B, V]
            log_rows, q_rows = self._scored(logits)                                   # [B, V]
            scores = joint[:, None] + log_rows                                         # [B, V]
            parent, token = self._pick(scores, generator)                             # [B']
            joint = scores[parent, token]
            tokens = torch.cat([tokens[parent], token[:, None]], 1)
            log_q = torch.cat([log_q[parent], log_rows[parent, token][:, None]], 1)
            row_of = torch.cat([row_of[parent], (seen + parent)[:, None]], 1)
            if step + 1 < gamma:                        # the last tokens are never fed
                newest = [tree.add(t, newest[b] if step else -1)
                          for b, t in zip(parent.tolist(), token.tolist())]
            rows.append(q_rows)
            seen += count
        self.model.discard_tree()                       # beam rows are dropped; the path is re-fed
        keep = min(self.width, tokens.shape[0])         # beams are in descending joint order
        q = None if self.sampling.greedy else torch.cat(rows)[row_of[:keep]]
        return Beams(tokens[:keep], log_q[:keep], q, forwards=gamma)

    def _scored(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log q̃ [B, V], q̃ [B, V]); at temperature 0 the unwarped log-softmax and no rows."""
        if self.sampling.greedy:
            return torch.log_softmax(logits.float(), dim=-1), None
        q = logits_to_probs(logits, self.sampling)
        return torch.log(q), q

    def _pick(self, scores: torch.Tensor, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """M distinct (beam, token) candidates of ``scores`` ([B, V] joint log Q), best first."""
        flat, vocab = scores.reshape(-1), scores.shape[1]
        if self.sampling.greedy:
            count = min(self.num_beams, int(torch.isfinite(flat).sum()))
            picked = best_first(scores, count)
        else:
            probs = torch.softmax(flat, dim=0)          # ∝ Q(beam)·q̃(token | beam)
            count = min(self.num_beams, int((probs > 0).sum()))
            picked = torch.multinomial(probs, count, replacement=False, generator=generator)
            picked = picked[torch.sort(flat[picked], descending=True, stable=True).indices]
        return picked // vocab, picked % vocab


def best_first(values: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the ``count`` largest of ``values`` ([N] or [B, V], read flat), largest
    first, ties by index: the first ``count`` of a stable descending sort, without sorting all N
    (B·V) entries.

    The count-th largest value is found among each row's ``count`` largest (a row-wise topk, about
    twice as fast on B·V entries as one over the flat tensor); every entry at least that large is a
    candidate (``nonzero`` lists them in index order, boundary ties included), and only those are
    sorted stably.
    """
    rows = values.reshape(-1, values.shape[-1])                                    # [B, V]
    row_best = torch.topk(rows, min(count, rows.shape[1]), dim=1, sorted=False).values
    kth = torch.topk(row_best.reshape(-1), count, sorted=False).values.min()
    flat = values.reshape(-1)
    candidates = torch.nonzero(flat >= kth).squeeze(1)                             # ascending
    order = torch.sort(flat[candidates], descending=True, stable=True).indices
    return candidates[order[:count]]


def check_tau(tau: object) -> float:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau (τ)={tau!r} is invalid: allowed is a number in [0, 1]")
    return float(tau)


class MJSD(DraftVerifyLoop):
    """Draft beams verified jointly by the target; lossy (see the module docstring).

    Args:
        target, draft: causal LMs sharing a vocabulary.
        num_draft_tokens: γ, tokens per beam.
        num_beams: M, beams of the draft's beam sampling.
        width: W ≤ M, beams verified together (the best by joint draft probability).
        tau: τ in [0, 1], the acceptance threshold on min(1, P/Q).
        temperature, top_k, top_p: the warping of both p̃ and q̃ (the paper: 1, 20, 0.9).
        seed, eos_token_ids: as for every method.
    """

    name = "mjsd"
    replayable = False            # beams sampled from the draft
    traceable = True              # target and draft-model forwards only
    keeps_history = False
    supports_compiled = True
    head_version = None
    draft_size_params = ("num_draft_tokens", "width")   # γ × W beams verified together

    def __init__(self, target: nn.Module, draft: nn.Module, *, num_draft_tokens: int = 4,
                 num_beams: int = 8, width: int = 1, tau: float = 0.9,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        draft = single_draft(draft, self.name)
        check_positive_int("num_draft_tokens", num_draft_tokens, "γ")
        check_positive_int("num_beams", num_beams, "M")
        check_positive_int("width", width, "W")
        if width > num_beams:
            raise ValueError(f"width (W)={width!r} is invalid: allowed is an integer between 1 "
                             f"and num_beams={num_beams} (the beams it is chosen from)")
        self.tau = check_tau(tau)
        super().__init__(target, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         eos_token_ids=eos_token_ids)
        self.drafter = BeamDrafter(draft, self.sampling, num_beams, width, num_draft_tokens)

    def _verify(self, draft: Draft, logits: torch.Tensor,
                generator: torch.Generator) -> Verdict:
        """One beam (a chain): logits [γ+1, V]."""
        target = logits_to_probs(logits, self.sampling)[None]                     # [1, γ+1, V]
        probs = None if draft.probs is None else draft.probs[None]
        return joint_verify(draft.tokens[None], probs, target, self.tau, generator,
                            self.sampling.greedy)[1]

    def _verify_tree(self, draft: Draft, tokens: list[int], parents: list[int],
                     slot_of: list[int], logits: torch.Tensor,
                     generator: torch.Generator) -> Verdict:
        """W beams laid out beam-major (``BeamDrafter.propose``); logits [S+1, V] by slot."""
        count = sum(1 for parent in parents if parent < 0)
        gamma = len(tokens) // count
        slot = torch.tensor(slot_of, device=logits.device).view(count, gamma)
        rows = torch.cat([slot.new_zeros(count, 1), slot + 1], 1)    # [W, γ+1] row after prefix
        target = logits_to_probs(logits, self.sampling)[rows]                      # [W, γ+1, V]
        probs = None if draft.probs is None else draft.probs.view(count, gamma, -1)
        beam, verdict = joint_verify(draft.tokens.view(count, gamma), probs, target, self.tau,
                                     generator, self.sampling.greedy)
        return replace(verdict, path=tuple(range(beam * gamma, beam * gamma + verdict.accepted)))
