"""Deliberately wrong variants of the real rules, made by mutating the production source.

A law test that cannot tell a wrong rule from the right one proves nothing. The wrong variants
here are not rules written in a test: each ``Mutation`` names one function of ``decoding`` and one
piece of its source, and ``mutated`` compiles the function with that piece replaced (the classic
mutation-testing operators: a relational operator flipped, a subtraction dropped, an index off by
one) and swaps the new code into the function object itself, so every caller, including the
``staticmethod`` references the methods hold, runs the mutant until the ``with`` block ends.

If the production source changes so that a mutation no longer applies (the piece is gone or
occurs twice), ``mutated`` fails loudly instead of silently testing the right rule.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    """Replace ``old`` by ``new`` (each exactly once) in ``module``.``function``'s source
    (``function`` may be ``Class.method``)."""

    module: str
    function: str
    old: str
    new: str
    why: str                     # what the mutant gets wrong, in the rule's own terms


MUTATIONS = {
    # after a rejection, resample from p instead of the residual norm(max(p − q, 0)): the classic
    # speculative-sampling bug; used by token verification and every tree/sibling round
    "residual-is-p": Mutation(
        "decoding.verify", "normalized_residual",
        "torch.clamp(target_rows - draft_rows, min=0.0)", "target_rows.clone()",
        "a rejected position draws from p, not from norm(max(p - q, 0))"),
    # block verification's residual without the draft subtracted: norm(w·p) = p
    "block-residual-is-p": Mutation(
        "decoding.verify", "bv_residuals",
        "torch.clamp(scaled - draft_rows, min=0.0)", "target_probs[:gamma].clone()",
        "block verification's stop draws from p, not from norm(max(w p - q, 0))"),
    # token verification's coin flipped: accept with probability 1 − min(1, p/q)
    "token-coin-flipped": Mutation(
        "decoding.verify", "token_verify", "(u * q_x < p_x)", "(u * q_x > p_x)",
        "a draft token passes with probability 1 - min(1, p/q)"),
    # block verification's coin flipped: position i passes when η > h_i
    "block-coin-flipped": Mutation(
        "decoding.verify", "block_verify", "eta < thresholds", "eta > thresholds",
        "position i passes with probability 1 - h_i"),
    # sampled siblings: i.i.d. drawn without replacement (and the reverse)
    "siblings-replacement-flipped": Mutation(
        "decoding.token_tree", "TreeDrafter._children",
        'replacement=self.siblings == "iid"', 'replacement=self.siblings != "iid"',
        "i.i.d. siblings are drawn without replacement"),
    # inverting the CDF one token too far (clamped to the last token of positive probability)
    "cdf-off-by-one": Mutation(
        "decoding.sampling", "invert_cdf", "right=True).squeeze(1)", "right=True).squeeze(1) + 1",
        "each draw returns the token after the one whose CDF interval holds u"),
}


@contextlib.contextmanager
def mutated(name: str) -> Iterator[Mutation]:
    """Run ``decoding`` with the mutation ``name`` applied, and restore the function after."""
    mutation = MUTATIONS[name]
    function = importlib.import_module(mutation.module)
    for attribute in mutation.function.split("."):                 # a method: Class.method
        function = getattr(function, attribute)
    source = textwrap.dedent(inspect.getsource(function))
    count = source.count(mutation.old)
    assert count == 1, (f"mutation {name!r}: {mutation.old!r} occurs {count} times in "
                        f"{mutation.module}.{mutation.function}; update tests/helpers/mutations.py")
    scope: dict = {}
    exec(compile(source.replace(mutation.old, mutation.new), f"<mutant {name}>", "exec"),
         dict(function.__globals__), scope)
    original = function.__code__
    function.__code__ = scope[mutation.function.rsplit(".", 1)[-1]].__code__
    try:
        yield mutation
    finally:
        function.__code__ = original
