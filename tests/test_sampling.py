"""The sampling warps (``decoding.sampling.warp_logits``) against an independent, well-kept
implementation: transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
``TopPLogitsWarper`` (``tests/helpers/laws.reference_probs``, which the law tests also use as
their reference), on random logits and on tie-heavy ones, where the project's rule keeps tied
tokens together at the top-p boundary."""

from __future__ import annotations

import itertools

import pytest
import torch

from decoding.sampling import SamplingConfig, logits_to_probs, warp_logits
from tests.helpers.laws import reference_probs

VOCAB = 40
SETTINGS = [SamplingConfig(temperature=t, top_k=k, top_p=p) for t, k, p in itertools.product(
    (0.4, 1.0, 1.7), (0, 1, 3, VOCAB - 1, VOCAB), (1.0, 0.95, 0.6, 0.2, 0.01))]


def random_logits(seed: int, ties: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if ties:        # five distinct values: nearly every boundary falls inside a tie
        return torch.randint(-2, 3, (256, VOCAB), generator=generator).float()
    return torch.randn(256, VOCAB, generator=generator) * 3


@pytest.mark.parametrize("ties", [False, True], ids=["random", "tie-heavy"])
def test_the_warps_equal_transformers_processors(ties):
    logits = random_logits(7, ties)
    for cfg in SETTINGS:
        ours = logits_to_probs(logits, cfg)
        reference = reference_probs(logits, cfg)
        kept, expected = ours > 0, reference > 0
        assert torch.equal(kept, expected), (cfg, (kept != expected).nonzero()[:5])
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-7)


def test_tie_heavy_logits_really_put_ties_on_the_top_p_boundary():
    """Where transformers keeps one of several tied tokens by sort position, the warp keeps all
    of them (so the law does not depend on a sort's order): the tie-heavy case above tests that,
    not only tie-free rows."""
    from transformers import TopPLogitsWarper
    logits = random_logits(7, True)
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=0.6)
    by_position = TopPLogitsWarper(0.6)(torch.zeros((256, 1), dtype=torch.long), logits.clone())
    ours = warp_logits(logits, cfg)
    split = (by_position > float("-inf")) != (ours > float("-inf"))
    assert split.any(dim=-1).sum() > 10            # rows where a sort split a tie
    for row in split.any(dim=-1).nonzero().flatten():
        kept_values = set(logits[row][ours[row] > float("-inf")].tolist())
        assert set(logits[row][split[row]].tolist()) <= kept_values   # the whole tie is kept


def test_greedy_is_the_argmax_one_hot():
    logits = random_logits(3, False)
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.0))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.all(probs.sum(-1) == 1)


def test_a_token_behind_exactly_top_p_of_the_mass_is_dropped():
    """The boundary itself (random logits never land on it): tokens kept while the strictly more
    likely ones hold *less* than top_p; at exactly top_p the next tie group goes."""
    logits = torch.tensor([[0.0, 0.0, -1.0, -1.0, -3.0]])
    probs = torch.softmax(logits, dim=-1)
    ahead = float((probs[0, 0] + probs[0, 1]).item())        # the float32 mass of the first tie
    at = warp_logits(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=ahead))
    assert (at > float("-inf")).tolist() == [[True, True, False, False, False]]
    above = warp_logits(logits, SamplingConfig(temperature=1.0, top_k=0,
                                               top_p=min(1.0, ahead + 1e-6)))
    assert (above > float("-inf")).tolist() == [[True, True, True, True, False]]
