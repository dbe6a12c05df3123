"""``ServerEvaluator``: the backend every engine server shares (llama.cpp, vLLM).

Two servers on loopback, started from the same engine and model files: the *baseline* (no
drafting) and the *method* server (the trial's speculative settings; a trial whose settings
differ from the running method server restarts it, and the restart time is recorded). Both have
one slot per request of the largest concurrency level. The baseline is the method server's
launch line with drafting made impossible (``drafting_off``), so that drafting is the only
difference between the sides: llama-server sizes its compute graph for the longest draft, and
the prompt's prefill ran up to 20 % faster or slower with that size alone (docs/engines.md,
"the baseline"); an engine without such a form runs its plain server (``drafting_off`` None).
The baseline restarts when that form changes. ``control`` measures the baseline against a
second server launched exactly so (an A/A control: ``tuner.measure.control``).

The paired protocol (warm-up, batches per level, alternating order, the contention guard, the
lossless check with its one near-tie rule, ``assess``) is ``tuner.measure.paired``'s; this
backend sends a batch to one server (``run``: every request a ``Measurement`` with the client's
wall time and the server's own counts), waits for quiet CPUs between sides (``settle``), and
reads the near-tie gap (``gap``): the two tokens' log-probabilities in the baseline's answer
after the same prefix — which differ exactly by their logit gap — within ``near_tie_ulps`` units
of ``engine.near_tie_dtype`` at ``|logit| = 32`` (servers expose log-probabilities, not raw
logits; the embedded default's logits stay below 32).

An engine module subclasses this with what differs between engines: how its models are prepared
(``prepare_models``), its command line (``argv``) and speculative settings (``spec``), its request
(``payload``, ``endpoint``), how an answer becomes a ``Measurement`` (``measurement``), its
acceptance counters (``counters``), the log-probability request of the near-tie check
(``logprobs``), and what identifies its build (``build_info``).
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from decoding.acceptance import AcceptanceCounts
from decoding.models import load_tokenizer
from tuner.config.errors import ConfigError
from tuner.config.union import is_union, member_of
from tuner.config.validate import check_generation_fits
from tuner.engines.client import Reply, send_batch
from tuner.engines.server import EngineError, EngineServer
from tuner.engines.stream import send_schedule
from tuner.measure.bounds import ImpossibleMeasurement, rate_beyond
from tuner.measure.evaluator import BaselineStore, Evaluation, MeasureSettings, Paired
from tuner.measure.hygiene import allowed_cpus, configure_threads, sample_other_load
from tuner.measure.lossless import Gap, ulp
from tuner.measure.measurement import Measurement
from tuner.measure.paired import assess, measure_pairs
from tuner.measure.rates import measure_rates
from tuner.measure.traffic import StreamedRequest

if TYPE_CHECKING:
    from tuner.engines.servers import ServerEngine
    from tuner.tasks.task import Prompt

NEAR_TIE_LOGIT_SCALE = 32.0     # |logit| bound for the near-tie tolerance (see module doc)
SETTLE_MAX_S = 5.0              # before each timed side: wait at most this long for quiet CPUs
SETTLE_WINDOW_S = 0.1           # ... sampled in windows of this length

Spec = Any                      # an engine's speculative settings (flags, a config), comparable


def baseline_spec(engine: Mapping[str, Any], spec: Spec,
                  drafting_off: Callable[[Spec], Spec]) -> Spec:
    """The baseline's settings beside a method server of ``spec``: ``drafting_off(spec)``; None
    (the plain server) where ``spec`` is none, that form is empty, or ``engine.baseline=plain``
    (the plain server always, as before the A/A control found the prefill gap)."""
    if not spec or engine.get("baseline", "matched") == "plain":
        return None
    return drafting_off(spec) or None


class ServerEvaluator:
    """The shared protocol (see the module docstring); engines override the hooks below."""

    # the engine object's class: what the engine declares (its name, how messages show it, the
    # knob of drafted tokens) is read from it, never repeated here
    kind: ClassVar[type[ServerEngine]]
    endpoint = "/completion"    # the generation endpoint both servers answer
    health = "/health"          # answers 200 once a server can take requests
    server_name = "server"      # the engine's program as launched, in messages

    @property
    def name(self) -> str:
        """engine.kind, in messages."""
        return self.kind.name

    @property
    def display(self) -> str:
        """In the lossless message: "differs from <display>'s own ..."."""
        return self.kind.display

    def __init__(self, settings: MeasureSettings, say: Callable[[str], None] = print) -> None:
        self.settings, self.say = settings, say
        self.engine = dict(settings.engine)
        self.mapping = dict(settings.method.get("engine") or {})   # one method's (a union:
        #                                                            each member's, ``member``)
        self.prompts = {p.id: p for p in settings.tuning + settings.held_out}
        self.log_dir = Path(settings.work_dir) / "engine"
        self.baseline: EngineServer | None = None
        self.baseline_spec: Spec = None       # the running baseline's settings (None: plain)
        self.method_server: EngineServer | None = None
        self.method_spec: Spec = None
        self.restarts: list[float] = []
        self.threads = 0
        self.baseline_name = f"{self.display}'s own non-speculative output"
        self.quality_cache: dict[tuple, dict] = {}
        self.rated: dict[str, float] = {}    # the last measure's request-rate figures
        self.rate_requests: dict = {}         # ... and each rate's streamed requests (control)
        self.said_beyond = False              # search.profile: extrapolation said once
        self.profile = settings.profile       # search.profile, until it fails its check
        self.bound_slack = settings.bound_slack   # tuner.measure.bounds (an A/A control may
        #                                           widen it)

    def member(self, params: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, Any]]:
        """(the method config, its parameters) that build ``params``: a union of methods'
        member (``tuner.config.union.member_of``: its own engine mapping, space and names),
        else the study's method with this evaluator's ``mapping``."""
        method = self.settings.method
        if is_union(method):
            _, member, own = member_of(method, params)
            return member, own
        return {**method, "engine": self.mapping}, dict(params)

    def members(self) -> list[Mapping[str, Any]]:
        """The method configs this study may launch: a union's members, else its method."""
        method = self.settings.method
        return list(method["members"].values()) if is_union(method) else [method]

    # -- hooks -----------------------------------------------------------------------------------

    def prepare_models(self) -> None:
        """Make the model files the servers load (sets what ``argv`` reads)."""
        raise NotImplementedError

    def argv(self, spec: Spec, port: str = "{port}") -> list[str]:
        """The full server command with these speculative settings (None: none)."""
        raise NotImplementedError

    def spec(self, params: Mapping[str, Any]) -> Spec:
        """The engine's speculative settings for ``params``."""
        raise NotImplementedError

    def drafting_off(self, spec: Spec) -> Spec:
        """``spec``'s server with drafting made impossible and all else alike (None: the plain
        server; engines that can keep the rest, llama.cpp, override it)."""
        return None

    def server_env(self) -> dict[str, str] | None:
        """The servers' environment (None: the tuner's own)."""
        return None

    def payload(self, prompt: Prompt, method: bool) -> dict[str, Any]:
        """One generation request: the prompt's token ids, the study's budget and sampling."""
        raise NotImplementedError

    def measurement(self, prompt: Prompt, body: Mapping[str, Any], wall_s: float, level: int,
                    batch_wall_s: float, counted: AcceptanceCounts | None) -> Measurement:
        """A server's answer as a ``Measurement`` (``counted``: ``counters`` delta or None)."""
        raise NotImplementedError

    def send_together(self, server: EngineServer, payloads: Sequence[Mapping[str, Any]]
                      ) -> tuple[list[Reply], float]:
        """One timed batch: every payload in flight at once (``tuner.engines.client
        .send_batch``: a connection each); the replies in payload order and the batch's wall
        time. Engines that can queue a batch as one request (llama.cpp) override it, so that
        every batch starts alike on both sides of a pair."""
        return send_batch(server.url + self.endpoint, payloads)

    def stream_payload(self, prompt: Prompt, method: bool) -> dict[str, Any]:
        """``payload`` asking for its tokens as server-sent events."""
        return {**self.payload(prompt, method), "stream": True}

    @staticmethod
    def parse_stream(chunk: Mapping[str, Any]) -> tuple[Sequence[int], int | None, bool]:
        """One streamed event: (its token ids, the tokens generated so far by the server's
        count or None, whether it is the last; ``tuner.engines.stream.Parse``); engines that
        stream (``Engine.streams``) define it."""
        raise NotImplementedError

    def counters(self, server: EngineServer) -> AcceptanceCounts | None:
        """The server's acceptance counters, read around a request at concurrency 1 (None: not
        read)."""
        return None

    def logprobs(self, prompt: Prompt, prefix: Sequence[int],
                 tokens: Sequence[int]) -> dict[int, float]:
        """The baseline's log-probabilities of ``tokens`` after prompt + prefix (untimed)."""
        raise NotImplementedError

    def build_info(self) -> str:
        raise NotImplementedError

    def model_info(self) -> dict[str, str]:
        """What the servers load, for the records (``prepare_models`` sets target, draft)."""
        return {"target": self.target.describe(),
                "draft": self.draft.describe() if self.draft else "none"}

    def context_limit(self) -> int:
        """Tokens one request may hold (prompt + output)."""
        return int(self.engine["ctx_per_slot"])

    def energy_note(self) -> str:
        return f"unavailable: {self.name} runs on the CPU here (no NVML)"

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        s = self.settings
        configure_threads(s.threads)                 # our own process (tokeniser, client)
        self.threads = int(self.engine.get("threads") or
                           (s.threads if isinstance(s.threads, int) else len(allowed_cpus())))
        self.guard = s.contention_guard()
        self.slots = max(s.concurrency)              # one slot per request in flight
        self.prepare_models()
        self.baseline = self._server(None, "baseline")
        try:
            self.baseline.start()
        except EngineError as err:          # the plain server: the model (or flags) it refuses
            last = [ln for ln in self.baseline.log_tail(40).splitlines()
                    if ("error" in ln.lower() or "failed" in ln.lower())
                    and "errors.pydantic.dev" not in ln]
            raise ConfigError(f"models.target: {self.server_name} could not load "
                              f"{self.model_info()['target']} "
                              f"({(last or [str(err).splitlines()[0]])[-1].strip()}); its log: "
                              f"{self.baseline.log_path}") from None
        try:                                # token ids in and out: the prompts' exact tokens
            self.tokenizer = tokenizer = load_tokenizer(s.models["target"])
        except (OSError, ValueError) as err:
            raise ConfigError(f"models.target: its tokenizer cannot be read "
                              f"({str(err).splitlines()[0]})") from None
        self.ids = {i: s.task.encode(p, tokenizer) for i, p in self.prompts.items()}
        check_generation_fits(max(len(v) for v in self.ids.values()),
                              s.budget["max_new_tokens"], self.context_limit(),
                              f"{self.server_name} (engine.ctx_per_slot="
                              f"{self.engine['ctx_per_slot']})")
        shown = ", ".join(f"{k} {v}" for k, v in self.model_info().items())
        self.say(f"engine {self.name}: {self.build_info()}, {shown}, {self.slots} slot(s), "
                 f"{self.threads} thread(s), baseline up in {self.baseline.startup_s:.1f} s")

    def close(self) -> None:
        for server in (self.method_server, self.baseline):
            if server is not None:
                server.stop()

    def describe(self) -> dict[str, str]:
        return {"engine": self.name, "build": self.build_info(), "threads": str(self.threads),
                **self.model_info(), "energy": self.energy_note()}

    def _server(self, spec: Spec, name: str) -> EngineServer:
        return EngineServer(self.argv(spec), name, self.log_dir, health=self.health,
                            startup_timeout_s=float(self.engine["startup_timeout_s"]),
                            env=self.server_env())

    def server_groups(self) -> list[int]:
        """The process groups of the servers running now (each its own session)."""
        return [s.proc.pid for s in (self.baseline, self.method_server)
                if s is not None and s.alive()]

    def _method_server(self, spec: Spec) -> EngineServer:
        if self.method_server is not None and self.method_spec == spec and \
                self.method_server.alive():
            return self.method_server
        if self.method_server is not None:
            self.method_server.stop()
        self.method_spec = spec
        self.method_server = self._server(spec, "method")
        self.method_server.start()
        self.restarts.append(self.method_server.startup_s)
        return self.method_server

    def _baseline_beside(self, spec: Spec) -> EngineServer:
        """The baseline for a method server of ``spec`` (``baseline_spec``), restarted where the
        running one was launched otherwise."""
        wanted = baseline_spec(self.engine, spec, self.drafting_off)
        if self.baseline is not None and self.baseline_spec == wanted and \
                self.baseline.alive():
            return self.baseline
        if self.baseline is not None:
            self.baseline.stop()
        self.baseline_spec = wanted
        self.baseline = self._server(wanted, "baseline")
        self.baseline.start()
        return self.baseline

    # -- the deployable answer -------------------------------------------------------------------

    def launch_line(self, params: Mapping[str, Any], port: int = 8000) -> str:
        line = self.argv(self.spec(params), str(port))
        line[0] = Path(line[0]).name
        return shlex.join(line)

    def speculative_base(self, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The fixed entries of a vLLM speculative config (``VllmEvaluator``); None here."""
        return None

    def deployment(self, params: Mapping[str, Any],
                   per_level: Mapping[int, Mapping[str, Any] | None] | None = None
                   ) -> dict[str, Any]:
        """The exact launch line and request fields (nested data) the winner was measured
        with."""
        request = {k: v for k, v in self.payload(self.settings.tuning[0], True).items()
                   if k not in ("prompt", "return_tokens", "return_token_ids", "stream")}
        return {"launch": self.launch_line(params), "request": request,
                "build": self.build_info()}

    # -- measuring: the paired protocol (tuner.measure.paired) on two servers --------------------

    def measure(self, params: Mapping[str, Any], prompts: Sequence[tuple[int, Prompt]],
                parity: int, store: BaselineStore | None = None) -> Iterator[Paired]:
        """The paired protocol with the method server of ``params`` (a server engine always
        measures its baseline beside it: ``baseline=per_trial``)."""
        spec = self.spec(params)
        self._baseline_beside(spec)
        server = self._method_server(spec)
        yield from self._pairs_and_rates(server, prompts, parity)

    def control(self, params: Mapping[str, Any], prompts: Sequence[tuple[int, Prompt]],
                parity: int, levels: Sequence[int] | None = None,
                rates: bool = True) -> Iterator[Paired]:
        """The A/A control of ``params``' path: the baseline as ``measure`` runs it beside that
        method server, against a second server launched with the method's line and drafting off
        (``drafting_off``; the plain server where the engine has no such form), by the same
        protocol (levels, rates, settle, order); ``levels``: these only, ``rates``: False
        leaves the request rates out (the guard before a study's first trial)."""
        spec = self.spec(params)
        self._baseline_beside(spec)
        server = self._method_server(self.drafting_off(spec) if spec else spec)
        yield from self._pairs_and_rates(server, prompts, parity, levels, rates, bounded=False)

    def _pairs_and_rates(self, server: EngineServer, prompts: Sequence[tuple[int, Prompt]],
                         parity: int, levels: Sequence[int] | None = None,
                         rates: bool = True, bounded: bool = True) -> Iterator[Paired]:
        """The pairs at every level, then the request rates (the same prompts in order, not
        shuffled: every trial the same), their ratios held to the largest tokens per decode step
        the pairs counted (``tuner.measure.bounds.rate_beyond``: measured again once, then
        ``ImpossibleMeasurement``; ``bounded`` False: an A/A control, which reports them)."""
        self.rated, self.rate_requests = {}, {}
        lengths = []
        slack = self.bound_slack if bounded else math.inf
        for pair in measure_pairs(self, server, prompts, parity, levels=levels,
                                  bounded=bounded):
            lengths.append(pair.method.counts.tokens_per_decode_step)
            yield pair
        if not self.settings.traffic.rates or not rates:
            return
        in_order = [p for _, p in sorted(prompts, key=lambda pair: pair[0])]
        longest = max(lengths, default=1.0)
        for attempt in range(2):
            self.rate_requests = {}
            rated = measure_rates(self, server, in_order, self.settings.traffic,
                                  self.settings.seed, parity + attempt, self.say,
                                  self.rate_requests)
            found = rate_beyond(rated, longest, slack)
            if not found:
                self.rated = rated
                return
            if not attempt:
                self.say(f"impossible: {found[0]}; measuring the request rates again")
        raise ImpossibleMeasurement(f"impossible measurement at a request rate, twice: "
                                    f"{found[0]}; every step costs at least one target "
                                    "forward, so the machine was disturbed or the two sides "
                                    "do not run alike (python -m tuner.control)")

    def warm_up(self, method: EngineServer, baseline: bool) -> None:
        for srv, is_method in ((self.baseline, False), (method, True)):
            for prompt in self.settings.tuning[: self.settings.warmup_prompts]:
                send_batch(srv.url + self.endpoint, [self.payload(prompt, is_method)])

    def run(self, method: EngineServer | None, batch: Sequence[tuple[int, Prompt]],
            level: int) -> list[Measurement]:
        return self._send(self.baseline if method is None else method, batch,
                          method is not None, level)

    def settle(self) -> None:
        """Wait (at most ``SETTLE_MAX_S``) until the CPUs are quiet before a timed side: a server
        that has just answered may keep a core busy for a while (vLLM's processes poll for
        about a second), which would slow the other side of the pair."""
        deadline = time.monotonic() + SETTLE_MAX_S
        while time.monotonic() < deadline:
            sample = sample_other_load(self.guard.cpus, SETTLE_WINDOW_S)
            if not self.guard.busy(sample):
                return

    def _send(self, server: EngineServer, batch: Sequence[tuple[int, Prompt]], method: bool,
              level: int) -> list[Measurement]:
        before = self.counters(server) if method and level == 1 else None
        replies, wall = self.send_together(server, [self.payload(p, method) for _, p in batch])
        counted = None if before is None else self.counters(server).minus(before)
        return [self.measurement(prompt, r.body, r.wall_s, level, wall, counted)
                for (_, prompt), r in zip(batch, replies)]

    # -- cost surfaces (tuner.predict.synthetic) -------------------------------------------------

    def drafted_params(self, k: int) -> dict[str, Any]:
        """The study's method drafting ``k`` tokens per step, its other settings the defaults: a
        draft model's ``draft_tokens_knob`` (every step exactly k: ``exact_draft``), or for a
        method that drafts without a model (n-gram lookup) the knob this engine declares its
        draft size by (``draft_size_knobs``: llama.cpp's ``size_m``, vLLM's
        ``num_speculative_tokens``)."""
        default = dict(self.settings.default)
        if self.settings.method["needs_draft"]:
            knob = self.kind.draft_tokens_knob
            if knob in self.mapping["knobs"]:
                return {**default, knob: k, **self.kind.exact_draft}
        else:
            knob = self.kind.draft_size_knob(self.settings.method, default)
            if knob is not None:
                return {**default, knob: k}
        raise ConfigError(f"method={self.settings.method_choice}: an engine's cost surface is "
                          "measured with draft-model speculation or n-gram drafting; allowed "
                          "are method=speculative, method=prompt_lookup")

    def synthetic_spec(self, k: int, length: float) -> Spec:
        """The method server's settings drafting ``k`` tokens per step, accepted at random with
        mean length ``length`` (the engine's synthetic-acceptance mode)."""
        raise ConfigError(f"engine={self.name}: its synthetic-acceptance cost surface is not "
                          "built yet; allowed are engine=llamacpp, engine=vllm")

    def check_synthetic(self, length: float) -> None:
        """One line where this install has no synthetic-acceptance mode (before any server)."""

    def synthetic_costs(self, ks: Sequence[int], levels: Sequence[int],
                        length: float | Mapping[int, float] | None,
                        rounds: int = 2, repeat: bool = False, load: Any = None) -> list[Any]:
        """Per k (0: the baseline server) and level: ``rounds`` batches of ``level`` tuning
        prompts (cycled, each request its own seed), after one untimed request per server;
        ``tuner.predict.synthetic.cell`` of the engine's own counts and times. ``length``: the
        mean accepted length asked (capped at k + 1), or one per k; None: no synthetic mode,
        the drafter's own acceptance (the step times are those of its real lengths).
        ``repeat``: each request's prompt as ``repeated`` makes it from the tuning prompts
        (n-gram drafting: the target copies on, so every step finds a k-token draft).
        ``load``: each cell's requests run through ``load.block(what, run)``
        (``tuner.predict.loops.ServedLoad``: other processes' load checked, a disturbed cell
        measured again); None: unchecked."""
        from tuner.predict.synthetic import cell
        block = load.block if load is not None else lambda what, run, timed=True: run()
        prompts = list(self.settings.tuning)
        tokens = int(self.settings.budget["max_new_tokens"])
        room = int(self.engine["ctx_per_slot"]) - tokens - 8

        # n-gram drafting: each prompt's copying request (``repeated``), seeded by its place
        special = set(getattr(self.tokenizer, "all_special_ids", None) or ())
        vocab = sorted({int(t) for p in prompts for t in self.ids[p.id]} - special)
        copies = {p.id: {"prompt": repeated(vocab, tokens, room, self.settings.seed + i),
                         "ignore_eos": True} for i, p in enumerate(prompts)} if repeat else {}
        out = []
        for k in (0, *ks):
            wanted = length.get(k, 1.0) if isinstance(length, Mapping) else length
            asked = None if k == 0 or wanted is None else min(float(wanted), k + 1.0)
            server = self._baseline_beside(None) if k == 0 else self._method_server(
                self.spec(self.drafted_params(k)) if asked is None else
                self.synthetic_spec(k, asked))
            first = [self.payload(prompts[0], k > 0)]      # untimed: the server's first
            block(f"k={k}: its server's untimed first request",
                  lambda: send_batch(server.url + self.endpoint, first), timed=False)
            for level in levels:
                def run(level: int = level) -> list:
                    runs = []
                    for r in range(rounds):
                        batch = [prompts[(r * level + i) % len(prompts)] for i in range(level)]
                        payloads = [{**self.payload(p, k > 0), "seed": self.settings.seed +
                                     r * level + i, **copies.get(p.id, {})}
                                    for i, p in enumerate(batch)]
                        replies, wall = send_batch(server.url + self.endpoint, payloads)
                        runs += [(self.measurement(p, reply.body, reply.wall_s, level, wall,
                                                   None),
                                  len(copies[p.id]["prompt"] if repeat else self.ids[p.id]))
                                 for p, reply in zip(batch, replies)]
                    return runs
                runs = block(f"k={k} at concurrency {level}", run)
                got = cell(level, k, asked, runs)
                out.append(got)
                self.say(f"  k={k} at concurrency {level}: {1e3 * got.step_s:.1f} ms per step, "
                         f"mean length {got.mean_length:.2f}"
                         + (f" (asked {asked:g})" if asked else
                            " (the drafter's own)" if k else "")
                         + (f", {got.drafted_per_step:.2f} drafted per step" if k else ""))
        return out

    def stream(self, server: EngineServer | None, prompts: Sequence[Prompt],
               offsets: Sequence[float], method: bool) -> list[StreamedRequest]:
        """``prompts[i]`` streamed from ``server`` (None: the baseline) at ``offsets[i]``
        (``tuner.measure.rates``)."""
        target = self.baseline if server is None else server
        payloads = [self.stream_payload(p, method) for p in prompts]
        return send_schedule(target.url + self.endpoint, payloads, offsets, self.parse_stream)

    def gap(self, prompt: Prompt, prefix: Sequence[int], chosen: int, other: int) -> Gap:
        """The two tokens' log-probabilities in the baseline's answer after prompt + prefix
        (they differ exactly by their logit gap), against ``near_tie_ulps`` units of
        ``engine.near_tie_dtype`` at ``|logit| = NEAR_TIE_LOGIT_SCALE``."""
        found = self.logprobs(prompt, prefix, (chosen, other))
        value = found[chosen] - found[other] if chosen in found and other in found else None
        dtype = getattr(torch, str(self.engine.get("near_tie_dtype", "float16")))
        tolerance = self.settings.near_tie_ulps * ulp(NEAR_TIE_LOGIT_SCALE, dtype)
        shown = "not reported by the baseline" if value is None else f"{value:.4g}"
        return Gap(value, tolerance, f"its token's log-probability trails the baseline's by "
                   f"{shown} (near-tie tolerance {tolerance:.3g}: near_tie_ulps="
                   f"{self.settings.near_tie_ulps:g} of {dtype})")

    # -- after the timed window ------------------------------------------------------------------

    def assess(self, pairs: Sequence[Paired]) -> Evaluation:
        """The paired protocol's summary, with the request rates' figures of the same
        ``measure`` (none where it stopped early: a pruned trial)."""
        evaluation = assess(self, pairs)
        evaluation.summary.update(self.rated)
        self.rated = {}
        return evaluation

    def energy(self, ms: Sequence[Measurement]) -> None:
        """Servers run on this machine's CPU here: no NVML reading (``energy_note``)."""
        return None

    def log_prob(self, m: Measurement) -> float | None:
        """Not scored: the server holds the model."""
        return None

    def extra_summary(self, pairs: Sequence[Paired]) -> dict[str, float]:
        """The last restart's seconds; with ``search.profile`` (this engine's cost surface) the
        decode-phase speedup predicted per level from the trial's own acceptance there
        (``tuner.predict.served``: the cost side checked). A failed prediction loses the
        prediction only (one line), never the trial."""
        out = {"engine_restart_s": self.restarts[-1]} if self.restarts else {}
        profile = self.profile
        if profile is not None:
            from tuner.predict.served import DRAFTED, trial_predictions
            try:
                got = trial_predictions(pairs, profile)
                widest = max(profile.target.rows)
                if not self.said_beyond and any(
                        key.startswith(DRAFTED) and value + 1 > widest
                        for key, value in got.items()):
                    self.said_beyond = True
                    self.say(f"prediction: this setting drafts beyond the profile's widest step "
                             f"(k = {widest - 1}): priced by extending its last segment "
                             "(measure the profile with larger --ks to price it)")
                out.update(got)
            except Exception as err:          # noqa: BLE001 - a prediction never fails a trial
                self.say(f"prediction failed ({type(err).__name__}: {err}): this trial keeps "
                         "its measurement")
        return out


    def ranker(self) -> None:
        """No ranker: an engine's surface is the engine's own step times at each k
        (``tuner.predict.synthetic``), not checked against trial 0 nor priced before the first
        trial (the search's estimate comes from that trial); each trial's per-level prediction
        is shown beside its measurement (``extra_summary``)."""
        return None


def seconds(ms: Any) -> float | None:
    """A server's millisecond timing in seconds (None: not reported)."""
    return None if ms is None else float(ms) / 1e3


def repeated(vocab: Sequence[int], tokens: int, room: int, seed: int, start: int = 32
             ) -> list[int]:
    """A prompt that repeats a text and starts a third copy: ``tokens`` + ``start`` tokens drawn
    at random (seeded) from ``vocab`` (the tokens the task's prompts use, special ones left
    out), twice, then its first ``start`` tokens. A model continues the copy (induction: a random
    sequence has no n-gram of its own twice, where the tasks' texts led SmolLM2-135M off the
    copy after ~40 tokens at a repeated phrase) for ``tokens`` tokens, its end of text ignored
    (``ignore_eos``), and an n-gram lookup finds each next k tokens in the copies before, so a
    draft-free cost surface is measured at full-length drafts. Cut so that the whole holds at
    most ``room`` tokens (a request's context less its output)."""
    length = max(2, min(tokens + start, (room - start) // 2))
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(vocab), (length,), generator=generator).tolist()
    text = [vocab[i] for i in picks]
    return text + text + text[:start]
