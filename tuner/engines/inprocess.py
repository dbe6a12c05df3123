"""``HFEvaluator``: measure a configuration with this project's own decoding loops, in process.

The models load once (``open``); every call builds the method from its parameters, warms it and
vanilla up on the first tuning prompts (untimed), then per prompt times vanilla and the method
interleaved (order alternating), checks the method's tokens against vanilla's at temperature 0
(``tuner.measure.lossless``) and yields the pair. Before each pair the machine is checked for
other load on the CPUs this process may use (``tuner.measure.hygiene``): a pair measured while
the machine stayed busy is flagged ``contended``. Quality (task metric, perplexity) is scored in
``assess``, after the timed window.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch
import transformers

from decoding.compiled import CompiledTarget
from decoding.eagle_weights import head_source
from tuner.config.build import build_method, load_models
from tuner.config.validate import check_generation_fits, check_head_fits
from tuner.measure.energy import EnergyMeter, EnergyReading
from tuner.measure.evaluator import BaselineStore, Evaluation, Paired, ParametersRefused
from tuner.measure.hygiene import ContentionGuard, configure_threads
from tuner.measure.lossless import check_against_vanilla
from tuner.measure.measurement import Measurement, paired_speedup, summarize
from tuner.measure.quality import compare, mean_log_prob
from tuner.measure.timing import Timer, reset_peak_memory, time_generation

if TYPE_CHECKING:
    from tuner.study.settings import StudySettings
    from tuner.tasks.task import Prompt

VANILLA = {"_target_": "decoding.vanilla.Vanilla", "needs_draft": False}
FORWARD_ROOM = 128    # engine.compile: cache positions kept for a forward past the last token


class HFEvaluator:
    """The in-process evaluator (transformers models, ``decoding`` loops); see the module doc."""

    def __init__(self, settings: StudySettings, timer: Timer = time_generation,
                 say: Callable[[str], None] = print) -> None:
        self.settings, self.timer, self.say = settings, timer, say
        self.prompts = {p.id: p for p in settings.tuning + settings.held_out}
        self.meter = EnergyMeter(settings.device)
        self.threads = 0
        self.compiled: CompiledTarget | None = None    # engine.compile=true: set by ``open``
        self._log_probs: dict[tuple, float] = {}       # (prompt id, tokens) -> mean log p
        self._vanilla_quality: dict[tuple, dict] = {}  # vanilla's outputs repeat (fixed seed)

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        s = self.settings
        self.threads = configure_threads(s.threads)
        self.guard = ContentionGuard(s.contention, max_wait_s=s.contention_wait_s)
        self.pair, self.tokenizer = load_models(s.models, s.method["needs_draft"])
        # method=eagle: the head loads and fits before any trial; every trial reuses it
        self.head = check_head_fits(s.method, self.pair.target)
        if self.head is not None:          # its weights were hashed once, for the fingerprint
            identity = json.loads(s.fingerprint["method.head"])
            self.say(f"EAGLE head {s.default['head']}: {head_source(s.default['head'], identity)}")
        self.ids = {i: s.task.encode(p, self.tokenizer) for i, p in self.prompts.items()}
        longest = max(len(ids) for ids in self.ids.values())
        for model in (self.pair.target, *self.pair.drafts):   # the tokenised prompts fit?
            check_generation_fits(longest, s.budget["max_new_tokens"],
                                  model_context(model), model_name(model, s.models))
        self.compiled = self._compile(longest) if s.engine.get("compile") else None
        self.vanilla = self.build(VANILLA, {})

    def _compile(self, longest: int) -> CompiledTarget:
        """engine.compile=true: the target on a static cache, every bucket compiled now (once per
        study, before any timing). Room for the longest prompt, the budget and a forward of up to
        ``FORWARD_ROOM`` tokens past the last position (trees, windows)."""
        buckets = list(self.settings.engine["compile_buckets"])
        needed = longest + self.settings.budget["max_new_tokens"] + max(buckets[-1], FORWARD_ROOM)
        capacity = -(-needed // 64) * 64
        self.say(f"compiling the target for forward lengths {buckets} (static cache of "
                 f"{capacity} positions; once per study, not timed) ...")
        compiled = CompiledTarget(self.pair.target, capacity=capacity, buckets=buckets)
        seconds = compiled.warm()
        self.say(f"compiled in {sum(seconds.values()):.1f} s (" +
                 ", ".join(f"{b}: {t:.1f} s" for b, t in seconds.items()) + ")")
        return compiled

    def close(self) -> None:
        """Nothing to release: the models go with the process."""

    def describe(self) -> dict[str, str]:
        info = {"engine": "hf", "threads": str(self.threads), "torch": torch.__version__,
                "energy": self.meter.reason or "nvml",
                "transformers": transformers.__version__, "compiled": "no"}
        if self.compiled is not None:
            c = self.compiled
            info["compiled"] = (f"buckets {list(c.buckets)}, capacity {c.capacity}, mode "
                                f"{c.mode or 'default'}, compile "
                                f"{sum(c.compile_s.values()):.1f} s")
        return info

    def deployment(self, params: Mapping[str, Any],
                   per_level: Mapping[int, Mapping[str, Any] | None] | None = None
                   ) -> dict[str, str]:
        """How to run the winner: with this project's own decoding library."""
        return {"python": f"decoding.build_method({self.settings.method_choice!r}, pair, "
                          f"**{dict(params)!r})"}

    def build(self, method_cfg: Mapping[str, Any], params: Mapping[str, Any]) -> Any:
        """The method with every parameter; a refusal is the point's fault (ParametersRefused)."""
        if self.head is not None and "head" in params:
            params = {**params, "head": self.head}      # loaded once in open(), same reference
        try:
            method = build_method(method_cfg, params, self.pair, self.settings.sampling,
                                  self.settings.seed)
        except (ValueError, TypeError) as err:
            raise ParametersRefused(f"{type(err).__name__}: {err}") from err
        if self.compiled is not None:
            method.use_compiled(self.compiled)
        return method

    # -- measuring ---------------------------------------------------------------------------------

    def measure(self, params: Mapping[str, Any], prompts: Sequence[tuple[int, Prompt]],
                parity: int, store: BaselineStore | None = None) -> Iterator[Paired]:
        method = self.build(self.settings.method, params)
        stored, fresh = (None, True) if store is None else self._stored_baseline(store)
        self._warmup(*([method] if stored else [self.vanilla, method]))
        reset_peak_memory(self.settings.device)
        for k, (index, prompt) in enumerate(prompts, 1):
            load = self.guard.check()
            if stored is None:
                vanilla_first = (parity + k) % 2 == 0        # alternate A/B and B/A
                ref = self._measure(self.vanilla, prompt) if vanilla_first else None
                got = self._measure(method, prompt)
                ref = ref or self._measure(self.vanilla, prompt)
            else:
                ref, got = stored[prompt.id], self._measure(method, prompt)
            got = replace(got, speedup=paired_speedup(ref, got), other_load=load.other_busy,
                          contended=load.contended, waited_s=load.waited_s)
            yield Paired(index, self._check(got, ref.tokens), ref, fresh)

    def _measure(self, method: Any, prompt: Prompt) -> Measurement:
        s = self.settings
        with self.meter:
            out, wall = self.timer(method, self.ids[prompt.id], s.budget["max_new_tokens"],
                                   s.device)
        text = self.tokenizer.decode(out.tokens, skip_special_tokens=True)   # after the window
        st, reading = out.stats, self.meter.reading
        return Measurement(prompt.id, prompt.category, out.tokens, text, wall, st.steps,
                           st.drafted, st.accepted, st.draft_time_s, st.verify_time_s,
                           st.accepted_per_position, st.drafted_per_position,
                           truncated=len(out.tokens) >= s.budget["max_new_tokens"],
                           energy_j=reading.joules if reading and reading.available else None)

    def _warmup(self, *methods: Any) -> None:
        s = self.settings
        for method in methods:
            for prompt in s.tuning[: s.warmup_prompts]:
                self.timer(method, self.ids[prompt.id], s.budget["max_new_tokens"], s.device)
            method.reset()                 # warm-up must not seed a method's history (pools)

    def _check(self, m: Measurement, reference: Sequence[int]) -> Measurement:
        if not (self.settings.greedy and self.settings.lossless):
            return m
        return check_against_vanilla(m, reference, self.ids[m.prompt_id], self.pair.target,
                                     self.settings.near_tie_ulps)

    def _stored_baseline(self, store: BaselineStore) -> tuple[dict[str, Measurement], bool]:
        """``baseline=per_study``: vanilla once per study on the tuning prompts (kept in the
        study); returns it and whether it was measured just now."""
        records = store.get()
        if records and set(records) >= {p.id for p in self.settings.tuning}:
            return {i: self._from_record(i, r) for i, r in records.items()}, False
        self.say("baseline (per_study): measuring vanilla once on the tuning prompts ...")
        self._warmup(self.vanilla)
        ms = {p.id: self._measure(self.vanilla, p) for p in self.settings.tuning}
        store.put({i: {"tokens": list(m.tokens), "wall_s": m.wall_s, "energy_j": m.energy_j}
                   for i, m in ms.items()})
        return ms, True

    def _from_record(self, prompt_id: str, record: Mapping[str, Any]) -> Measurement:
        prompt = self.prompts[prompt_id]
        tokens = tuple(record["tokens"])
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Measurement(prompt.id, prompt.category, tokens, text, record["wall_s"], 0, 0, 0,
                           0.0, 0.0, (), (), energy_j=record.get("energy_j"))

    # -- after the timed window --------------------------------------------------------------------

    def assess(self, pairs: Sequence[Paired]) -> Evaluation:
        ms = [p.method for p in pairs]
        refs = [p.baseline for p in pairs]
        fresh = [p.baseline for p in pairs if p.fresh_baseline]
        device = self.settings.device
        summary = summarize(ms, self._energy(ms), device)
        if fresh:
            summary["vanilla_tokens_per_s"] = sum(r.new_tokens for r in fresh) / \
                sum(r.wall_s for r in fresh)
        summary.update(energy_versus(summary, refs))
        record, ms, refs = self._quality(ms, refs)
        summary.update(record)
        fresh = [r for p, r in zip(pairs, refs) if p.fresh_baseline]
        baseline = summarize([replace(r, speedup=1.0) for r in fresh], self._energy(fresh),
                             device) if fresh else {}
        return Evaluation(summary, tuple(ms), tuple(fresh), baseline)

    def _quality(self, ms: list[Measurement], refs: list[Measurement]
                 ) -> tuple[dict[str, float], list[Measurement], list[Measurement]]:
        """Task quality of the method and of vanilla on the same prompts; perplexities (lossy
        methods, perplexity objectives), filled into the measurements' ``mean_log_prob``."""
        prompts = [self.prompts[m.prompt_id] for m in ms]
        task = self.settings.task
        method_quality, _ = task.score(prompts, [m.text for m in ms])
        key = tuple((r.prompt_id, r.tokens) for r in refs)
        if key not in self._vanilla_quality:
            self._vanilla_quality[key] = task.score(prompts, [r.text for r in refs])[0]
        method_lp = vanilla_lp = None
        if self.settings.scores_perplexity:
            ms = [replace(m, mean_log_prob=self._log_prob(m)) for m in ms]
            refs = [replace(r, mean_log_prob=self._log_prob(r)) for r in refs]
            method_lp = [m.mean_log_prob for m in ms]
            vanilla_lp = [r.mean_log_prob for r in refs]
        record = compare(method_quality, self._vanilla_quality[key], method_lp, vanilla_lp)
        return record, ms, refs

    def _log_prob(self, m: Measurement) -> float:
        key = (m.prompt_id, tuple(m.tokens))
        if key not in self._log_probs:
            self._log_probs[key] = mean_log_prob(self.pair.target, self.ids[m.prompt_id],
                                                 m.tokens)
        return self._log_probs[key]

    def _energy(self, ms: Sequence[Measurement]) -> EnergyReading:
        joules = [m.energy_j for m in ms]
        if not self.meter.available or any(j is None for j in joules):
            return EnergyReading(False, self.meter.reason or "unavailable", None, 0.0)
        return EnergyReading(True, "nvml_total_energy", float(sum(joules)),
                             sum(m.wall_s for m in ms))


def model_context(model: Any) -> int:
    """Positions a model can attend to (a huge number when its config does not say)."""
    return int(getattr(model.config, "max_position_embeddings", 0) or 1 << 62)


def model_name(model: Any, models: Mapping[str, Any]) -> str:
    target = models["target"]
    return str(getattr(model.config, "_name_or_path", "") or target.get("path") or
               target.get("package") or target.get("kind"))


def energy_versus(summary: Mapping[str, float], vanilla: Sequence[Measurement]
                  ) -> dict[str, float]:
    """Vanilla's J/token on the same prompts and the method's ratio to it (NVML, GPU only)."""
    joules = [v.energy_j for v in vanilla]
    if "energy_j_per_token" not in summary or not vanilla or any(j is None for j in joules):
        return {}
    per_token = sum(joules) / max(sum(v.new_tokens for v in vanilla), 1)
    return {"vanilla_energy_j_per_token": per_token,
            "energy_ratio": summary["energy_j_per_token"] / per_token}
