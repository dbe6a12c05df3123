"""The end-to-end law cases: each lossless method's first two sampled tokens against the target's
exact law, and the mutant of the real rule each case must reject at the same draws.

Used by tests/test_methods.py, tests/test_prompt_lookup.py and tests/test_eagle.py, and by
``python -m tests.helpers.law_power``, which states every case's power (docs/verification.md
§0.4).

A case is one method setting on one tiny fp32 pair, one prompt and one sampling setting; it is run
with seeds 0..draws−1 (``laws.pair_counts``), so its outcome is fixed for a given torch build: the
right rule must give p > ``laws.ALPHA``, the mutant p < ``laws.ALPHA``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from decoding import METHODS, build_method
from decoding.sampling import SamplingConfig
from decoding.verify import block_verify
from tests.conftest import tiny_pair
from tests.helpers.laws import ChiSquare, pair_chi_square, pair_counts, two_token_law
from tests.helpers.methods import CONFIGS
from tests.helpers.mutations import mutated

SAMPLINGS = {"t1": dict(temperature=1.0), "topk": dict(temperature=0.7, top_k=5),
             "topp": dict(temperature=1.3, top_p=0.8)}


@dataclass(frozen=True)
class LawCase:
    """One end-to-end law check.

    ``kw``: the method's hyperparameters and sampling; ``pair``: tiny-model options;
    ``mutation``: the name in ``tests.helpers.mutations.MUTATIONS`` of the wrong rule this case
    must also reject (None: the case's right rule only; its method has a mutant case beside it);
    ``filled_pool``: lookahead starts with every key's phrases in its pool (else its first two
    tokens are sampled before the pool holds anything to draft); ``drafts_every_draw``: every
    generation must have drafted (the law is checked with drafts in play in each draw).
    """

    id: str
    method: str
    kw: dict
    prompt: tuple[int, ...] = (3, 1, 4)
    pair: dict = field(default_factory=lambda: dict(vocab_size=12, initializer_range=0.3))
    draws: int = 800
    new_tokens: int = 3
    mutation: str | None = None
    filled_pool: bool = False
    drafts_every_draw: bool = False

    @property
    def sampling(self) -> SamplingConfig:
        keys = ("temperature", "top_k", "top_p")
        return SamplingConfig(**{k: v for k, v in self.kw.items() if k in keys})


def mutation_for(method: str) -> str:
    """The wrong rule a method's law case must reject: block verification's residual for block
    verification, else the token/sibling residual every other lossless rule resamples from."""
    rule = getattr(METHODS[method], "verify_rule", None)
    return "block-residual-is-p" if rule is block_verify else "residual-is-p"


def method_cases() -> list[LawCase]:
    """tests/test_methods.py: every lossless method at each sampling its YAML lists (default all
    three), on its YAML's ``test_params``; the first sampling of each method also runs its
    mutant."""
    cases = []
    for name, cfg in CONFIGS.items():
        if name == "vanilla" or not cfg.get("lossless", True):
            continue
        for number, sid in enumerate(cfg.get("test_samplings", list(SAMPLINGS))):
            kw = {**(cfg.get("test_params") or {}), **SAMPLINGS[sid]}
            pool = name == "lookahead"               # drafts from the first step on
            cases.append(LawCase(f"{name}-{sid}", name, kw, filled_pool=pool,
                                 drafts_every_draw=pool,
                                 mutation=mutation_for(name) if number == 0 else None))
    return cases


def prompt_lookup_cases() -> list[LawCase]:
    """The prompt ends in a repeated n-gram, so the first step verifies a draft (a chain or a trie
    of point masses) and emits both tokens in most draws."""
    common = dict(prompt=(4, 0, 5, 4, 0, 3, 4, 0), pair=dict(vocab_size=6, initializer_range=0.3),
                  draws=800, new_tokens=2, drafts_every_draw=True, mutation="residual-is-p")
    sampling = dict(temperature=0.9, top_k=4)
    return [LawCase("chain", "prompt_lookup", dict(num_draft_tokens=2, **sampling), **common),
            LawCase("trie", "prompt_lookup", dict(num_draft_tokens=2, num_matches=3, **sampling),
                    **common)]


def eagle_cases() -> list[LawCase]:
    """Token 2 comes from the first tree step (token 1 from the prefill; a budget of 3 leaves a
    depth-1 tree: two siblings drawn without replacement, or EAGLE-2's top-3 point masses)."""
    common = dict(pair=dict(vocab_size=6, initializer_range=0.3), draws=700,
                  mutation="residual-is-p")
    sampling = dict(temperature=1.0, head="random:4")
    return [LawCase("without", "eagle", dict(shape=(2, 1), siblings="without", **sampling),
                    **common),
            LawCase("dynamic", "eagle", dict(width=3, total_tokens=3, **sampling), **common)]


@contextlib.contextmanager
def filled_pool(vocab: int, guess_set: int) -> Iterator[None]:
    """Lookahead's per-generation pool starts with ``guess_set`` one-token phrases for every key
    (tokens key+1 … key+guess_set mod V), so every step verifies a trie of point masses."""
    import decoding.lookahead as lookahead
    empty = lookahead.PhrasePool

    class Filled(empty):
        def __init__(self, capacity: int) -> None:
            super().__init__(capacity)
            self.insert_all((key, [(key + j) % vocab]) for key in range(vocab)
                            for j in range(1, guess_set + 1))

    lookahead.PhrasePool = Filled
    try:
        yield
    finally:
        lookahead.PhrasePool = empty


def run(case: LawCase, mutation: str | None = None) -> ChiSquare:
    """Sample the case (under ``mutation`` where given) and test it against the exact law."""
    pair = tiny_pair("related", **case.pair)
    law = two_token_law(pair.target, list(case.prompt), case.sampling)
    method = build_method(case.method, pair, **case.kw)
    drafted = []
    with contextlib.ExitStack() as stack:
        if case.filled_pool:
            stack.enter_context(filled_pool(case.pair["vocab_size"], case.kw["guess_set"]))
        if mutation is not None:
            stack.enter_context(mutated(mutation))
        counts = pair_counts(method, list(case.prompt), case.draws, case.new_tokens,
                             check=lambda out: drafted.append(out.stats.drafted))
    assert not case.drafts_every_draw or min(drafted) >= 1, (case.id, drafted.count(0))
    return pair_chi_square(counts, law)

