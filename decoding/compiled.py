"""The target compiled at a few static shapes: a preallocated KV cache, forwards padded to buckets.

Eager decoding pays the framework's per-operator overhead on every forward (Python, dispatch, on a
GPU one kernel launch per op); deployed engines run compiled graphs instead (CUDA graphs in vLLM
and SGLang, gpt-fast's compiled static-cache decode step). ``CompiledTarget`` gives this project's
loops the same footing, opt-in (``DecodingMethod.use_compiled``):

  * the KV cache is a ``transformers.StaticCache`` of ``capacity`` positions, allocated once and
    reused by every generation (no growth, no copies; rejected rows are simply overwritten later);
  * every forward of n ≤ max(buckets) tokens is padded to the smallest bucket ≥ n and runs the
    target's decoder through ``torch.compile(dynamic=False)``: one graph per bucket, compiled on
    its first call (``warm`` compiles them all before anything is timed) and reused across
    prompts, trials and prompt lengths, since positions, cache slots and the attention mask are
    tensors of fixed shape ([b], [b], [1, 1, b, capacity]); forwards longer than the largest
    bucket (the prompt's prefill, very large trees) run the same decoder eagerly;
  * the LM head runs eagerly on exactly the rows a verifier needs (the padded rows never reach it);
  * on CUDA the default mode is ``reduce-overhead`` (CUDA graphs); on a CPU inductor freezes the
    weights into the graphs (the model must not be trained while a ``CompiledTarget`` uses it).

Why padding and stale rows are harmless: a forward writes its b rows at cache slots
``length .. length+b−1``; a real query row sees only committed rows (< length, all written in this
generation) and rows of its own forward (its causal prefix, or its tree ancestors). A padded row
writes junk after the real rows; no later query can see that slot before a later forward wrote
it again. So the cache is never cleared, and the rows equal the eager path's up to the compiled
kernels' rounding (``tests/test_compiled.py`` checks identical tokens at temperature 0).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import torch
from transformers import StaticCache

from decoding.runtime import cache_argument
from decoding.tree import tree_inputs

if TYPE_CHECKING:
    from torch import nn

    from decoding.target_cache import Hidden

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)
# one graph per bucket and per CompiledTarget share one code object (``_decode``): let dynamo
# keep enough of them (its default of 8 would silently fall back to eager after 8)
RECOMPILE_LIMIT = 64


class CompiledTarget:
    """The target with a static KV cache and its decoder compiled per shape bucket.

    Implements ``decoding.target_cache.TargetCache`` for one generation at a time (``start``).

    Args:
        model: a causal LM whose logits are its output embedding applied to the decoder's last
            hidden state (``get_decoder`` / ``get_output_embeddings``; no logit soft-capping).
        capacity: cache positions (prompt + generated + the largest forward's padding must fit).
        buckets: forward lengths compiled (ascending positive integers; 1 = plain decoding).
        mode: ``torch.compile`` mode; default ``reduce-overhead`` on CUDA, inductor's default else.
    """

    def __init__(self, model: nn.Module, capacity: int,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, mode: str | None = None) -> None:
        self.buckets = check_buckets(buckets)
        if isinstance(capacity, bool) or not isinstance(capacity, int) \
                or capacity <= self.buckets[-1]:
            raise ValueError(f"capacity={capacity!r} is invalid: allowed is an integer > the "
                             f"largest bucket ({self.buckets[-1]})")
        for name in ("final_logit_softcapping", "logit_scale"):
            if getattr(model.config, name, None):
                raise ValueError(f"{type(model).__name__} sets {name}: the compiled target "
                                 f"applies the plain output embedding, so it cannot run it")
        self.model, self.capacity = model, capacity
        self.device = next(model.parameters()).device
        self.dtype = model.dtype
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self._cache_kw = cache_argument(self.decoder, self.cache)   # looked up outside graphs
        self.mode = mode if mode is not None else \
            ("reduce-overhead" if self.device.type == "cuda" else None)
        import torch._dynamo        # here: importing dynamo costs every process ~2-3 s
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   RECOMPILE_LIMIT)
        # on a CPU, inductor's freezing folds the weights into the graph as constants and
        # prepacks them for its matmul kernels (measured 1.15× vs 1.08× unfrozen on SmolLM2-135M
        # decode, bench/compiled.py); ``mode`` and ``options`` exclude each other
        options = {"freezing": True} if self.mode is None and self.device.type == "cpu" else None
        self._compiled = torch.compile(self._decode, dynamic=False, mode=self.mode,
                                       options=options)
        self.compile_s: dict[int, float] = {}   # bucket -> seconds of its first (compiling) call
        self.eager_forwards = 0                 # forwards longer than the largest bucket
        self.length = 0                         # positions of this generation held in the cache
        self._slots = torch.arange(capacity, device=self.device)            # [capacity]
        with torch.inference_mode():      # allocate the cache's tensors now, outside any graph
            self._decode(self._slots[:1].clone(), self._slots[:1].clone(),
                         self._slots[:1].clone(), self._causal(0, 1))
        # transformers ≥ 5.x's static layers write at their own counter and ignore
        # ``cache_position``: each forward first sets it to the slot it writes at (in place: the
        # tensor's address is static)
        self._counters = [layer.cumulative_length for layer in self.cache.layers
                          if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]

    # -- lifecycle ----------------------------------------------------------------------------

    @torch.inference_mode()
    def warm(self) -> dict[int, float]:
        """Compile every bucket not compiled yet (a forward at the cache's last slots, which no
        generation sees before writing them); returns bucket -> compile seconds."""
        for bucket in self.buckets:
            if bucket not in self.compile_s:
                start = self.capacity - bucket
                ids = torch.zeros(bucket, dtype=torch.long, device=self.device)
                slots = self._slots[start:].clone()
                self._run(ids, slots, slots, self._causal(start, bucket))
        self.length = 0
        return dict(self.compile_s)

    def start(self, total_len: int) -> CompiledTarget:
        """Begin a generation of at most ``total_len`` positions (prompt + new tokens)."""
        if total_len + self.buckets[-1] > self.capacity:
            raise ValueError(f"a generation of {total_len} positions does not fit the compiled "
                             f"target's cache: capacity={self.capacity} must hold it plus the "
                             f"largest bucket ({self.buckets[-1]})")
        self.length = 0
        return self

    # -- TargetCache --------------------------------------------------------------------------

    def chain(self, input_ids: torch.Tensor, start: int, num_logits: int, hidden: Hidden
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_last_layer_only(hidden)
        n = int(input_ids.shape[0])
        states = self._forward(input_ids, start, None, lambda b: self._causal(start, b))
        self.length = start + n
        return self.head(states[n - num_logits: n]), (states[:n] if hidden else None)

    def tree(self, tokens: Sequence[int], parents: Sequence[int], rows: Sequence[int],
             hidden: Hidden) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_last_layer_only(hidden)
        prefix, q = self.length, len(tokens)
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        mask, positions = tree_inputs(parents, prefix, self.dtype, self.device)
        # mask [1, 1, q, prefix+q], positions [q] (prefix + depth)

        def full_mask(bucket: int) -> torch.Tensor:                   # [1, 1, bucket, capacity]
            out = self._causal(prefix, bucket)
            out[..., :q, : prefix + q] = mask
            return out

        states = self._forward(ids, prefix, positions, full_mask)
        self.length = prefix + q
        keep = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        return self.head(states.index_select(0, keep)), (states[:q] if hidden else None)

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)    # rows after it are overwritten before seen

    def keep(self, prefix: int, rows: Sequence[int]) -> None:
        rows = list(rows)
        if rows and rows != list(range(prefix, prefix + len(rows))):
            source = torch.tensor(rows, dtype=torch.long, device=self.device)
            for layer in self.cache.layers:
                for tensor in (layer.keys, layer.values):              # [1, heads, capacity, d]
                    tensor[..., prefix: prefix + len(rows), :] = tensor.index_select(-2, source)
        self.length = prefix + len(rows)

    # -- the forward --------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, start: int, positions: torch.Tensor | None,
                 mask_for) -> torch.Tensor:
        """Feed ``ids`` ([n]) at cache slots start.. (RoPE ``positions`` [n], default = slots);
        returns the decoder's last hidden states [n, H]."""
        n = int(ids.shape[0])
        bucket = next((b for b in self.buckets if b >= n), n)
        if start + bucket > self.capacity:
            raise ValueError(f"a forward of {n} tokens at position {start} does not fit the "
                             f"compiled target's cache of {self.capacity} positions: raise "
                             f"capacity")
        # a fresh tensor, not a view of ``_slots``: the compiled graph must not depend on the
        # storage offset (a view compiled at one offset read out of bounds at another)
        slots = self._slots[start: start + bucket].clone()                      # [b]
        # pad with token 0 at the next slots' own positions; always a fresh tensor made under
        # inference mode (a caller's ordinary tensor has other dispatch keys: a recompile)
        ids = torch.cat([ids, ids.new_zeros(bucket - n)])
        if positions is not None and bucket > n:
            positions = torch.cat([positions, slots[n:]])
        return self._run(ids, slots, slots if positions is None else positions,
                         mask_for(bucket))[:n]

    def _run(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
        bucket = int(ids.shape[0])
        for counter in self._counters:
            counter.fill_(slots[0])
        if bucket not in self.buckets:
            self.eager_forwards += 1
            return self._decode(ids, slots, positions, mask)
        if bucket in self.compile_s:
            states = self._compiled(ids, slots, positions, mask)
        else:
            began = time.perf_counter()
            states = self._compiled(ids, slots, positions, mask)
            self.compile_s[bucket] = time.perf_counter() - began
        # CUDA graphs reuse their output buffers on the next replay: keep a copy
        return states.clone() if self.mode == "reduce-overhead" else states

    def _decode(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """ids [b], slots [b] (cache positions written), positions [b] (RoPE), mask
        [1, 1, b, capacity] additive -> last hidden states [b, H]."""
        out = self.decoder(input_ids=ids[None], attention_mask=mask,
                           position_ids=positions[None], cache_position=slots, use_cache=True,
                           **self._cache_kw)
        return out.last_hidden_state[0]

    def _causal(self, start: int, bucket: int) -> torch.Tensor:
        """Additive mask [1, 1, bucket, capacity]: row i sees slots 0..start+i."""
        visible = self._slots[None] <= self._slots[start: start + bucket, None]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible, torch.finfo(self.dtype).min)[None, None]


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """Buckets as a tuple: positive integers, strictly ascending, at least one."""
    values = tuple(buckets) if isinstance(buckets, (list, tuple)) else None
    if not values or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values) \
            or list(values) != sorted(set(values)):
        raise ValueError(f"buckets={buckets!r} is invalid: allowed is a non-empty list of "
                         f"strictly ascending integers >= 1, e.g. [1, 2, 4, 8, 16, 32]")
    return values


def check_last_layer_only(hidden: Hidden) -> None:
    """The compiled decoder returns its last layer's states only (EAGLE-1/2 features)."""
    if hidden not in (True, False):
        raise ValueError(f"the compiled target returns only the last layer's states, not layers "
                         f"{list(hidden)} (an EAGLE-3 head's): run EAGLE-3 eagerly "
                         "(engine.compile=false)")
