"""Decode-phase timing: the prefill (time to the first token) apart from the decode phase, and the
paired speedup of the decode phase alone (``decode_speedup``), in process and in engines."""

from __future__ import annotations

import re

import pytest

from decoding import build_method, generate
from tests.conftest import load_study, run_study, tiny_pair
from tuner.measure.measurement import Measurement, paired_decode_speedup, paired_speedup

PROMPT = [5, 9, 2, 7, 1, 3, 8, 4, 6, 2, 9, 1]


def test_the_first_step_is_timed_apart_from_the_rest():
    """Vanilla's first step emits one token; speculative decoding with the target as its own
    draft accepts all γ drafts of its first step, so that step emits γ + 1."""
    pair = tiny_pair("same")
    for name, kw, first in (("vanilla", {}, 1), ("speculative", {"num_draft_tokens": 3}, 4)):
        out = generate(build_method(name, pair, **kw), PROMPT, 20)
        assert out.stats.first_step_tokens == first, name
        assert 0 < out.stats.first_step_s <= out.stats.draft_time_s + out.stats.verify_time_s


def measurement(wall_s: float, prompt_s: float | None, tokens: int = 10, **kw) -> Measurement:
    return Measurement("p", "c", tuple(range(tokens)), "", wall_s, tokens, 0, 0, 0.0, 0.0, (),
                       (), prompt_s=prompt_s,
                       decode_s=None if prompt_s is None else wall_s - prompt_s,
                       decode_tokens=tokens - 1, **kw)


def test_the_decode_speedup_leaves_the_prefill_out():
    """A long prompt: 9 s of prefill on both sides; the method halves the decode phase. End to
    end that reads 1.05x, the decode phase 2x."""
    vanilla, method = measurement(10.0, 9.0), measurement(9.5, 9.0)
    assert paired_speedup(vanilla, method) == pytest.approx(10 / 9.5)
    assert paired_decode_speedup(vanilla, method) == pytest.approx(2.0)
    assert paired_decode_speedup(vanilla, measurement(9.5, None)) is None   # not timed
    one = measurement(2.0, 1.0, tokens=1)                   # nothing after the first token
    assert one.decode_s_per_token is None and paired_decode_speedup(one, one) is None


def test_a_study_can_optimise_the_decode_phase(tmp_path, in_tmp, capsys):
    """search.objectives=[decode_speedup] with the pruner fed per prompt and the baseline kept
    once per study: every trial's value is its decode-phase speedup, recorded beside the
    end-to-end one, and the summary names which one the winner was chosen by."""
    run_study(tmp_path, "search=grid", "search.n_trials=2", "tracking=none",
              "search.objectives=[decode_speedup]", "baseline=per_study",
              "+search.pruner={_target_:optuna.pruners.MedianPruner,n_startup_trials:5}")
    out = capsys.readouterr().out
    trials = load_study(tmp_path).trials
    assert len(trials) == 2
    for t in trials:
        figures = t.user_attrs
        assert t.value == pytest.approx(figures["decode_speedup"])
        assert figures["speedup"] > 0 and figures["ttft_ms"] > 0
        assert t.intermediate_values                     # the pruner was fed
    assert "paired decode-phase speedup (prefill left out)" in out
    assert re.search(r"prompt 1/2: .*paired speedup [0-9.]+ \(decode phase [0-9.]+\)", out)
    assert "decode-phase speedup (tuning)" in out and "held-out decode-phase speedup" in out


def test_the_pruner_takes_the_decode_speedup_but_no_other_objective():
    from tests.conftest import compose_cfg
    from tuner.config.errors import ConfigError
    from tuner.study.settings import StudySettings
    pruner = "+search.pruner={_target_:optuna.pruners.MedianPruner}"
    StudySettings.from_config(compose_cfg(None, "search.objectives=[decode_speedup]", pruner))
    with pytest.raises(ConfigError, match=r"allowed is objectives=\[speedup\] or "
                                          r"\[decode_speedup\], or pruner=null"):
        StudySettings.from_config(compose_cfg(None, "search.objectives=[tokens_per_s]", pruner))
