"""Decode-phase timing: the prefill (time to the first token) apart from the decode phase, and the
paired speedup of the decode phase alone (``decode_speedup``), in process and in engines."""

from __future__ import annotations

import re

import pytest

from decoding import build_method, generate
from tests.conftest import load_study, run_study, tiny_pair
from tuner.measure.measurement import Measurement, paired_decode_speedup, paired_speedup
from decoding.acceptance import AcceptanceCounts

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
    return Measurement("p", "c", tuple(range(tokens)), "", wall_s,
                       AcceptanceCounts(steps=tokens, prefills=1), 0.0, 0.0, prompt_s=prompt_s,
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
    # the verdict reads the held-out decode-phase speedup, the kind the winner was chosen by
    verdict = re.search(r"RECOMMENDATION: .*?([0-9.]+)x(?: vanilla)? in the decode phase", out)
    row = re.search(r"held-out decode-phase speedup +([0-9.]+)x", out)
    assert verdict and row and float(verdict[1]) == pytest.approx(float(row[1]), abs=0.006)
    header = (tmp_path / "studies" / "best" / "t.yaml").read_text().splitlines()[1]
    assert f"(held-out decode-phase speedup {row[1]}x vs vanilla)" in header


def test_the_pruner_takes_the_decode_speedup_but_no_other_objective():
    from tests.conftest import compose_cfg
    from tuner.config.errors import ConfigError
    from tuner.study.settings import StudySettings
    pruner = "+search.pruner={_target_:optuna.pruners.MedianPruner}"
    StudySettings.from_config(compose_cfg(None, "search.objectives=[decode_speedup]", pruner))
    with pytest.raises(ConfigError, match=r"allowed is objectives=\[speedup\] or "
                                          r"\[decode_speedup\], or pruner=null"):
        StudySettings.from_config(compose_cfg(None, "search.objectives=[tokens_per_s]", pruner))


def test_auto_is_the_end_to_end_speedup_in_process_and_keeps_the_study_name():
    """``search.objectives=[auto]`` (the shipped default) resolves per engine; in process it is
    ``[speedup]``, the objective every in-process study was made with, so their names (which
    hash the settings) and fingerprints do not change."""
    from tests.conftest import compose_cfg
    from tuner.study.settings import StudySettings
    auto = StudySettings.from_config(compose_cfg(None))
    explicit = StudySettings.from_config(compose_cfg(None, "search.objectives=[speedup]"))
    assert auto.objectives == ("speedup",) and auto.name == explicit.name
    assert auto.fingerprint == explicit.fingerprint
    pareto = StudySettings.from_config(compose_cfg(None, "search=pareto",
                                                   "method=mjsd"))
    assert pareto.objectives == ("speedup", "perplexity")


def confirmed(e2e: float, decode: float, prompts: int = 5) -> dict[str, float]:
    return {"held_out_speedup": e2e, "held_out_speedup_min": e2e - 0.05,
            "held_out_speedup_max": e2e + 0.05, "held_out_decode_speedup": decode,
            "held_out_decode_speedup_min": decode - 0.1,
            "held_out_decode_speedup_max": decode + 0.1, "held_out_prompts": prompts,
            "held_out_speedup_lcb": e2e - 0.04, "held_out_decode_speedup_lcb": decode - 0.08,
            "held_out_tokens_per_s": 10.0, "held_out_vanilla_tokens_per_s": 10.5,
            "held_out_mean_accepted_tokens": 2.0}


def test_the_verdict_reads_the_speedup_the_winner_was_chosen_by():
    """Long prompts: 0.97x end to end, 1.30x in the decode phase. A study chosen by the decode
    phase is judged by it on held-out prompts (and says so); one chosen end to end is judged
    end to end. The summary marks the row the verdict reads."""
    from tuner.answer.verdict import recommendation
    from tuner.tracking.report import summary_rows
    held = confirmed(0.97, 1.30)
    decode = recommendation(held, 3, "decode_speedup")
    assert decode.startswith("use the best parameters: 1.30x vanilla in the decode phase")
    assert "min 1.20x, max 1.40x" in decode
    assert recommendation(held, 3, "decode_speedup@c4").startswith("use the best parameters: "
                                                                   "1.30x")
    e2e = recommendation(held, 3, "speedup")
    assert "nothing beat vanilla" in e2e and "0.97x," in e2e and "decode phase" not in e2e
    assert "nothing beat vanilla" in recommendation(confirmed(1.02, 0.9), 3, "decode_speedup")
    best = {"trial": 1, "value": 1.3, "trials": 2}
    budget = {"n_prompts": 2, "n_held_out": 5, "max_new_tokens": 32}
    for objective, marked in (("decode_speedup", "held-out decode-phase speedup"),
                              ("speedup", "held-out end-to-end speedup")):
        listed = summary_rows("s", {}, best, held, {"decode_speedup": 1.3, "speedup": 0.97},
                              budget, [], objective=objective)
        rows = dict(listed)
        reads = [k for k, v in rows.items() if "the verdict below reads this" in str(v)]
        assert reads == [marked], objective
        first = next(k for k, _ in listed if k.startswith("held-out"))
        assert first == marked, objective           # the verdict's figure first, ...
        beside = "held-out end to end (beside it)" if objective == "decode_speedup" else \
            "held-out decode-phase speedup"
        assert beside in rows, objective            # ... the other beside it, labelled


def test_an_older_engine_study_made_by_speedup_says_how_to_resume_it():
    """Resuming by name a study whose fingerprint differs only in its objectives (an engine
    study made before ``auto`` meant ``decode_speedup``) names the override that resumes it as
    measured; any other difference gets no such advice."""
    import json

    from tuner.config.errors import StudyMismatch
    from tuner.config.identity import check_resume
    search = {"kind": "grid", "ranges": "heuristic", "pruner": None}
    old = {"search": json.dumps({**search, "objectives": ["speedup"]}, sort_keys=True),
           "hardware": '"cpu"'}
    new = {**old, "search": json.dumps({**search, "objectives": ["decode_speedup"]},
                                       sort_keys=True)}
    with pytest.raises(StudyMismatch, match=r"add search.objectives=\[speedup\]$"):
        check_resume("s", old, new, force=False)
    with pytest.raises(StudyMismatch) as err:
        check_resume("s", old, {**new, "hardware": '"gpu"'}, force=False)
    assert "search.objectives=[speedup]" not in str(err.value)
    with pytest.raises(StudyMismatch) as err:          # another search key differs too
        check_resume("s", old, {**new, "search": json.dumps(
            {**search, "kind": "sampler", "objectives": ["decode_speedup"]}, sort_keys=True)},
            force=False)
    assert "search.objectives=[speedup]" not in str(err.value)
