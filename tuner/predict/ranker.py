"""The ranking of a search's points and every trial's prediction, on the models the in-process
evaluator loaded (``tuner.engines.inprocess``): the one thing ``search=predict`` ranks with.

A ``Ranker`` holds the pair, the study's prompts (token ids) and a way to build the method at a
point; from them it gives a point's acceptance (replayed on vanilla's trajectories where the
method's acceptance replays: ``decoding.replay``; else from untimed, traced runs:
``tuner.predict.trace``), prices it by the hardware profile (``tuner.predict.predict``) and
ranks many points at once (``rank_points``: replay where exact, successive halving where
untimed runs are needed, approximate then exact for draft-model chains). It also checks the
profile against trial 0's vanilla (``check_profile``: ``tuner.predict.check``), prices
vanilla for a search's cost (``vanilla_price``) and predicts a measured trial's speedup
(``trial_prediction``). Many methods' rankers together: ``tuner.predict.across``.

Who calls it, explicitly: ``tuner.run`` asks the evaluator for its ranker once the models are
loaded (``Evaluator.ranker()``; None for an engine server, whose prediction is per level from
its own surface) and hands it to trial 0's hook (``tuner.search.ranking.AfterDefault``: the
check, and ``search=predict``'s ranking), to the objective (each trial's prediction) and to the
finish (``search.predict_for``). Its caches (trajectories, untimed runs per point) are what let
a timed trial reuse the ranking's runs.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from tuner.measure.evaluator import ParametersRefused
from tuner.predict.workers import UntimedWorkers, attempt

if TYPE_CHECKING:
    from decoding.base import DecodingMethod
    from tuner.measure.evaluator import MeasureSettings, Paired
    from tuner.tasks.task import Prompt


def observed_key(method: DecodingMethod, params: Mapping[str, Any], prompts: Sequence[Prompt]
                 ) -> tuple:
    """The untimed-run cache's key: the point, and its prompts in their order for a method
    whose history carries across prompts (``keeps_history``), as a set otherwise."""
    ids = tuple(p.id for p in prompts)
    return (json.dumps(dict(params), sort_keys=True, default=str),
            ids if method.keeps_history else tuple(sorted(ids)))


class Ranker:
    """Acceptance, price and ranking of a method's points (see the module doc)."""

    def __init__(self, settings: MeasureSettings, pair: Any, ids: Mapping[str, Sequence[int]],
                 build: Callable[[Mapping[str, Any]], DecodingMethod], compiled: Any,
                 say: Callable[[str], None],
                 vanilla: Callable[[str], tuple[float, int]] | None = None) -> None:
        """``pair``: the loaded models (``target``, ``drafts``); ``ids``: every study prompt's
        token ids by prompt id; ``build(params)``: the method at every parameter (raises
        ``ParametersRefused``); ``compiled``: the compiled target a method runs on (None:
        eager), lent back after untimed runs, which need the model's own forwards;
        ``vanilla(prompt_id)``: vanilla timed on that prompt as a trial times it (its decode
        phase's seconds and tokens), for ``confirm_profile`` (None: not confirmed)."""
        self.settings, self.pair, self.ids, self.build = settings, pair, ids, build
        self.compiled, self.say, self.vanilla = compiled, say, vanilla
        self.prompts = {p.id: p for p in settings.tuning + settings.held_out}
        self.trajectories: dict[str, list[int]] = {}   # vanilla's, per prompt
        self.agreements: dict[str, list[bool]] = {}    # the draft's teacher-forced argmax hits
        # untimed generations per point (observed_key): the prompts' ids as run, the generations
        self.observed: dict[tuple, tuple[tuple[str, ...], list[Any] | None]] = {}
        self.warned_about: set[Any] = set()   # what a prediction's one-line notice has said
        self.profile = settings.profile       # search.profile, until it fails its check
        self.untimed_runs = 0                 # untimed, traced generations made (per prompt)

    def for_method(self, method_cfg: Mapping[str, Any],
                   build: Callable[[Mapping[str, Any]], DecodingMethod]) -> Ranker:
        """A ranker of another method (``method_cfg``, built by ``build``) on the same models,
        prompts and profile, sharing what does not depend on the method: vanilla's trajectories,
        the draft's agreements and the notices already said (a cross-method ranking computes
        each once). Untimed runs are kept per ranker: two methods' points may share names."""
        other = Ranker(replace(self.settings, method=dict(method_cfg)), self.pair, self.ids,
                       build, self.compiled, self.say, self.vanilla)
        other.trajectories, other.agreements = self.trajectories, self.agreements
        other.warned_about, other.profile = self.warned_about, self.profile
        return other

    def trial_prediction(self, params: Mapping[str, Any], pairs: Sequence[Paired]
                         ) -> dict[str, float]:
        """``search.profile``: the predicted speedup of ``params`` on the tuning prompts just
        measured as ``pairs`` (after
        the timed window, in the order measured; ``predict``); ``search.predict_for``: the same
        acceptance priced by the other machine's profile (``predicted_speedup_for``). The
        acceptance is replayed, or comes from an untimed run of the method (``acceptance``:
        ``search=predict``'s ranking made it before the timed run where the prompts' order does
        not matter, else it is made now). Held-out prompts are not predicted; a failed
        prediction loses the prediction only (one line), never the trial."""
        s = self.settings
        if self.profile is None and s.predict_for is None:
            return {}
        tuning = {p.id for p in s.tuning}
        prompts = [self.prompts[p.method.prompt_id] for p in pairs]
        if not prompts or any(p.id not in tuning for p in prompts):
            return {}
        start = time.perf_counter()
        try:
            method = self.build(params)
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
            part = self.part_observed(method, params, prompts)
            self.keep(key, prompts, part if part is not None else self.observe(method, prompts))
        return self.observed[key][1]

    def keep(self, key: tuple, prompts: Sequence[Prompt], generations: list[Any] | None
             ) -> None:
        """Untimed ``generations`` of a point on ``prompts`` (in that order), kept under
        ``key`` (``observed_key``)."""
        self.observed[key] = (tuple(p.id for p in prompts), generations)

    def part_observed(self, method: DecodingMethod, params: Mapping[str, Any],
                      prompts: Sequence[Prompt]) -> list[Any] | None:
        """The generations on ``prompts`` cut from a longer untimed run of the same point, or
        None: a trial pruned after its first prompts reads the ranking's run rather than making
        its own. For a method whose history carries across prompts (``keeps_history``) only
        a run that began with these prompts, in this order, from a fresh history holds them;
        otherwise any run on a superset does. At T > 0 the run's generations are seed-major
        (``observe``), and each seed's are cut alike."""
        point = observed_key(method, params, prompts)[0]
        ids = tuple(p.id for p in prompts)
        for key, (order, got) in self.observed.items():
            if key[0] != point or not got or len(got) % len(order):
                continue
            if order[:len(ids)] != ids if method.keeps_history else not set(ids) <= set(order):
                continue
            return [got[block + order.index(i)] for block in range(0, len(got), len(order))
                    for i in ids]
        return None

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

    def observe(self, method: DecodingMethod, prompts: Sequence[Prompt], fresh: bool = True,
                keep: bool = False) -> list[Any] | None:
        """One untimed generation of ``method`` per prompt, in the order given, from a fresh
        history (``reset``, as after the warm-up), every forward of the target and the draft
        models traced (``tuner.predict.trace``); at T > 0 one such run per seed of
        ``UNTIMED_SEEDS`` seeds after the study's (never the timed runs' own), each generation
        tagged with its seed (the prediction averages them and gives their spread).
        ``fresh=False`` (T = 0): the method's history goes on from its last run; ``keep``: the
        history is kept after the run (successive halving adds a prompt to a point's runs as
        its timed trial comes to it: the first fresh and kept, the later ones go on). None where
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
                method, ids, models, s.budget["max_new_tokens"], seed, fresh=fresh, keep=keep)]
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
            method = self.build(params)
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
                    lambda i, value, cut: None, floor: float = float("-inf")
                    ) -> tuple[list[float], list[int | None]]:
        """``search=predict``'s ranking: every point's predicted speedup on ``prompts`` (in
        that order: a method that carries history runs them so, as its timed trials do) and,
        per point, the prompts it saw where successive halving cut it (None: all). Points whose
        acceptance replays are predicted on every prompt; the others (an untimed run per
        prompt) go through successive halving at T = 0 (``tuner.predict.halving``: every point
        on the first prompt, the best half kept for the next, ...; the rounds said), one full
        run per point at T > 0. ``known``: what an interrupted ranking kept, {index: (value,
        cut)}; ``on_point(i, value, cut)`` once a point's value is final. ``floor``: a halved
        point predicted below it on the prompts seen is cut (``tuner.predict.halving``, a
        floor: a ranking across methods sets it from its leader so far)."""
        from tuner.predict.halving import coordinate_sweep, successive_halving
        known = dict(known or {})
        prompts = list(prompts)
        values: list[float] = [float("-inf")] * len(points)
        cut: list[int | None] = [None] * len(points)
        halved: dict[int, tuple[Any, dict[str, Any]]] = {}
        chains: dict[int, Any] = {}
        replayed: list[int] = []
        for i, point in enumerate(points):
            if i in known:
                values[i], cut[i] = known[i]
                continue
            params = {**self.settings.default, **point}
            try:
                method = self.build(params)
            except ParametersRefused:
                on_point(i, values[i], None)
                continue
            if self.halves(method):
                halved[i] = (method, params)
            elif self.chain(method) is not None:
                chains[i] = method
            elif self.settings.untimed == "sweep" and self.settings.method["needs_draft"]:
                replayed.append(i)            # swept below: a dynamic tree's replay runs its
            else:                             # draft per point (seconds each)
                values[i] = self._priced(self.point_acceptance(i, point, len(points), prompts),
                                         point)
                on_point(i, values[i], None)
        if replayed:
            self._swept_replays(points, prompts, replayed, values, cut, on_point)
        if chains:
            self._two_fidelities(points, prompts, chains, values, cut, on_point)
        if not halved:
            return values, cut
        order = sorted(halved)
        runs: dict[int, list[Any] | None] = {i: [] for i in order}

        def score(j: int, n: int) -> float:
            got = runs[order[j]]
            return float("-inf") if not got or len(got) < n else \
                self._priced(got[:n], points[order[j]])

        def untimed(j: int, k: int, say: Callable[[str], None]) -> tuple[list[Any], int]:
            """Point j's untimed run on prompt k, in a worker or here: (its generations, the
            runs it made), what it says to ``say``."""
            own, self.say = self.say, say
            before = self.untimed_runs
            try:
                got = self.observe(halved[order[j]][0], [prompts[k]], fresh=k == 0, keep=True)
            finally:
                self.say = own
            return got or [], self.untimed_runs - before

        def run_round(js: Sequence[int], k: int) -> None:
            # a failed point, or one run on prompt k already (a sweep), is not run again
            todo = [j for j in js if runs[order[j]] is not None and len(runs[order[j]]) <= k]
            if pool is None:                  # here: observe counts its runs itself
                answers = {(j, k): attempt(untimed, j, k) for j in todo}
            else:
                answers = pool.run_round([(j, k) for j in todo],
                                         lambda j: halved[order[j]][0].keeps_history)
            for j in todo:
                done, i = answers[(j, k)], order[j]
                for line in done.lines:
                    self.say(line)
                if done.error is not None:
                    self.say(f"  {dict(points[i])}: not predicted ({done.error})")
                    runs[i] = None
                    continue
                got, count = done.value
                runs[i].extend(got)
                if pool is not None:          # a worker's own count stayed in its process
                    self.untimed_runs += count

        def run(j: int, k: int) -> None:
            run_round([j], k)

        began = time.perf_counter()
        count = min(self.settings.untimed_workers, len(order))
        if count > 1:
            self.say(f"  untimed runs on {count} worker processes, one thread each (the timed "
                     "runs keep the study's threads)")
        pool = UntimedWorkers(count, untimed) if count > 1 else None

        def said(r: Any) -> None:         # a round can take minutes: say each one
            self.say(f"  successive halving, prompt {r.prompts} of {len(prompts)}: {r.ran} "
                     f"points run, {r.kept} kept ({time.perf_counter() - began:.0f} s so far)")
        with pool if pool is not None else nullcontext():
            if self.settings.untimed == "sweep":     # Algorithm 1 on predictions
                def stage(name: str, h: Any) -> None:
                    self.say(f"  sweep of {name}: {len(h.values)} values, {h.runs()} untimed "
                             f"runs ({time.perf_counter() - began:.0f} s so far)")
                ordered = [points[i] for i in order]
                halving = coordinate_sweep(ordered, self._start(ordered), len(prompts), run,
                                           score, on_stage=stage, run_round=run_round,
                                           floor=floor)
                self.say(f"  {halving.line(len(prompts))}")
            else:
                halving = successive_halving(len(order), len(prompts), run, score,
                                             on_round=said, run_round=run_round, floor=floor)
                self.say(f"  {halving.line()}")
        for j, i in enumerate(order):
            method, params = halved[i]
            values[i], cut[i] = halving.values[j], halving.cut[j]
            if runs[i]:     # a timed trial of it reuses these runs (of a cut point: on the
                seen = prompts[:len(runs[i])]      # prompts it saw, should its trial be pruned)
                self.keep(observed_key(method, params, seen), seen, runs[i])
            method.reset()
            on_point(i, values[i], cut[i])
        return values, cut

    def _swept_replays(self, points: Sequence[Mapping[str, Any]], prompts: Sequence[Prompt],
                       replayed: Sequence[int], values: list[float], cut: list[int | None],
                       on_point: Callable[[int, float, int | None], None]) -> None:
        """``search.untimed=sweep``: replayed points by Algorithm 1's sweep (each reached point
        replayed on every prompt; the others cut at 0 prompts), from the default."""
        from tuner.predict.halving import coordinate_sweep
        got: dict[int, float] = {}

        def run(j: int, k: int) -> None:
            i = replayed[j]
            if i not in got:
                got[i] = self._priced(self.point_acceptance(i, points[i], len(points), prompts),
                                      points[i])
        start = self._start([points[i] for i in replayed])
        sweep = coordinate_sweep([points[i] for i in replayed], start, 1, run,
                                 lambda j, n: got.get(replayed[j], float("-inf")))
        for j, i in enumerate(replayed):
            values[i], cut[i] = sweep.values[j], sweep.cut[j]
            on_point(i, values[i], cut[i])
        self.say(f"  {sweep.line(1, runs='replays')}")

    def _start(self, points: Sequence[Mapping[str, Any]]) -> int:
        """Where a sweep starts: the method's default where it is one of ``points``, else the
        first."""
        default = self.settings.default
        return next((j for j, p in enumerate(points)
                     if all(default.get(k) == v for k, v in p.items())), 0)

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

    def needs_untimed(self, points: Sequence[Mapping[str, Any]]) -> bool:
        """Whether ranking ``points`` takes untimed runs that successive halving spreads over
        the prompts (``halves``: at temperature 0), judged by the first one the method builds (a
        method's points share how they are predicted). Full untimed runs at T > 0 are not
        counted: no floor acts on them."""
        for point in points:
            try:
                return self.halves(self.build({**self.settings.default, **point}))
            except ParametersRefused:
                continue
        return False

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
    def check_profile(self, pairs: Sequence[Paired]) -> Any:
        """``search.profile``'s vanilla against the default's (trial 0's) measured vanilla
        (``tuner.predict.check.check_against_trial_0``); None where nothing is checked."""
        from tuner.predict.check import check_against_trial_0
        return check_against_trial_0(self.profile, self.pair.target, self.ids, pairs)

    def confirm_profile(self, pairs: Sequence[Paired]) -> Any:
        """The check again, vanilla decoded now beside its 1-row forwards
        (``tuner.predict.check.confirm_against_trial_0``); None where nothing can be run."""
        from tuner.predict.check import confirm_against_trial_0
        return confirm_against_trial_0(self.profile, self.pair.target, self.ids, pairs,
                                       self.vanilla)

    def refuse_profile(self, line: str) -> None:
        """Stop predicting by ``search.profile`` (it failed its check: ``line`` says why)."""
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
