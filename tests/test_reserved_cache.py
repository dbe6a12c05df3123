"""``decoding.reserved_cache``: a KV cache written in place must hold exactly what transformers'
own ``DynamicCache`` holds after the same appends, rollbacks and kept tree rows, and must not copy
its storage on a step that fits (the point of it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache, DynamicLayer, MistralConfig, Qwen2Config

from decoding.reserved_cache import MIN_RESERVATION, ReservedLayer, reserved_cache
from decoding.runtime import crop_cache, forward_logits, new_cache
from decoding.tree import keep_cache_rows
from tests.conftest import tiny_pair
from tests.helpers.methods import PROMPTS

HEADS, DIM = 2, 4


def rows(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, HEADS, count, DIM)                                    # [B, H_kv, n, D]
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def keep_dynamic(layer: DynamicLayer, prefix: int, extra: list[int]) -> None:
    """What ``keep_cache_rows`` does to a plain ``DynamicLayer``: the reference for ``keep``."""
    index = torch.tensor(extra, dtype=torch.long)
    layer.keys = torch.cat([layer.keys[..., :prefix, :], layer.keys.index_select(-2, index)], -2)
    layer.values = torch.cat([layer.values[..., :prefix, :],
                              layer.values.index_select(-2, index)], -2)


@pytest.mark.parametrize("capacity", [0, 3, 40])
@pytest.mark.parametrize("seed", range(4))
def test_random_appends_crops_and_keeps_equal_a_dynamic_layer(capacity, seed):
    generator = torch.Generator().manual_seed(seed)
    reserved, dynamic = ReservedLayer(capacity), DynamicLayer()
    peak = 0
    for _ in range(80):                  # like decoding: mostly appends, short rollbacks and keeps
        action = int(torch.randint(4, (), generator=generator))
        length = dynamic.get_seq_length()
        if action < 2 or length < 2:                        # append 1..9 rows
            keys, values = rows(int(torch.randint(1, 10, (), generator=generator)), generator)
            got = reserved.update(keys, values)
            want = dynamic.update(keys, values)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        elif action == 2:                                   # roll back 1..6 rows
            drop = int(torch.randint(1, min(length, 7), (), generator=generator))
            reserved.crop(-drop)
            dynamic.crop(-drop)
        else:                                               # keep a prefix and some later rows
            prefix = int(torch.randint(max(0, length - 8), length, (), generator=generator))
            later = torch.randperm(length - prefix, generator=generator)[
                : int(torch.randint(length - prefix + 1, (), generator=generator))]
            extra = sorted(int(i) + prefix for i in later)
            reserved.keep(prefix, extra)
            keep_dynamic(dynamic, prefix, extra)
        assert reserved.get_seq_length() == dynamic.get_seq_length()
        assert torch.equal(reserved.keys, dynamic.keys)
        assert torch.equal(reserved.values, dynamic.values)
        peak = max(peak, reserved.length)
    assert peak > 60                                        # past every reservation but 0's
    assert reserved.key_storage.shape[-2] >= max(capacity, peak)


def test_a_step_that_fits_writes_in_place_and_a_larger_one_grows_the_storage():
    generator = torch.Generator().manual_seed(0)
    layer = ReservedLayer(16)
    layer.update(*rows(10, generator))
    storage = layer.key_storage.data_ptr()
    for _ in range(6):                                      # 10 + 6 rows = the reservation
        layer.update(*rows(1, generator))
        assert layer.key_storage.data_ptr() == storage      # no copy of the cache per step
        assert layer.keys.data_ptr() == storage             # the model reads the storage itself
    before = layer.keys.clone()
    layer.update(*rows(1, generator))                       # one row more than reserved
    assert layer.key_storage.shape[-2] == 32 and layer.length == 17
    assert torch.equal(layer.keys[..., :16, :], before)
    unreserved = ReservedLayer()
    unreserved.update(*rows(3, generator))
    assert unreserved.key_storage.shape[-2] == MIN_RESERVATION


def test_crop_takes_dynamic_layers_sign_convention():
    layer = ReservedLayer(8)
    layer.update(*rows(4, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match=r"crop\(2\) is not supported: give a negative count"):
        layer.crop(2)
    layer.crop(-10)
    assert layer.get_seq_length() == 0 and layer.keys.shape[-2] == 0


def test_keep_refuses_rows_it_does_not_hold_and_beam_edits_are_refused():
    layer = ReservedLayer(16)
    layer.update(*rows(6, torch.Generator().manual_seed(0)))
    for prefix, extra in ((7, []), (3, [2, 4]), (3, [4, 6])):
        with pytest.raises(ValueError, match=rf"keep\(prefix={prefix}, rows=.*\) is invalid: "
                                             r"allowed is a prefix <= 6 and rows in \[prefix, 6\)"):
            layer.keep(prefix, extra)
    assert layer.get_seq_length() == 6
    for edit in (lambda: layer.reorder_cache(torch.tensor([0])),
                 lambda: layer.batch_select_indices(torch.tensor([0])),
                 lambda: layer.batch_repeat_interleave(2), layer.offload):
        with pytest.raises(NotImplementedError, match="beam reordering, batch edits and "
                                                      "offloading are not supported"):
            edit()


def test_mixed_layer_kinds_keep_their_sliding_window_layers():
    config = Qwen2Config(num_hidden_layers=3, hidden_size=16, intermediate_size=32,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=32,
                         use_sliding_window=True, sliding_window=8,
                         layer_types=["full_attention", "sliding_attention", "full_attention"])
    kinds = [type(layer) for layer in reserved_cache(SimpleNamespace(config=config), 32).layers]
    plain = [type(layer) for layer in DynamicCache(config=config).layers]
    assert plain[1] is not DynamicLayer
    assert kinds == [ReservedLayer, plain[1], ReservedLayer]


def test_only_full_attention_layers_are_reserved():
    config = MistralConfig(num_hidden_layers=3, hidden_size=16, intermediate_size=32,
                           num_attention_heads=2, num_key_value_heads=1, vocab_size=32,
                           sliding_window=8)
    cache = reserved_cache(SimpleNamespace(config=config), 64)
    plain = DynamicCache(config=config)
    assert [type(layer) for layer in cache.layers] == [type(layer) for layer in plain.layers]
    assert not any(isinstance(layer, ReservedLayer) for layer in cache.layers)
    config.sliding_window = None
    cache = reserved_cache(SimpleNamespace(config=config), 64)
    assert all(type(layer) is ReservedLayer and layer.capacity == 64 for layer in cache.layers)


def test_model_logits_equal_those_over_a_dynamic_cache():
    """A tiny llama decoding with rollbacks and kept rows: same logits as with ``DynamicCache``."""
    model = tiny_pair("related").target
    prompt = torch.tensor(PROMPTS[1])
    ours, theirs = new_cache(model, len(prompt) + 4), DynamicCache(config=model.config)
    assert all(isinstance(layer, ReservedLayer) for layer in ours.layers)
    with torch.inference_mode():
        for cache in (ours, theirs):
            forward_logits(model, prompt[None], cache, 0, 1)
        length = len(prompt)
        for step in range(12):                              # feed 3, keep 1 or 2 of them
            fed = torch.tensor([(7 * step + j) % 200 + 5 for j in range(3)])
            got = forward_logits(model, fed[None], ours, length, 3)
            want = forward_logits(model, fed[None], theirs, length, 3)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
            if step % 2:
                crop_cache(ours, length + 1)
                crop_cache(theirs, length + 1)
                length += 1
            else:
                keep_cache_rows(ours, length, [length + 1, length + 2])
                keep_cache_rows(theirs, length, [length + 1, length + 2])
                length += 2
        assert ours.layers[0].key_storage.shape[-2] > len(prompt) + 4   # it grew on the way
