"""``HFEvaluator``: engine=hf's backend, this project's own decoding loops, in process.

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
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch
import transformers

from decoding.acceptance import AcceptanceCounts
from decoding.compiled import CompiledTarget
from decoding.eagle_weights import head_source
from tuner.config.build import build_method, load_models
from tuner.config.union import METHOD, is_union, member_of, namespaced
from tuner.config.validate import check_generation_fits, check_head_fits
from tuner.measure.energy import EnergyMeter, EnergyReading
from tuner.measure.evaluator import (
    BaselineStore,
    Evaluation,
    MeasureSettings,
    Paired,
    ParametersRefused,
)
from tuner.measure.hygiene import configure_threads
from tuner.measure.lossless import Gap, model_gap
from tuner.measure.measurement import Measurement
from tuner.measure.paired import assess, measure_pairs
from tuner.measure.quality import mean_log_prob
from tuner.measure.timing import Timer, reset_peak_memory, time_generation
from tuner.predict.across import UnionRanker
from tuner.predict.ranker import Ranker

if TYPE_CHECKING:
    from tuner.tasks.task import Prompt

VANILLA = {"_target_": "decoding.vanilla.Vanilla", "needs_draft": False}
FORWARD_ROOM = 128    # engine.compile: cache positions kept for a forward past the last token


class HFEvaluator:
    """The in-process evaluator (transformers models, ``decoding`` loops); see the module doc."""

    def __init__(self, settings: MeasureSettings, timer: Timer = time_generation,
                 say: Callable[[str], None] = print) -> None:
        self.settings, self.timer, self.say = settings, timer, say
        self.prompts = {p.id: p for p in settings.tuning + settings.held_out}
        self.meter = EnergyMeter(settings.device)
        self.threads = 0
        self.compiled: CompiledTarget | None = None    # engine.compile=true: set by ``open``
        self._log_probs: dict[tuple, float] = {}       # (prompt id, tokens) -> mean log p
        self.quality_cache: dict[tuple, dict] = {}     # vanilla's outputs repeat (fixed seed)
        self.baseline_name = "vanilla"
        self.bound_slack = settings.bound_slack   # tuner.measure.bounds
        self.rate_requests: dict = {}         # no request rates in process (servers keep them)

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        s = self.settings
        self.threads = configure_threads(s.threads)
        self.guard = s.contention_guard()
        self.pair, self.tokenizer = load_models(s.models, s.method["needs_draft"])
        # method=eagle: the head loads and fits before any trial; every trial reuses it (a union
        # of methods: each member's own head, tuner.config.union)
        members = s.method["members"] if is_union(s.method) else {None: s.method}
        self.heads = {name: head for name, m in members.items()
                      if (head := check_head_fits(m, self.pair.target)) is not None}
        self.head = self.heads.get(None)
        for name, head in self.heads.items():   # its weights were hashed once, for the print
            identity = json.loads(s.head_identity or "{}") if name is None else {}
            given = members[name]["params"]["head"]
            self.say(f"EAGLE head {given}{'' if name is None else f' (method={name})'}: "
                     f"{head_source(given, identity)}")
        self.ids = {i: s.task.encode(p, self.tokenizer) for i, p in self.prompts.items()}
        longest = max(len(ids) for ids in self.ids.values())
        for model in (self.pair.target, *self.pair.drafts):   # the tokenised prompts fit?
            check_generation_fits(longest, s.budget["max_new_tokens"],
                                  model_context(model), model_name(model, s.models))
        self.compiled = self._compile(longest) if s.engine.get("compile") else None
        self.vanilla = self.build(VANILLA, {})
        self._ranker = Ranker(s, self.pair, self.ids, lambda params: self.build(s.method, params),
                              self.compiled, self.say, self._vanilla_decode)
        if is_union(s.method):             # each member ranked by its own ranker, one profile
            self._ranker = UnionRanker(s.method, self._ranker, {
                name: self._ranker.for_method(m, partial(self._build_member, name))
                for name, m in s.method["members"].items()})

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
        info = {"engine": str(self.settings.engine["kind"]), "threads": str(self.threads),
                "torch": torch.__version__, "energy": self.meter.reason or "nvml",
                "transformers": transformers.__version__, "compiled": "no"}
        if self.compiled is not None:
            c = self.compiled
            info["compiled"] = (f"buckets {list(c.buckets)}, capacity {c.capacity}, mode "
                                f"{c.mode or 'default'}, compile "
                                f"{sum(c.compile_s.values()):.1f} s")
        return info

    def speculative_base(self, params: Mapping[str, Any]) -> None:
        """Not vLLM: no speculative config to write a schedule around."""
        return None

    def deployment(self, params: Mapping[str, Any],
                   per_level: Mapping[int, Mapping[str, Any] | None] | None = None
                   ) -> dict[str, str]:
        """How to run the winner: with this project's own decoding library (a union's point:
        its member, by name)."""
        choice = self.settings.method_choice
        if is_union(self.settings.method):
            choice, _, params = member_of(self.settings.method, params)
        return {"python": f"decoding.build_method({choice!r}, pair, **{dict(params)!r})"}

    def build(self, method_cfg: Mapping[str, Any], params: Mapping[str, Any]) -> Any:
        """The method with every parameter; a refusal is the point's fault (ParametersRefused).
        A union's point builds its member (``tuner.config.union.member_of``)."""
        head = self.head
        if is_union(method_cfg):
            try:
                name, method_cfg, params = member_of(method_cfg, params)
            except (KeyError, ValueError) as err:
                raise ParametersRefused(f"{type(err).__name__}: {err}") from err
            head = self.heads.get(name)
        if head is not None and "head" in params:
            params = {**params, "head": head}      # loaded once in open(), same reference
        try:
            method = build_method(method_cfg, params, self.pair, self.settings.sampling,
                                  self.settings.seed)
        except (ValueError, TypeError) as err:
            raise ParametersRefused(f"{type(err).__name__}: {err}") from err
        if self.compiled is not None:
            method.use_compiled(self.compiled)
        return method

    def _build_member(self, name: str, params: Mapping[str, Any]) -> Any:
        """A union member's method at its own parameters (its head lent as for a trial)."""
        return self.build(self.settings.method, {METHOD: name, **namespaced(name, params)})

    # -- measuring ---------------------------------------------------------------------------------

    def measure(self, params: Mapping[str, Any], prompts: Sequence[tuple[int, Prompt]],
                parity: int, store: BaselineStore | None = None) -> Iterator[Paired]:
        """The paired protocol (``tuner.measure.paired``) with the method built from
        ``params``; ``store``: the study's vanilla (``baseline=per_study``)."""
        method = self.build(self.settings.method, params)
        stored, fresh = (None, True) if store is None else self._stored_baseline(store)
        yield from measure_pairs(self, method, prompts, parity, stored, fresh)

    def control(self, params: Mapping[str, Any], prompts: Sequence[tuple[int, Prompt]],
                parity: int, levels: Sequence[int] | None = None,
                rates: bool = True) -> Iterator[Paired]:
        """The A/A control after ``params``' method: the method runs once on every prompt
        (untimed: its history, caches, allocator state and models in play), then vanilla is
        measured against a second vanilla by the paired protocol (one request at a time: no
        levels or rates here)."""
        method = self.build(self.settings.method, params)
        for _, prompt in prompts:
            self.timer(method, self.ids[prompt.id], self.settings.budget["max_new_tokens"],
                       self.settings.device)
        yield from measure_pairs(self, self.build(VANILLA, {}), prompts, parity, bounded=False)

    # -- the backend (tuner.measure.paired.Backend) ------------------------------------------------

    def warm_up(self, method: Any, baseline: bool) -> None:
        self._warmup(*([self.vanilla, method] if baseline else [method]))
        reset_peak_memory(self.settings.device)

    def run(self, method: Any | None, batch: Sequence[tuple[int, Prompt]],
            level: int) -> list[Measurement]:
        """One request at a time: ``level`` is always 1 here."""
        return [self._measure(self.vanilla if method is None else method, prompt)
                for _, prompt in batch]

    def settle(self) -> None:
        """In process nothing else runs between the sides."""

    def gap(self, prompt: Prompt, prefix: Sequence[int], chosen: int, other: int) -> Gap:
        return model_gap(self.pair.target, list(self.ids[prompt.id]) + list(prefix), chosen,
                         other, self.settings.near_tie_ulps)
    def extra_summary(self, pairs: Sequence[Paired]) -> dict[str, float]:
        """Nothing here: a trial's prediction is its ranker's (``ranker().trial_prediction``),
        asked by the objective with the trial's parameters."""
        return {}

    def ranker(self) -> Ranker | UnionRanker:
        """The ranking and the predictions on the models loaded by ``open``
        (``tuner.predict.ranker``)."""
        return self._ranker

    def _measure(self, method: Any, prompt: Prompt) -> Measurement:
        s = self.settings
        with self.meter:
            out, wall = self.timer(method, self.ids[prompt.id], s.budget["max_new_tokens"],
                                   s.device)
        text = self.tokenizer.decode(out.tokens, skip_special_tokens=True)   # after the window
        st, reading = out.stats, self.meter.reading
        return Measurement(prompt_id=prompt.id, category=prompt.category, tokens=out.tokens,
                           text=text, wall_s=wall, counts=st.counts,
                           draft_time_s=st.draft_time_s, verify_time_s=st.verify_time_s,
                           truncated=len(out.tokens) >= s.budget["max_new_tokens"],
                           energy_j=reading.joules if reading and reading.available else None,
                           prompt_s=st.first_step_s, decode_s=wall - st.first_step_s,
                           decode_tokens=len(out.tokens) - st.first_step_tokens)

    def _vanilla_decode(self, prompt_id: str) -> tuple[float, int]:
        """Vanilla timed on one prompt as a trial times it: its decode phase's seconds and
        tokens (the ranker's second reading of the profile's check)."""
        m = self._measure(self.vanilla, self.prompts[prompt_id])
        return m.decode_s, m.decode_tokens

    def _warmup(self, *methods: Any) -> None:
        s = self.settings
        for method in methods:
            for prompt in s.tuning[: s.warmup_prompts]:
                self.timer(method, self.ids[prompt.id], s.budget["max_new_tokens"], s.device)
            method.reset()                 # warm-up must not seed a method's history (pools)

    def _stored_baseline(self, store: BaselineStore) -> tuple[dict[str, Measurement], bool]:
        """``baseline=per_study``: vanilla once per study on the tuning prompts (kept in the
        study); returns it and whether it was measured just now."""
        records = store.get()
        if records and set(records) >= {p.id for p in self.settings.tuning}:
            return {i: self._from_record(i, r) for i, r in records.items()}, False
        self.say("baseline (per_study): measuring vanilla once on the tuning prompts ...")
        self._warmup(self.vanilla)
        ms = {p.id: self._measure(self.vanilla, p) for p in self.settings.tuning}
        store.put({i: {"tokens": list(m.tokens), "wall_s": m.wall_s, "energy_j": m.energy_j,
                       "prompt_s": m.prompt_s, "decode_tokens": m.decode_tokens}
                   for i, m in ms.items()})
        return ms, True

    def _from_record(self, prompt_id: str, record: Mapping[str, Any]) -> Measurement:
        prompt = self.prompts[prompt_id]
        tokens = tuple(record["tokens"])
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        first = record.get("prompt_s")          # absent in a study stored before it was kept
        return Measurement(prompt_id=prompt.id, category=prompt.category, tokens=tokens,
                           text=text, wall_s=record["wall_s"], counts=AcceptanceCounts(),
                           draft_time_s=0.0, verify_time_s=0.0, energy_j=record.get("energy_j"),
                           prompt_s=first,
                           decode_s=None if first is None else record["wall_s"] - first,
                           decode_tokens=record.get("decode_tokens"))

    # -- after the timed window --------------------------------------------------------------------

    def assess(self, pairs: Sequence[Paired]) -> Evaluation:
        return assess(self, pairs)

    def log_prob(self, m: Measurement) -> float:
        key = (m.prompt_id, tuple(m.tokens))
        if key not in self._log_probs:
            self._log_probs[key] = mean_log_prob(self.pair.target, self.ids[m.prompt_id],
                                                 m.tokens)
        return self._log_probs[key]

    def energy(self, ms: Sequence[Measurement]) -> EnergyReading:
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
