"""The union of methods a pair and an engine support (tuner.study.union): read from
conf/method's YAMLs, each composed by Hydra as ``method=<name>`` would be and validated; the rest
left out with their one line; bad lists refused in one line."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import CONF, compose_cfg
from tuner.config.errors import ConfigError
from tuner.study.union import method_names, method_union

DRAFT_METHODS = {"speculative", "block", "ouroboros", "tree", "specinfer"}


def test_the_tiny_pair_in_process_supports_every_lossless_method():
    union = method_union(compose_cfg(None, "models=tiny"))
    names = [m.name for m in union.members]
    assert set(names) == {"block", "eagle", "eagle3", "lookahead", "ouroboros", "prompt_lookup",
                          "specinfer", "speculative", "tree"}
    assert names == sorted(names)
    # MJSD's YAML samples as its paper (T 1): not comparable with a greedy study, said so
    [(name, why)] = union.left_out
    assert name == "mjsd" and "set sampling=... to compare them" in why
    spec = next(m for m in union.members if m.name == "speculative")
    assert spec.method["_target_"] == "decoding.speculative.SpeculativeDecoding"
    assert spec.cfg.models.target.kind == "tiny"          # the study's own overrides kept


def test_a_method_whose_draft_model_is_missing_is_left_out_with_its_line():
    union = method_union(compose_cfg(None, "models=tiny", "~models.draft"))
    assert {m.name for m in union.members} == {"eagle", "eagle3", "lookahead", "prompt_lookup"}
    why = dict(union.left_out)
    assert DRAFT_METHODS <= set(why)
    assert all("this method needs a draft model" in why[n] for n in DRAFT_METHODS)
    assert all("\n" not in line for line in union.lines())


def test_a_method_added_as_a_yaml_joins_the_union_with_no_other_edit(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    text = (conf / "method" / "speculative.yaml").read_text().replace("high: 16", "high: 5")
    (conf / "method" / "spec_short.yaml").write_text(text)
    assert "spec_short" in method_names(conf)
    union = method_union(compose_cfg(None, "models=tiny"), conf=conf)
    [added] = [m for m in union.members if m.name == "spec_short"]
    assert added.method["space"]["num_draft_tokens"]["high"] == 5
    assert "spec_short" not in method_names()              # the repository's conf untouched


@pytest.mark.parametrize("names,message", [
    (["speculative", "nope"], "methods=['speculative', 'nope'] is invalid: nope is not a "
                              "method; allowed are a list of ['block',"),
    ([], "methods=[] is invalid: none is not a method"),
])
def test_a_bad_list_of_methods_gets_one_line(names, message):
    with pytest.raises(ConfigError) as err:
        method_union(compose_cfg(None, "models=tiny"), names)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_list_with_no_supported_method_gets_one_line():
    with pytest.raises(ConfigError) as err:
        method_union(compose_cfg(None, "models=tiny", "~models.draft"), ["speculative", "block"])
    line = str(err.value)
    assert line.startswith("methods=['speculative', 'block'] is invalid here: none is supported "
                           "by these models and this engine (speculative: models.draft=None")
    assert "\n" not in line


def test_llamacpp_offers_a_draft_model_and_its_ngram_lookup():
    from tests.helpers.services import require_llama_server
    require_llama_server()
    union = method_union(compose_cfg(None, "engine=llamacpp", "models=smollm2"))
    assert [m.name for m in union.members] == ["prompt_lookup", "speculative"]
    why = dict(union.left_out)
    assert why["ouroboros"].startswith("method=ouroboros is not offered by engine=llamacpp")
