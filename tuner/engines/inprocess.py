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
import statistics
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch
import transformers

from decoding.acceptance import AcceptanceCounts
from decoding.compiled import CompiledTarget
from decoding.eagle_weights import head_source
from tuner.config.build import build_method, load_models
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

if TYPE_CHECKING:
    from decoding.base import DecodingMethod
    from tuner.tasks.task import Prompt

VANILLA = {"_target_": "decoding.vanilla.Vanilla", "needs_draft": False}
FORWARD_ROOM = 128    # engine.compile: cache positions kept for a forward past the last token


def observed_key(method: DecodingMethod, params: Mapping[str, Any], prompts: Sequence[Prompt]
                 ) -> tuple:
    """The untimed-run cache's key: the point, and its prompts in their order for a method
    whose history carries across prompts (``keeps_history``), as a set otherwise."""
    ids = tuple(p.id for p in prompts)
    return (json.dumps(dict(params), sort_keys=True, default=str),
            ids if method.keeps_history else tuple(sorted(ids)))


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
        self.trajectories: dict[str, list[int]] = {}   # search.profile: vanilla's, per prompt
        self.agreements: dict[str, list[bool]] = {}    # the draft's teacher-forced argmax hits
        self.predicting: tuple[Any, Mapping[str, Any]] | None = None   # the last measure's
        # method and parameters
        self.observed: dict[tuple, list[Any] | None] = {}   # untimed generations, per point
        self.warned_about: set[Any] = set()   # what a prediction's one-line notice has said
        self.profile = settings.profile       # search.profile, until it fails its check
        self.untimed_runs = 0                 # untimed, traced generations made (per prompt)
        self.bound_slack = settings.bound_slack   # tuner.measure.bounds
        self.rate_requests: dict = {}         # no request rates in process (servers keep them)

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        s = self.settings
        self.threads = configure_threads(s.threads)
        self.guard = s.contention_guard()
        self.pair, self.tokenizer = load_models(s.models, s.method["needs_draft"])
        # method=eagle: the head loads and fits before any trial; every trial reuses it
        self.head = check_head_fits(s.method, self.pair.target)
        if self.head is not None:          # its weights were hashed once, for the fingerprint
            identity = json.loads(s.head_identity or "{}")
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
        """The paired protocol (``tuner.measure.paired``) with the method built from
        ``params``; ``store``: the study's vanilla (``baseline=per_study``)."""
        method = self.build(self.settings.method, params)
        stored, fresh = (None, True) if store is None else self._stored_baseline(store)
        self.predicting = (method, params)
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
        """``search.profile``: the predicted speedup of the tuning prompts just measured (after
        the timed window, in the order measured; ``predict``); ``search.predict_for``: the same
        acceptance priced by the other machine's profile (``predicted_speedup_for``). The
        acceptance is replayed, or comes from an untimed run of the method (``acceptance``:
        ``search=predict``'s ranking made it before the timed run where the prompts' order does
        not matter, else it is made now). Held-out prompts are not predicted; a failed
        prediction loses the prediction only (one line), never the trial."""
        s = self.settings
        if (self.profile is None and s.predict_for is None) or self.predicting is None:
            return {}
        method, params = self.predicting
        self.predicting = None
        tuning = {p.id for p in s.tuning}
        prompts = [self.prompts[p.method.prompt_id] for p in pairs]
        if not prompts or any(p.id not in tuning for p in prompts):
            return {}
        start = time.perf_counter()
        try:
            generations = self.acceptance(method, prompts, params)
            if generations is None:
                return {}
            out: dict[str, float] = {}
            if self.profile is not None:
                got = self.price(generations, self.profile)
                out.update({"predicted_speedup": got.speedup,
                            "predicted_mean_accepted_tokens": got.mean_accepted_tokens,
                            "predicted_by_replay": float(got.source == "replay")})
                from tuner.predict.trace import by_seed
                seeded = by_seed(generations)
                if len(seeded) > 1:       # T > 0: the spread over the seeded runs
                    out["predicted_speedup_sd"] = statistics.pstdev(
                        self.price(runs, self.profile).speedup for runs in seeded.values())
            if s.predict_for is not None:
                out["predicted_speedup_for"] = self.price(generations, s.predict_for).speedup
        except Exception as err:          # noqa: BLE001 - a prediction never fails a trial
            self.say(f"prediction failed ({type(err).__name__}: {err}): this trial keeps its "
                     "measurements without one")
            return {}
        out["prediction_s"] = time.perf_counter() - start
        return out

    def acceptance(self, method: DecodingMethod, prompts: Sequence[Prompt],
                   params: Mapping[str, Any]) -> list[Any] | None:
        """``method``'s steps on ``prompts``: replayed where its acceptance replays
        (``replay``: T = 0 only), else from untimed, traced runs (``observe``: one, or at
        T > 0 one per seed), kept per point and prompts: in their order for a method whose
        history carries across prompts (``keeps_history``: Ouroboros's pool), as a set
        otherwise, so a trial reuses ``search=predict``'s ranking run whatever its own order of
        the prompts; None where neither applies (an EAGLE head, a draft that is the target
        itself)."""
        replayed = self.replay(method, prompts)
        if replayed is not None:
            return replayed
        key = observed_key(method, params, prompts)
        if key not in self.observed:
            self.observed[key] = self.observe(method, prompts)
        return self.observed[key]

    def replay(self, method: DecodingMethod, prompts: Sequence[Prompt]
               ) -> list[tuple[int, Any]] | None:
        """``method``'s verification steps on ``prompts``, (prompt length, steps) each: its
        acceptance replayed on vanilla's trajectories (``decoding.replay.drafter_steps``, each
        trajectory computed once per study, untimed); None for a method whose acceptance does
        not replay."""
        from decoding.replay import drafter_steps, trajectory
        if not self.replays(method):
            return None
        drafter = method.drafter
        device = next(self.pair.target.parameters()).device
        budget = self.settings.budget["max_new_tokens"]
        generations = []
        for prompt in prompts:
            ids = torch.as_tensor(self.ids[prompt.id])
            if prompt.id not in self.trajectories:
                self.trajectories[prompt.id] = trajectory(self.pair.target, ids, budget)
            generations.append((len(ids), drafter_steps(drafter, ids, self.trajectories[
                prompt.id], budget, tuple(method.eos_ids), device=device)))
        drafter.reset()
        return generations

    def observe(self, method: DecodingMethod, prompts: Sequence[Prompt], fresh: bool = True
                ) -> list[Any] | None:
        """One untimed generation of ``method`` per prompt, in the order given, from a fresh
        history (``reset``, as after the warm-up), every forward of the target and the draft
        models traced (``tuner.predict.trace``); at T > 0 one such run per seed of
        ``UNTIMED_SEEDS`` seeds after the study's (never the timed runs' own), each generation
        tagged with its seed (the prediction averages them and gives their spread).
        ``fresh=False`` (T = 0): the method's history goes on from its last run (successive
        halving adds a prompt to a point's runs as its timed trial comes to it). None where
        its forwards cannot all be priced (a method not ``traceable``; a draft that is the
        target, whose forwards cannot be told apart: said once)."""
        from tuner.predict.trace import UNTIMED_SEEDS, untimed_runs
        s = self.settings
        drafts = list(self.pair.drafts) if s.method["needs_draft"] else []
        if not method.traceable:
            return None
        if len({id(m) for m in [self.pair.target, *drafts]}) != 1 + len(drafts):
            if "same" not in self.warned_about:
                self.warned_about.add("same")
                self.say("prediction: the draft model is the target itself (or a draft is "
                         "given twice), so their forwards cannot be told apart: no prediction")
            return None
        models = [("target", self.pair.target)] + [("draft", d) for d in drafts]
        ids = [self.ids[p.id] for p in prompts]
        seeds = [None] if float(s.sampling.get("temperature", 0)) == 0 else \
            [s.seed + 1 + i for i in range(UNTIMED_SEEDS)]
        method.use_compiled(None)          # the forwards as the model makes them (hooks fire)
        self.untimed_runs += len(ids) * len(seeds)
        try:
            return [g for seed in seeds for g in untimed_runs(
                method, ids, models, s.budget["max_new_tokens"], seed, fresh=fresh)]
        finally:
            method.use_compiled(self.compiled)

    def price(self, generations: Sequence[Any], profile: Any) -> Any:
        """Replayed or traced ``generations`` priced by ``profile``
        (``tuner.predict.Prediction``; its ``source``: "replay" or "untimed")."""
        from tuner.predict.predict import predict
        from tuner.predict.trace import beyond_grid
        uses_draft = bool(self.settings.method["needs_draft"])
        if id(profile) not in self.warned_about:
            line = beyond_grid(generations, profile.target, profile.draft if uses_draft else
                               None)
            if line:
                self.warned_about.add(id(profile))
                self.say(f"prediction ({profile.machine}): {line}")
        return predict(generations, profile, uses_draft)

    def acceptance_points(self, points: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Every point's steps on the tuning prompts (``acceptance``); None for a point the
        method refuses or whose acceptance can be neither replayed nor traced. A point that
        took over a second gets a progress line."""
        return [self.point_acceptance(i, point, len(points)) for i, point in enumerate(points)]

    def point_acceptance(self, i: int, point: Mapping[str, Any], total: int,
                         prompts: Sequence[Prompt] | None = None) -> Any:
        """Point ``i`` of ``total``'s steps (``acceptance_points``) on ``prompts`` (the tuning
        prompts, in their order, by default)."""
        from tuner.predict.trace import TracedGeneration
        params = {**self.settings.default, **point}
        try:
            method = self.build(self.settings.method, params)
        except ParametersRefused:
            return None
        start = time.perf_counter()
        try:
            got = self.acceptance(method, list(prompts or self.settings.tuning), params)
        except Exception as err:          # noqa: BLE001 - one point's failure loses its rank
            self.say(f"  {i + 1}/{total} {dict(point)}: not predicted "
                     f"({type(err).__name__}: {err})")
            return None
        seconds = time.perf_counter() - start
        if seconds > 1.0:                  # an untimed run or a draft-model replay: say so
            how = "not predicted" if not got else "untimed run" if \
                isinstance(got[0], TracedGeneration) else "replayed"
            self.say(f"  {i + 1}/{total} {dict(point)}: {how} in {seconds:.1f} s")
        return got

    def rank_points(self, points: Sequence[Mapping[str, Any]], prompts: Sequence[Prompt],
                    known: Mapping[int, tuple[float, int | None]] | None = None,
                    on_point: Callable[[int, float, int | None], None] =
                    lambda i, value, cut: None) -> tuple[list[float], list[int | None]]:
        """``search=predict``'s ranking: every point's predicted speedup on ``prompts`` (in
        that order: a method that carries history runs them so, as its timed trials do) and,
        per point, the prompts it saw where successive halving cut it (None: all). Points whose
        acceptance replays are predicted on every prompt; the others (an untimed run per
        prompt) go through successive halving at T = 0 (``tuner.predict.halving``: every point
        on the first prompt, the best half kept for the next, ...; the rounds said), one full
        run per point at T > 0. ``known``: what an interrupted ranking kept, {index: (value,
        cut)}; ``on_point(i, value, cut)`` once a point's value is final."""
        from tuner.predict.halving import successive_halving
        known = dict(known or {})
        prompts = list(prompts)
        values: list[float] = [float("-inf")] * len(points)
        cut: list[int | None] = [None] * len(points)
        halved: dict[int, tuple[Any, dict[str, Any]]] = {}
        chains: dict[int, Any] = {}
        for i, point in enumerate(points):
            if i in known:
                values[i], cut[i] = known[i]
                continue
            params = {**self.settings.default, **point}
            try:
                method = self.build(self.settings.method, params)
            except ParametersRefused:
                on_point(i, values[i], None)
                continue
            if self.halves(method):
                halved[i] = (method, params)
            elif self.chain(method) is not None:
                chains[i] = method
            else:
                values[i] = self._priced(self.point_acceptance(i, point, len(points), prompts),
                                         point)
                on_point(i, values[i], None)
        if chains:
            self._two_fidelities(points, prompts, chains, values, cut, on_point)
        if not halved:
            return values, cut
        order = sorted(halved)
        runs: dict[int, list[Any] | None] = {i: [] for i in order}

        def run(j: int, k: int) -> None:
            i = order[j]
            got = runs[i]
            if got is None:
                return
            try:
                got.extend(self.observe(halved[i][0], [prompts[k]], fresh=k == 0) or [])
            except Exception as err:      # noqa: BLE001 - one point's failure loses its rank
                self.say(f"  {dict(points[i])}: not predicted ({type(err).__name__}: {err})")
                runs[i] = None

        def score(j: int, n: int) -> float:
            got = runs[order[j]]
            return float("-inf") if not got or len(got) < n else \
                self._priced(got[:n], points[order[j]])

        began = time.perf_counter()

        def said(r: Any) -> None:         # a round can take minutes: say each one
            self.say(f"  successive halving, prompt {r.prompts} of {len(prompts)}: {r.ran} "
                     f"points run, {r.kept} kept ({time.perf_counter() - began:.0f} s so far)")
        halving = successive_halving(len(order), len(prompts), run, score, on_round=said)
        self.say(f"  {halving.line()}")
        for j, i in enumerate(order):
            method, params = halved[i]
            values[i], cut[i] = halving.values[j], halving.cut[j]
            if cut[i] is None and runs[i]:         # a timed trial of it reuses these runs
                self.observed[observed_key(method, params, prompts)] = runs[i]
            method.reset()
            on_point(i, values[i], cut[i])
        return values, cut

    def replays(self, method: DecodingMethod) -> bool:
        """Whether ``method``'s acceptance replays (``replay``): a lossless method at T = 0 whose
        drafter proposes from the committed prefix alone."""
        from decoding.replay import replayable
        return self.settings.lossless and self.settings.greedy and method.replayable and \
            method.drafter is not None and replayable(method.drafter)

    def chain(self, method: DecodingMethod) -> int | None:
        """γ of a draft-model chain (``speculative``, ``block``: one draft model proposing a
        chain, whose every γ one teacher-forced pass of the draft approximates at T = 0), else
        None."""
        from decoding.speculative import ModelDrafter
        if not self.replays(method) or not isinstance(method.drafter, ModelDrafter) or \
                len(self.pair.drafts) != 1:
            return None
        return int(method.drafter.num_tokens)

    def _two_fidelities(self, points: Sequence[Mapping[str, Any]], prompts: Sequence[Prompt],
                        chains: Mapping[int, Any], values: list[float],
                        cut: list[int | None],
                        on_point: Callable[[int, float, int | None], None]) -> None:
        """Draft-model chains: every point's steps from one teacher-forced draft pass per
        prompt (``decoding.replay.chain_steps``: exact for an fp32 draft away from near-ties,
        approximate for a draft whose numerics depend on the forward's rows, such as the
        int8-dynamic self-draft), then the exact replay (``drafter_steps``, the loop's shapes)
        for the best half (``tuner.predict.halving.approximate_then_exact``); a point priced
        approximately only is ranked after the exact ones (``cut`` 0)."""
        from decoding.replay import chain_steps, draft_agreement, trajectory
        from tuner.predict.halving import approximate_then_exact
        budget = self.settings.budget["max_new_tokens"]
        draft = self.pair.drafts[0]
        order = sorted(chains)
        for prompt in prompts:
            ids = torch.as_tensor(self.ids[prompt.id])
            if prompt.id not in self.trajectories:
                self.trajectories[prompt.id] = trajectory(self.pair.target, ids, budget)
            if prompt.id not in self.agreements:
                self.agreements[prompt.id] = draft_agreement(draft, ids,
                                                             self.trajectories[prompt.id])

        def approximate(j: int) -> float:
            method = chains[order[j]]
            gamma, eos = self.chain(method), tuple(method.eos_ids)
            generations = [(len(self.ids[p.id]), chain_steps(
                self.agreements[p.id], self.trajectories[p.id], len(self.ids[p.id]), gamma,
                budget, eos)) for p in prompts]
            return self._priced(generations, points[order[j]])

        def exact(j: int) -> float:
            return self._priced(self.replay(chains[order[j]], prompts), points[order[j]])

        two = approximate_then_exact(len(order), approximate, exact)
        self.say(f"  {two.line()}")
        for j, i in enumerate(order):
            values[i], cut[i] = two.values[j], None if two.exact[j] else 0
            on_point(i, values[i], cut[i])

    def halves(self, method: DecodingMethod) -> bool:
        """Whether a ranking predicts ``method`` by successive halving: its acceptance needs
        untimed runs (no replay), they can be traced, and T = 0 (counts deterministic)."""
        return not self.replays(method) and method.traceable and self.settings.greedy

    def _priced(self, generations: Any, point: Mapping[str, Any]) -> float:
        try:
            return float("-inf") if generations is None else \
                self.price(generations, self.profile).speedup
        except Exception as err:          # noqa: BLE001 - one point's failure loses its rank
            self.say(f"  {dict(point)}: not predicted ({type(err).__name__}: {err})")
            return float("-inf")

    # -- the profile's check and price (tuner.predict.check, tuner.study.cost) --------------------

    def check_profile(self, pairs: Sequence[Paired]) -> Any:
        """``search.profile``'s vanilla against the default's (trial 0's) measured vanilla,
        each per 1-row forward at the generation's middle context: the profile's own cell, and
        the same forward timed now (``tuner.predict.loops.measure_surface``, 10 rounds)."""
        from tuner.predict.check import ONE_ROW_ROUNDS, VanillaGeneration, vanilla_check
        from tuner.predict.loops import measure_surface
        if self.profile is None or self.profile.kind != "measured":
            return None
        runs = {p.baseline.prompt_id: p.baseline for p in pairs}     # a cycled prompt: once
        shapes = [VanillaGeneration(len(self.ids[i]), m.decode_tokens, m.decode_s, 0.0)
                  for i, m in runs.items() if m.decode_tokens and m.decode_s is not None]
        if not shapes:
            return None
        contexts = sorted({g.context() for g in shapes})
        now = measure_surface(self.pair.target, contexts=contexts, rows=(1,), prefill=(),
                              repeats=ONE_ROW_ROUNDS)
        one_row = dict(zip(contexts, (line[0] for line in now.seconds)))
        return vanilla_check(self.profile, [replace(g, one_row_s=one_row[g.context()])
                                            for g in shapes])

    def refuse_profile(self, line: str) -> None:
        self.profile = None

    def vanilla_price(self, profile: Any) -> list[float] | None:
        """``profile``'s price of vanilla's ``max_new_tokens`` on each tuning prompt (None for a
        roofline, which misprices a CPU, as ``check_profile`` leaves one unchecked)."""
        from tuner.predict.predict import vanilla_forward_seconds
        if profile is None or profile.kind != "measured":
            return None
        budget = self.settings.budget["max_new_tokens"]
        overhead = profile.step_overhead_s.get("vanilla", 0.0)
        return [vanilla_forward_seconds(profile.target, len(self.ids[p.id]), budget, overhead)
                for p in self.settings.tuning]

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
