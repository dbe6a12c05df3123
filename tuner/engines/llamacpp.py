"""``LlamaCppEvaluator``: measure a configuration inside llama.cpp's ``llama-server``.

Two servers on loopback, started from the same binary and GGUF files: the *baseline* (no
speculative flags, started once) and the *method* server (the trial's speculative flags; this
llama.cpp version takes no speculative settings per request, so a trial whose flags differ from the
running method server restarts it, and the restart time is recorded). Both have one slot per
request of the largest concurrency level (``--parallel``, continuous batching).

Per concurrency level c and per batch of c prompts (cycled so that c requests are really in
flight), the baseline and the method answer the same batch one after the other (order alternating
between batches); each request is a ``Measurement`` with the client's wall time and the server's
own counts (``timings.draft_n`` / ``draft_n_accepted``; at c = 1 per-position acceptance from the
``/metrics`` counters read around the request). At temperature 0 the method's tokens must equal the
baseline's at the same level; a difference is excused as a near-tie only when, in the baseline's
own distribution after the same prefix (re-asked untimed with ``n_probs``), the two tokens'
log-probabilities (= their logit gap) are within ``near_tie_ulps`` units of ``near_tie_dtype`` at
``|logit| = 32`` — llama-server does not expose raw logits, and SmolLM2's stay below 32.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch

from decoding.models import load_tokenizer
from tuner.config.engines import check_binary
from tuner.config.validate import check_generation_fits
from tuner.engines.client import get_text, send_batch
from tuner.engines.gguf import model_files
from tuner.config.errors import ConfigError
from tuner.engines.server import EngineError, EngineServer
from tuner.measure.evaluator import BaselineStore, Evaluation, Paired
from tuner.measure.hygiene import ContentionGuard, allowed_cpus, configure_threads
from tuner.measure.levels import level_summary
from tuner.measure.lossless import LosslessViolation, first_difference, ulp
from tuner.measure.measurement import Measurement, paired_speedup, summarize
from tuner.search.space import is_active

if TYPE_CHECKING:
    from tuner.study.settings import StudySettings
    from tuner.tasks.task import Prompt

NEAR_TIE_LOGIT_SCALE = 32.0     # |logit| bound for the near-tie tolerance (see module doc)
LEVEL_STRIDE = 100_000          # pruner steps: level index * stride + the prompt's index
METRIC_ACCEPTED = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
METRIC_DRAFTS = "llamacpp:spec_decode_num_drafts_total"


class LlamaCppEvaluator:
    """The llama-server evaluator (see the module docstring)."""

    def __init__(self, settings: StudySettings, say: Callable[[str], None] = print) -> None:
        self.settings, self.say = settings, say
        self.engine = dict(settings.engine)
        self.mapping = dict(settings.method["engine"])
        self.prompts = {p.id: p for p in settings.tuning + settings.held_out}
        self.log_dir = Path(settings.studies_dir) / settings.name / "engine"
        self.baseline: EngineServer | None = None
        self.method_server: EngineServer | None = None
        self.method_flags: list[str] | None = None
        self.restarts: list[float] = []
        self.threads = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        s = self.settings
        configure_threads(s.threads)                 # our own process (tokeniser, client)
        self.threads = int(self.engine.get("threads") or
                           (s.threads if isinstance(s.threads, int) else len(allowed_cpus())))
        self.guard = ContentionGuard(s.contention, max_wait_s=s.contention_wait_s)
        self.slots = max(s.concurrency)              # one slot per request in flight
        self.binary = check_binary(self.engine)
        self.target, self.draft = model_files(self.engine, s.models, s.method["needs_draft"],
                                              self.binary.parent / "llama-quantize")
        self.baseline = EngineServer(self.argv([]), "baseline", self.log_dir,
                                     startup_timeout_s=float(self.engine["startup_timeout_s"]))
        try:
            self.baseline.start()
        except EngineError as err:          # the plain server: the model (or flags) it refuses
            last = [ln for ln in self.baseline.log_tail(40).splitlines()
                    if "error" in ln.lower() or "failed" in ln.lower()]
            raise ConfigError(f"models.target: llama-server could not load {self.target.path} "
                              f"({(last or [str(err).splitlines()[0]])[-1].strip()}); its log: "
                              f"{self.baseline.log_path}") from None
        try:                                # token ids in and out: the prompts' exact tokens
            self.tokenizer = tokenizer = load_tokenizer(s.models["target"])
        except (OSError, ValueError) as err:
            raise ConfigError(f"models.target: its tokenizer cannot be read from "
                              f"{self.target.source} ({str(err).splitlines()[0]})") from None
        self.ids = {i: s.task.encode(p, tokenizer) for i, p in self.prompts.items()}
        check_generation_fits(max(len(v) for v in self.ids.values()),
                              s.budget["max_new_tokens"], int(self.engine["ctx_per_slot"]),
                              f"llama-server (engine.ctx_per_slot={self.engine['ctx_per_slot']})")
        self.say(f"engine llamacpp: {self.binary} ({self.build_info()}), target "
                 f"{self.target.describe()}" + (f", draft {self.draft.describe()}"
                                                if self.draft else "") +
                 f", {self.slots} slot(s), {self.threads} thread(s)")

    def close(self) -> None:
        for server in (self.method_server, self.baseline):
            if server is not None:
                server.stop()

    def describe(self) -> dict[str, str]:
        return {"engine": "llamacpp", "build": self.build_info(), "threads": str(self.threads),
                "target": self.target.describe(),
                "draft": self.draft.describe() if self.draft else "none",
                "energy": "unavailable: llama.cpp runs on the CPU here (no NVML)"}

    def build_info(self) -> str:
        found = self.binary.parent.parent / "build.json"
        if found.is_file():
            info = json.loads(found.read_text())
            return f"llama.cpp {info['commit']} from {info['sdist']}, sha256 " \
                   f"{info['llama_server_sha256'][:12]}"
        return f"binary {self.binary}"

    # -- servers and their flags -----------------------------------------------------------------

    def argv(self, flags: Sequence[str], port: str = "{port}") -> list[str]:
        """The full llama-server command for these speculative flags (a deployable line)."""
        argv = [str(self.binary), "-m", str(self.target.path), "--host", "127.0.0.1",
                "--port", port, "-np", str(self.slots),
                "-c", str(int(self.engine["ctx_per_slot"]) * self.slots),
                "-t", str(self.threads), "-tb", str(self.threads), "--metrics", "--no-webui",
                *[str(a) for a in self.engine.get("extra_args") or []]]
        if flags and self.draft is not None:
            argv += ["-md", str(self.draft.path)]
        return argv + list(flags)

    def flags(self, params: Mapping[str, Any]) -> list[str]:
        """The speculative flags of ``params``: fixed ones, then each active knob's flag."""
        out = [str(x) for kv in self.mapping["flags"].items() for x in kv]
        space = self.settings.space
        for name, flag in self.mapping["knobs"].items():
            if name not in params or (name in space and not is_active(name, space[name], params)):
                continue
            value = params[name]
            out += [str(flag).format(**params), str(value).lower() if isinstance(value, bool)
                    else str(value)]
        return out

    def deployment(self, params: Mapping[str, Any]) -> dict[str, str]:
        """The exact launch line and request fields the winner was measured with."""
        request = {k: v for k, v in self.payload(self.settings.tuning[0], True).items()
                   if k not in ("prompt", "return_tokens", "stream")}
        return {"launch": self.launch_line(params), "request": json.dumps(request),
                "build": self.build_info()}

    def launch_line(self, params: Mapping[str, Any], port: int = 8080) -> str:
        line = self.argv(self.flags(params), str(port))
        line[0] = "llama-server"
        return shlex.join(line)

    def _method_server(self, flags: list[str]) -> EngineServer:
        if self.method_server is not None and self.method_flags == flags and \
                self.method_server.alive():
            return self.method_server
        if self.method_server is not None:
            self.method_server.stop()
        self.method_flags = flags
        self.method_server = EngineServer(self.argv(flags), "method", self.log_dir,
                                          startup_timeout_s=float(self.engine["startup_timeout_s"]))
        self.method_server.start()
        self.restarts.append(self.method_server.startup_s)
        return self.method_server

    # -- measuring -------------------------------------------------------------------------------

    def payload(self, prompt: Prompt, method: bool) -> dict[str, Any]:
        """One ``/completion`` request: token ids in, token ids out, no prompt cache reuse (each
        request prefills, so paired timings compare like with like), the study's sampling."""
        s = self.settings
        sampling = s.sampling
        return {"prompt": self.ids[prompt.id], "n_predict": s.budget["max_new_tokens"],
                "temperature": float(sampling["temperature"]), "top_k": int(sampling["top_k"]),
                "top_p": float(sampling["top_p"]), "min_p": 0.0, "seed": s.seed,
                "samplers": ["top_k", "top_p", "temperature"], "cache_prompt": False,
                "return_tokens": True, "stream": False}

    def measure(self, params: Mapping[str, Any], prompts: Sequence[tuple[int, Prompt]],
                parity: int, store: BaselineStore | None = None) -> Iterator[Paired]:
        server = self._method_server(self.flags(params))
        self._warmup(server)
        k = 0
        for level_index, level in enumerate(self.settings.concurrency):
            for batch in batches(prompts, level):
                k += 1
                load = self.guard.check()
                sides = [(self.baseline, False), (server, True)]
                if (parity + k) % 2:                        # alternate which side goes first
                    sides.reverse()
                answers = {method: self._send(srv, batch, method, level) for srv, method in sides}
                for (index, prompt), ref, got in zip(batch, answers[False], answers[True]):
                    got = replace(got, speedup=paired_speedup(ref, got),
                                  other_load=load.other_busy, contended=load.contended,
                                  waited_s=load.waited_s)
                    yield Paired(level_index * LEVEL_STRIDE + index, self._check(got, ref, prompt),
                                 ref, True)

    def _warmup(self, server: EngineServer) -> None:
        for srv, method in ((self.baseline, False), (server, True)):
            for prompt in self.settings.tuning[: self.settings.warmup_prompts]:
                send_batch(srv.url + "/completion", [self.payload(prompt, method)])

    def _send(self, server: EngineServer, batch: Sequence[tuple[int, Prompt]], method: bool,
              level: int) -> list[Measurement]:
        before = self._counters(server) if method and level == 1 else None
        replies, wall = send_batch(server.url + "/completion",
                                   [self.payload(p, method) for _, p in batch])
        positions = None
        if before is not None:
            after = self._counters(server)
            positions = (tuple(a - b for a, b in zip(after[0], pad(before[0], len(after[0])))),
                         after[1] - before[1])
        return [self._measurement(prompt, r.body, r.wall_s, level, wall, positions)
                for (_, prompt), r in zip(batch, replies)]

    def _measurement(self, prompt: Prompt, body: Mapping[str, Any], wall_s: float, level: int,
                     batch_wall_s: float, positions: tuple | None) -> Measurement:
        t = body.get("timings") or {}
        tokens = tuple(int(x) for x in body.get("tokens") or [])
        accepted = int(t.get("draft_n_accepted") or 0)
        accepted_pos, drafted_pos = (), ()
        if positions is not None and positions[1] > 0:     # c = 1: this request's counters
            accepted_pos = positions[0]
            drafted_pos = (positions[1],) * len(accepted_pos)
        return Measurement(prompt.id, prompt.category, tokens, str(body.get("content", "")),
                           wall_s, max(len(tokens) - accepted, 1), int(t.get("draft_n") or 0),
                           accepted, 0.0, 0.0, accepted_pos, drafted_pos,
                           truncated=len(tokens) >= self.settings.budget["max_new_tokens"],
                           concurrency=level, batch_wall_s=batch_wall_s,
                           prompt_s=float(t.get("prompt_ms", 0.0)) / 1e3,
                           decode_s=float(t.get("predicted_ms", 0.0)) / 1e3)

    def _counters(self, server: EngineServer) -> tuple[tuple[int, ...], int]:
        """(accepted tokens per draft position, drafts) so far, from ``/metrics``."""
        accepted, drafts = {}, 0
        for line in get_text(server.url + "/metrics").splitlines():
            if line.startswith(METRIC_ACCEPTED + "{"):
                position = int(line.split('position="', 1)[1].split('"', 1)[0])
                accepted[position] = int(float(line.rsplit(" ", 1)[1]))
            elif line.startswith(METRIC_DRAFTS + " "):
                drafts = int(float(line.rsplit(" ", 1)[1]))
        return tuple(accepted.get(i, 0) for i in range(len(accepted))), drafts

    # -- the lossless check ----------------------------------------------------------------------

    def _check(self, got: Measurement, ref: Measurement, prompt: Prompt) -> Measurement:
        if not (self.settings.greedy and self.settings.lossless):
            return got
        position = first_difference(got.tokens, ref.tokens)
        if position is None:
            return replace(got, matches_vanilla=True)
        where = (f"prompt {prompt.id} (concurrency {got.concurrency}) differs from llama.cpp's "
                 f"own non-speculative output at new-token position {position}")
        if position >= len(ref.tokens) or position >= len(got.tokens):
            raise LosslessViolation(f"{where}: one output stops early ({len(got.tokens)} vs "
                                    f"{len(ref.tokens)} tokens)")
        gap = self._logit_gap(prompt, ref.tokens[:position], ref.tokens[position],
                              got.tokens[position])
        dtype = getattr(torch, str(self.engine.get("near_tie_dtype", "float16")))
        tolerance = self.settings.near_tie_ulps * ulp(NEAR_TIE_LOGIT_SCALE, dtype)
        if gap is None or gap > tolerance:
            shown = "not among the baseline's top 20" if gap is None else f"{gap:.4g}"
            raise LosslessViolation(f"{where}: its token's log-probability trails the "
                                    f"baseline's by {shown} (near-tie tolerance {tolerance:.3g}: "
                                    f"near_tie_ulps={self.settings.near_tie_ulps:g} of {dtype})")
        return replace(got, matches_vanilla=False, near_tie=True)

    def _logit_gap(self, prompt: Prompt, prefix: Sequence[int], chosen: int,
                   other: int) -> float | None:
        """log p(chosen) − log p(other) in the baseline after prompt + prefix (untimed)."""
        request = {**self.payload(prompt, False), "n_predict": 1, "n_probs": 20,
                   "post_sampling_probs": False,
                   "prompt": list(self.ids[prompt.id]) + list(prefix)}
        replies, _ = send_batch(self.baseline.url + "/completion", [request])
        probs = replies[0].body["completion_probabilities"][0]["top_logprobs"]
        logprob = {int(p["id"]): float(p["logprob"]) for p in probs}
        if chosen not in logprob or other not in logprob:
            return None
        return logprob[chosen] - logprob[other]

    # -- after the timed window ------------------------------------------------------------------

    def assess(self, pairs: Sequence[Paired]) -> Evaluation:
        device = torch.device("cpu")
        ms = [p.method for p in pairs]
        refs = [p.baseline for p in pairs]
        summary = summarize(ms, None, device)
        summary["vanilla_tokens_per_s"] = sum(r.new_tokens for r in refs) / \
            sum(r.wall_s for r in refs)
        summary.update(level_summary(pairs))
        if self.restarts:
            summary["engine_restart_s"] = self.restarts[-1]
        method_quality, _ = self.settings.task.score(
            [self.prompts[m.prompt_id] for m in ms], [m.text for m in ms])
        summary.update({f"quality_{k}": float(v) for k, v in method_quality.items()})
        baseline = summarize([replace(r, speedup=1.0) for r in refs], None, device)
        return Evaluation(summary, tuple(ms), tuple(refs), baseline)


def batches(prompts: Sequence[tuple[int, Prompt]], level: int
            ) -> list[list[tuple[int, Prompt]]]:
    """Batches of ``level`` prompts covering every prompt at least once (cycled when fewer)."""
    count = -(-len(prompts) // level)
    return [[prompts[(b * level + j) % len(prompts)] for j in range(level)]
            for b in range(count)]


def pad(values: Sequence[int], length: int) -> tuple[int, ...]:
    return tuple(values) + (0,) * (length - len(values))
