"""The one draft → verify → commit loop shared by every drafter-based method.

Speculative and block verification (chains from a draft model), token trees from one draft model
(``method=tree``), SpecInfer's merged multi-draft trees and Ouroboros (a draft chain lengthened by
pool phrases) all run this loop; only the ``Drafter`` and, for chains, the verify rule differ.
One step:
  1. the drafter proposes a ``Draft`` from a ``DraftContext`` (ids so far, budget, last verdict,
     target hidden states when it asks for them: such a drafter is first asked after the target's
     first forward, since before it there are no states to read);
  2. the target scores the uncached committed tokens + the draft in ONE forward: a chain
     (``parents is None``) goes through the plain causal fast path; a tree is merged into slots
     (``decoding.tree.merge_duplicates``) and fed with a tree attention mask;
  3. a pure verify function returns a ``Verdict`` (accepted path + recovered/bonus token), which
     the drafter observes (``Drafter.observe``: its feedback, and the step's method counters);
  4. the accepted path is committed (truncated at EOS), the target cache keeps exactly the rows of
     the committed prefix and the accepted path, the drafter rolls back its own state.

Cache invariant: the target cache holds every committed token except the last, which is fed again
with the next draft. A draft's paths are capped at ``max_new_tokens − produced − 1`` tokens, so a
step never overshoots the budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Tuple

import torch

from decoding.base import DecodingMethod, Draft, DraftContext, Step, Verdict
from decoding.runtime import check_request, make_generator, phase, truncate_at_eos
from decoding.sampling import logits_to_probs
from decoding.tree import Forest, merge_duplicates, node_depths
from decoding.verify import greedy_match, greedy_tree, token_verify, tree_verify

if TYPE_CHECKING:
    from decoding.base import Drafter
    from decoding.clock import PhaseClock
    from decoding.compiled import CompiledTarget
    from decoding.target_cache import Hidden, TargetCache

Scored = Tuple[Verdict, torch.Tensor, Optional[torch.Tensor], Optional[List[int]]]
VerifyRule = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, "torch.Generator | None"],
                      Verdict]


class DraftVerifyLoop(DecodingMethod):
    """A method made of a drafter and a verify rule; subclasses set ``self.drafter``.

    ``verify_rule`` is the chain rule at temperature > 0 (token verification unless overridden);
    trees use ``tree_verify`` / ``greedy_tree``. A method with a rule of another shape (MJSD's
    joint acceptance over whole beams) overrides ``_verify`` (chains) and ``_verify_tree``.
    """

    drafter: Drafter
    supports_compiled = True
    verify_rule: VerifyRule = staticmethod(token_verify)

    def use_compiled(self, compiled: CompiledTarget | None) -> None:
        """As ``DecodingMethod.use_compiled``; refused at once when the drafter reads target
        layers the compiled target does not return (an EAGLE-3 head's)."""
        if compiled is not None and self.drafter.hidden_layers is not None:
            from decoding.compiled import check_last_layer_only
            check_last_layer_only(self.drafter.hidden_layers)
        super().use_compiled(compiled)

    @torch.inference_mode()
    def stream(self, prompt_ids: torch.Tensor, max_new_tokens: int,
               clock: PhaseClock | None = None) -> Iterator[Step]:
        # 1. state: committed ids in a preallocated buffer; target cache starts empty. (The
        #    target's cache is not a ``CachedModel``: it lives in this frame for one generation,
        #    ``cached`` is step 4's arithmetic, its forwards also return hidden states, and it
        #    may be a compiled static cache: ``DecodingMethod.target_cache``.)
        prompt = check_request(self.target, prompt_ids, max_new_tokens)
        generator = make_generator(self.seed, prompt.device)
        sequence = torch.cat([prompt, prompt.new_zeros(max_new_tokens)])       # [L + max_new]
        length, cached, produced = prompt.shape[0], 0, 0
        cache = self.target_cache(length + max_new_tokens)
        self.drafter.reset()
        # False, True (last layer) or the layer ids a drafter reads (EAGLE-3)
        wants_hidden = (self.drafter.hidden_layers or True) if self.drafter.needs_hidden else False
        verdict, hidden = None, None
        empty = Draft(tokens=prompt.new_zeros(0))
        while produced < max_new_tokens:
            # 2. draft (paths never longer than the budget can take)
            budget = max_new_tokens - produced - 1
            draft = empty
            if budget and (hidden is not None or not wants_hidden):
                with phase(clock, "draft"):
                    context = DraftContext(sequence[:length], budget, generator, verdict, hidden)
                    draft = self.drafter.propose(context)
            # 3. one target forward over uncached context + draft, then verify
            with phase(clock, "verify"):
                uncached = sequence[cached:length]
                if draft.parents is None or not draft.size:
                    verdict, logits, hidden, slots = self._chain(uncached, draft, cache, cached,
                                                                 generator, wants_hidden)
                    cache.crop(length + verdict.accepted)
                else:
                    verdict, logits, hidden, slots = self._tree(uncached, draft, cache, cached,
                                                                generator, wants_hidden)
                    cache.keep(length, [length + slots[n] for n in verdict.nodes])
                extras = self.drafter.observe(draft, verdict, logits)
            # 4. commit, truncate at EOS, roll the drafter back to the committed prefix
            nodes = list(verdict.nodes)
            drafted_tokens = draft.tokens.tolist() if nodes else []
            emitted = [drafted_tokens[n] for n in nodes] + [verdict.next_token]
            tokens, finished = truncate_at_eos(emitted, self.eos_ids)
            cached = length + verdict.accepted
            self.drafter.commit(cached)
            sequence[length: length + len(tokens)] = torch.tensor(tokens, device=sequence.device)
            length += len(tokens)
            produced += len(tokens)
            yield self._step(tokens, draft, verdict, slots, extras)
            if finished:
                return

    def _verify(self, draft: Draft, logits: torch.Tensor,
                generator: torch.Generator) -> Verdict:
        """Chain verification: greedy match at temperature 0, else ``verify_rule``."""
        if self.sampling.greedy:
            return greedy_match(draft.tokens, logits)
        return self.verify_rule(draft.tokens, draft.probs,
                                logits_to_probs(logits, self.sampling), generator)

    def _verify_tree(self, draft: Draft, tokens: list[int], parents: list[int],
                     slot_of: list[int], logits: torch.Tensor,
                     generator: torch.Generator) -> Verdict:
        """Tree verification: greedy walk at temperature 0, else multi-round speculative sampling.

        Args: the draft's ``tokens``/``parents`` as lists, ``slot_of`` [n] (forward slot of every
        node), ``logits`` [S+1, V] (row 0 after the root, row s+1 after slot s).
        """
        if self.sampling.greedy:
            return greedy_tree(tokens, parents, slot_of, logits)
        return tree_verify(tokens, parents, slot_of, draft.probs,
                           logits_to_probs(logits, self.sampling), draft.without_replacement,
                           generator)

    def _chain(self, uncached: torch.Tensor, draft: Draft, cache: TargetCache, start: int,
               generator: torch.Generator, wants_hidden: Hidden) -> Scored:
        """Fast path for chains: plain causal forward, no 4D mask.

        Returns (verdict, logits [γ+1, V], hidden [u+accepted, H] or None, slots None): hidden
        holds the states of the u uncached committed tokens and of the accepted draft tokens.
        """
        gamma = draft.size
        inputs = torch.cat([uncached, draft.tokens])                            # [u+γ]
        logits, states = cache.chain(inputs, start, gamma + 1, wants_hidden)    # [γ+1, V]
        verdict = self._verify(draft, logits, generator)
        hidden = None
        if wants_hidden:   # rows of the uncached committed tokens and the accepted draft tokens
            hidden = states[: uncached.shape[0] + verdict.accepted]
        return verdict, logits, hidden, None

    def _tree(self, uncached: torch.Tensor, draft: Draft, cache: TargetCache, start: int,
              generator: torch.Generator, wants_hidden: Hidden) -> Scored:
        """Trees: merge duplicate draws into slots, one masked forward, walk the tree.

        Returns (verdict, logits [S+1, V], hidden [u+accepted, H] or None, slot_of [n]); hidden
        as for chains: the uncached committed tokens, then the accepted path.
        """
        tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
        slot_of, slot_tokens, slot_parents = merge_duplicates(tokens, parents)
        forest = Forest()
        root = forest.chain(uncached.tolist(), -1)[-1]
        base = len(forest.tokens)
        for token, parent in zip(slot_tokens, slot_parents):
            forest.add(token, root if parent < 0 else base + parent)
        rows = [root] + list(range(base, len(forest.tokens)))
        logits, states = cache.tree(forest.tokens, forest.parents, rows, wants_hidden)
        #                                                                         [S+1, V]
        verdict = self._verify_tree(draft, tokens, parents, slot_of, logits, generator)
        # slot s now sits at cache position start + base + s == length + s (see ``stream``)
        hidden = None
        if wants_hidden:
            keep = list(range(base)) + [base + slot_of[n] for n in verdict.nodes]
            hidden = states[keep]
        return verdict, logits, hidden, slot_of

    @staticmethod
    def _step(tokens: list[int], draft: Draft, verdict: Verdict, slots: list[int] | None,
              extras: dict[str, float] | None) -> Step:
        if draft.parents is None or not draft.size:
            return Step(tokens=tuple(tokens), drafted=draft.size, accepted=verdict.accepted,
                        draft_forwards=draft.forwards, extras=extras)
        depths = node_depths(draft.parents.tolist())
        first = {}                                  # one node per slot
        for node, slot in enumerate(slots):
            first.setdefault(slot, depths[node])
        sizes = [0] * max(depths)
        for depth in first.values():
            sizes[depth - 1] += 1
        tree = {"tree_size": float(len(first)), "tree_depth": float(len(sizes)),
                "tree_draws": float(draft.size)}
        return Step(tokens=tuple(tokens), drafted=len(first), accepted=verdict.accepted,
                    draft_forwards=draft.forwards, extras={**tree, **(extras or {})},
                    level_sizes=tuple(sizes))
