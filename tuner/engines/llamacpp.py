"""``engine=llamacpp``: llama.cpp's ``llama-server``; its engine object (``LlamaCppEngine``: GGUF
models only, its program, its identity) and its backend (``LlamaCppEvaluator``).

The protocol (two servers, paired interleaved batches per concurrency level, the lossless check
with its near-tie rule) is ``tuner.engines.serving``'s; this module says what is llama.cpp's own:

* every speculative knob is a server flag (this llama.cpp version compiles the per-request
  speculative fields out), so a trial whose flags differ from the running method server restarts
  it; ``--parallel`` = the largest concurrency level, ``-c`` = ``ctx_per_slot`` × slots, ``-t/-tb``
  = the CPUs the tuner may use;
* the models are GGUF files (``tuner.engines.gguf``: re-typed with llama-quantize where asked);
* each ``/completion`` answer carries the server's own ``timings`` (``draft_n``,
  ``draft_n_accepted``, prefill/decode milliseconds); at concurrency 1 the per-position acceptance
  comes from the ``/metrics`` counters read around the request;
* the near-tie check asks the baseline for ``n_probs`` log-probabilities (llama-server does not
  expose raw logits).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decoding.acceptance import AcceptanceCounts
from tuner.config.errors import ConfigError
from tuner.config.union import is_union, member_of
from tuner.engines.client import Reply, RequestFailed, get_text, post, send_batch
from tuner.engines.gguf import model_files
from tuner.engines.metrics import LiveMetrics
from tuner.engines.server import EngineServer
from tuner.engines.servers import GGUF_KINDS, ServerEngine, check_gguf, flag_value
from tuner.engines.serving import ServerEvaluator, baseline_spec, seconds
from tuner.measure.measurement import Measurement
from tuner.search.space import is_active

if TYPE_CHECKING:
    from tuner.measure.evaluator import Evaluator, MeasureSettings
    from tuner.tasks.task import Prompt

LIVE_METRICS = LiveMetrics(
    prefix="llamacpp:", drafts="llamacpp:spec_decode_num_drafts_total",
    draft_tokens="llamacpp:spec_decode_num_draft_tokens_total",
    accepted="llamacpp:spec_decode_num_accepted_tokens_total",
    accepted_per_pos="llamacpp:spec_decode_num_accepted_tokens_per_pos_total",
    generated="llamacpp:tokens_predicted_total",
    token_seconds="llamacpp:tokens_predicted_seconds_total",
    token_count="llamacpp:tokens_predicted_total",
    batch="llamacpp:n_busy_slots_per_decode", batch_is_window_mean=True,
    flag_hint="llama-server prints them with --metrics and a speculative setting")
DRAFT_KINDS = (*GGUF_KINDS, "int8_dynamic")     # int8_dynamic: the target re-typed (self draft)


class LlamaCppEngine(ServerEngine):
    """llama.cpp as an engine object: GGUF models, a ``llama-server`` built by ``make engines``."""

    name, display = "llamacpp", "llama.cpp"
    max_concurrency = 64                # one server slot (-np) per request in flight
    compiles = False                    # a native build: nothing to compile per study
    synthetic_surface = True            # --spec-synth-len (LlamaCppEvaluator.synthetic_spec)
    # the server's own decode time, alike on both sides: long prompts' prefill left out
    default_objective = "decode_speedup"
    streams = True                      # /completion with stream: true, one token per event
    predicts = False                    # its own cost surface per level (search.profile) only
    draft_tokens_knob = "n_max"         # --spec-draft-n-max: k drafted tokens per step
    # k per step: a draft model's n_max, an n-gram type's m-gram size_m, ngram-mod's longest
    # draft (k_flag reads the same off a launch line); ngram-cache declares none
    draft_size_knobs = ("n_max", "size_m", "mod_n_max")
    own_loops = False                   # the engine's own speculative loop
    live_metrics = LIVE_METRICS         # its /metrics (with --metrics)
    program = "llama-server"
    exact_draft = {"n_min": 0, "p_min": 0.0}     # every step drafts exactly n_max
    program_allowed = "a llama-server binary, or null for the one `make engines` builds"
    install_hint = ("llama-server is not built for this CPU: build it with `make engines` "
                    "(scripts/engines.sh llamacpp, a few minutes), or set "
                    "engine.binary=/path/to/llama-server")
    managed_flags = {
        **dict.fromkeys(("-np", "--parallel"), "slots = the largest budget.concurrency level"),
        **dict.fromkeys(("-c", "--ctx-size"), "engine.ctx_per_slot x slots"),
        **dict.fromkeys(("-t", "--threads", "-tb", "--threads-batch"), "threads"),
        **dict.fromkeys(("-m", "--model", "-md", "--model-draft", "-hf", "--hf-repo", "-mu",
                         "--model-url", "-hfd", "--hf-repo-draft"), "models.target / models.draft"),
        **dict.fromkeys(("--host", "--port"), "a free loopback port per server")}
    # every speculative flag (--spec-type, --spec-draft-n-max, --spec-ngram-*, the older --draft-*)
    managed_prefixes = dict.fromkeys(("--spec-", "--draft"),
                                     "the method's engine.methods flags and knobs")

    def identity(self, engine: Mapping[str, Any], concurrency: Sequence[int] = (1,)
                 ) -> dict[str, Any] | None:
        """``ServerEngine.identity``, and where several requests are in flight how a batch is
        sent: as one request with its prompts (``LlamaCppEvaluator.send_together``). A journal
        whose batches went as c connections measured otherwise at those levels, so it is not
        resumed as if alike; a study at concurrency 1 keeps its fingerprint."""
        found = super().identity(engine, concurrency)
        if max(concurrency, default=1) > 1:
            return {**(found or {}), "batch": "one request"}
        return found

    def check_models(self, models: Mapping[str, Any], mapping: Mapping[str, Any],
                     method_params: Mapping[str, Any]) -> None:
        """GGUF targets; drafts as GGUF files or the target re-typed (int8_dynamic)."""
        target = models.get("target") or {}
        if target.get("kind") not in GGUF_KINDS:
            raise ConfigError(f"models.target.kind={target.get('kind')!r} cannot run in "
                              f"engine={self.name}: allowed are GGUF models {list(GGUF_KINDS)} "
                              f"(e.g. models=smollm2, or models.target={{kind: gguf_file, "
                              f"path: ...}})")
        check_gguf("models.target", target)
        if not mapping.get("needs_draft"):
            return
        draft = models.get("draft") or {}
        if isinstance(draft, list) or draft.get("kind") not in DRAFT_KINDS:
            shown = draft.get("kind") if isinstance(draft, Mapping) else draft
            raise ConfigError(f"models.draft.kind={shown!r} cannot run in engine={self.name}: "
                              f"allowed are {list(DRAFT_KINDS)} (int8_dynamic: the target "
                              "re-typed to engine.self_draft_type)")
        if draft.get("kind") in GGUF_KINDS:
            check_gguf("models.draft", draft)

    def evaluator(self, settings: MeasureSettings, timer: Any,
                  say: Callable[[str], None]) -> Evaluator:
        return LlamaCppEvaluator(settings, say)

    def schedule_form(self, schedule: Any,
                      base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """llama-server takes no schedule: per expected concurrency, the setting to launch
        (``base`` is not needed: the launch line holds everything else)."""
        from tuner.predict.forms import llamacpp_per_level
        return {"predicted_per_level": llamacpp_per_level(schedule)}


    # -- a running deployment (python -m tuner.watch) ----------------------------------------------

    def deployed_model(self, argv: list[str]) -> str | None:
        """llama-server answers ``/v1/models`` with the path it loaded (``-m``): its file name
        is compared."""
        path = flag_value(argv, "-m", "--model")
        return None if path is None else Path(path).name

    @staticmethod
    def k_flag(argv: list[str]) -> str | None:
        """The flag that sets the drafted tokens per step of the deployed speculation: the draft
        model's ``--spec-draft-n-max``, an n-gram type's m-gram size, ngram-mod's longest draft."""
        kind = flag_value(argv, "--spec-type")
        if kind in NGRAM_SIZED:
            return f"--spec-{kind}-size-m"
        if kind == "ngram-mod":
            return "--spec-ngram-mod-n-max"
        if kind is not None or flag_value(argv, "-md", "--model-draft") is not None:
            return "--spec-draft-n-max"
        return None

    def baseline_key(self, engine: Mapping[str, Any], method: Mapping[str, Any],
                     params: Mapping[str, Any]) -> tuple[str, ...] | None:
        """The matched baseline's speculative flags at ``params``: its output reservation, the
        point's longest draft (``LlamaCppEvaluator.drafting_off``); None: the plain server
        (no speculation, or ``engine.baseline=plain``)."""
        if is_union(method):
            _, method, params = member_of(method, params)
        wanted = baseline_spec(engine, speculative_flags(method, params), drafting_off)
        return None if wanted is None else tuple(wanted)

    def drafts_with_model(self, argv: list[str]) -> bool:
        return flag_value(argv, "-md", "--model-draft") is not None

    def least_drafting_k(self, argv: list[str]) -> int:
        """ngram-simple drafts nothing where its m-gram is shorter than its lookup n-gram
        (``common_ngram_simple_draft``, common/ngram-map.cpp at 0c1e570: ``copy_max <
        n_draft_min``): k below ``size_n`` (default 12, common/common.h) runs as no speculation."""
        if spec_types(argv)[:1] == ["ngram-simple"]:
            return int(flag_value(argv, "--spec-ngram-simple-size-n") or 12)
        return 1

    def deployed_k(self, argv: list[str]) -> tuple[int, str] | None:
        flag = self.k_flag(argv)
        value = None if flag is None else flag_value(argv, flag)
        return None if value is None else (int(value), flag)

    def candidate_form(self, argv: list[str], schedule: Any) -> dict[str, Any]:
        """llama-server takes one setting per deployment: per batch size of the schedule, the
        deployed launch line with the k flag set (or without speculation where k = 0)."""
        flag = self.k_flag(argv)
        lines = {}
        for choice in schedule.levels:
            lines[choice.batch] = shlex.join(
                without_speculation(argv) if not choice.k or flag is None
                else with_flag(argv, flag, str(choice.k)))
        return {"llamacpp_per_level": lines}


NGRAM_SIZED = ("ngram-simple", "ngram-map-k", "ngram-map-k4v")
# the flag of each speculative type's longest draft and its default (common/common.h at 0c1e570;
# ngram-cache drafts at most 8, fixed): llama-server reserves outputs for that many + 1 tokens
# per slot (common_speculative_n_max), and so sizes its compute graph
LONGEST_DRAFT = {"draft-simple": ("--spec-draft-n-max", 3),
                 "ngram-simple": ("--spec-ngram-simple-size-m", 48),
                 "ngram-map-k": ("--spec-ngram-map-k-size-m", 48),
                 "ngram-map-k4v": ("--spec-ngram-map-k4v-size-m", 48),
                 "ngram-mod": ("--spec-ngram-mod-n-max", 64), "ngram-cache": (None, 8)}
DRAFT_MODEL_TYPES = ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")
NEVER_HITS = 65535    # ngram-map-k4v proposes a draft after this many hits of its key; it counts
                      # at most 16,380 (COMMON_NGRAM_MAX_VALUE_COUNT): it never drafts


def spec_types(flags: Sequence[str]) -> list[str]:
    """The speculative types ``--spec-type`` names (comma-separated), in order."""
    value = flag_value(list(flags), "--spec-type")
    return [] if not value else [t.strip() for t in value.split(",") if t.strip()]


def longest_draft(flags: Sequence[str]) -> int:
    """The most tokens these speculative flags may draft per step (0: no speculation), as
    llama-server computes it to size its outputs (``LONGEST_DRAFT``)."""
    longest = 0
    for kind in spec_types(flags):
        flag, default = LONGEST_DRAFT.get(kind, (None, 0))
        value = flag_value(list(flags), flag) if flag else None
        longest = max(longest, int(value) if value is not None else default)
    return longest


def speculative_flags(method: Mapping[str, Any], params: Mapping[str, Any]) -> list[str]:
    """The speculative flags of ``params`` for ``method`` (a study's method config with its
    ``engine`` mapping and ``space``): fixed ones, then each active knob's flag."""
    mapping, space = method["engine"], dict(method.get("space") or {})
    out = [str(x) for kv in mapping["flags"].items() for x in kv]
    for name, flag in mapping["knobs"].items():
        if name not in params or (name in space and not is_active(name, space[name], params)):
            continue
        value = params[name]
        out += [str(flag).format(**params), str(value).lower() if isinstance(value, bool)
                else str(value)]
    return out


def drafting_off(flags: Sequence[str] | None) -> list[str]:
    """The server of ``flags`` that never drafts: the same output reservation (its longest
    draft + 1 tokens per slot), no draft model (module docstring)."""
    return never_drafting(longest_draft(flags or []))


def never_drafting(longest: int) -> list[str]:
    """Flags of a speculation that reserves outputs for ``longest`` drafted tokens and never
    drafts (``NEVER_HITS``): the server's graph as with drafting, each step one token."""
    if longest <= 0:
        return []
    return ["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-n", "1",
            "--spec-ngram-map-k4v-size-m", str(longest),
            "--spec-ngram-map-k4v-min-hits", str(NEVER_HITS)]


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag`` set to ``value`` (appended where absent)."""
    out, i, done = [], 0, False
    while i < len(argv):
        if argv[i] == flag and i + 1 < len(argv):
            out += [flag, value]
            i, done = i + 2, True
            continue
        out.append(argv[i])
        i += 1
    return out if done else out + [flag, value]


def without_speculation(argv: list[str]) -> list[str]:
    """``argv`` without its speculative flags (``--spec-*``, ``--draft*``, the draft model)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i].startswith(("--spec-", "--draft")) or argv[i] in ("-md", "--model-draft"):
            i += 2 if i + 1 < len(argv) and not argv[i + 1].startswith("-") else 1
            continue
        out.append(argv[i])
        i += 1
    return out


class LlamaCppEvaluator(ServerEvaluator):
    """The llama-server evaluator (see the module docstring)."""

    kind = LlamaCppEngine
    endpoint, server_name = "/completion", "llama-server"

    def prepare_models(self) -> None:
        s = self.settings
        self.binary = self.kind().binary(self.engine)
        self.target, self.draft = model_files(self.engine, s.models, s.method["needs_draft"],
                                              self.binary.parent / "llama-quantize")

    def build_info(self) -> str:
        found = self.binary.parent.parent / "build.json"
        if found.is_file():
            info = json.loads(found.read_text())
            return f"llama.cpp {info['commit']} from {info['sdist']}, sha256 " \
                   f"{info['llama_server_sha256'][:12]}"
        return f"binary {self.binary}"

    # -- servers and their flags -----------------------------------------------------------------

    def argv(self, spec: Sequence[str] | None, port: str = "{port}") -> list[str]:
        """The full llama-server command for these speculative flags (a deployable line)."""
        flags = list(spec or [])
        argv = [str(self.binary), "-m", str(self.target.path), "--host", "127.0.0.1",
                "--port", port, "-np", str(self.slots),
                "-c", str(int(self.engine["ctx_per_slot"]) * self.slots),
                "-t", str(self.threads), "-tb", str(self.threads), "--metrics", "--no-webui",
                *[str(a) for a in self.engine.get("extra_args") or []]]
        if self.draft is not None and any(t in DRAFT_MODEL_TYPES for t in spec_types(flags)):
            argv += ["-md", str(self.draft.path)]
        return argv + flags

    def spec(self, params: Mapping[str, Any]) -> list[str]:
        return self.flags(params)

    def drafting_off(self, spec: Sequence[str] | None) -> list[str]:
        return drafting_off(spec)

    def flags(self, params: Mapping[str, Any]) -> list[str]:
        """The speculative flags of ``params`` (``speculative_flags`` of its member)."""
        return speculative_flags(*self.member(params))

    def drafted_params(self, k: int) -> dict[str, Any]:
        """As the base's; for an n-gram type sized by ``size_m`` the lookup ``size_n`` is at most
        k too: llama.cpp's ngram-simple drafts nothing where its m-gram is shorter than its
        n-gram (``common_ngram_simple_draft``: ``copy_max < n_draft_min`` returns no draft), so
        its default n = 12 with m = k < 12 would measure a step that never drafts."""
        params = super().drafted_params(k)
        if not self.settings.method["needs_draft"] and params.get("spec_type") in NGRAM_SIZED \
                and "size_n" in params:
            params["size_n"] = min(int(params["size_n"]), k)
        return params

    def synthetic_spec(self, k: int, length: float) -> list[str]:
        """Draft-model speculation drafting exactly ``k`` tokens per step, accepted at random
        with mean length ``length`` (``--spec-synth-len``, "benchmarking only": the output is
        not the target's); a method without a draft model has no such surface here."""
        if not self.settings.method["needs_draft"]:
            raise ConfigError(f"method={self.settings.method_choice}: the synthetic-acceptance "
                              "surface is measured with a draft model; allowed is "
                              "method=speculative (n-gram steps: python -m tuner.profile "
                              "--drafting ngram)")
        return self.flags(self.drafted_params(k)) + ["--spec-synth-len", f"{length:g}"]

    def launch_line(self, params: Mapping[str, Any], port: int = 8080) -> str:
        return super().launch_line(params, port)

    # -- requests and answers --------------------------------------------------------------------

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

    def send_together(self, server: EngineServer, payloads: Sequence[Mapping[str, Any]]
                      ) -> tuple[list[Reply], float]:
        """A batch of c > 1 requests as one ``/completion`` whose ``prompt`` holds the c
        prompts: llama-server queues their c tasks at once, so every batch prefills its prompts
        together and then decodes together, on both sides of a pair alike. Sent as c
        connections (``send_batch``), which request the server took first was a race: in 3 of
        12 batches of two here, one prompt prefilled alone and its neighbour's prefill ran
        inside its decode phase (+20-30 % on that request's decode time, on one side of the
        pair and not the other; docs/engines.md). A request's time is then its own in the
        server (``prompt_ms + predicted_ms``, from its prefill's start to its last token) plus
        what the batch spent outside the server (HTTP, JSON) beside its longest request."""
        if len(payloads) == 1:
            return send_batch(server.url + self.endpoint, payloads)
        first = dict(payloads[0])
        if any({**p, "prompt": None} != {**first, "prompt": None} for p in payloads):
            return send_batch(server.url + self.endpoint, payloads)   # settings differ
        reply = post(server.url + self.endpoint,
                     {**first, "prompt": [list(p["prompt"]) for p in payloads]})
        bodies = reply.body if isinstance(reply.body, list) else [reply.body]
        bodies = sorted(bodies, key=lambda b: int(b.get("index", 0)))
        if len(bodies) != len(payloads):
            raise RequestFailed(f"POST {server.url + self.endpoint}: {len(payloads)} prompts "
                                f"in one request, {len(bodies)} answers")
        times = [(b.get("timings") or {}) for b in bodies]
        if any(t.get("prompt_ms") is None or t.get("predicted_ms") is None for t in times):
            own = [reply.wall_s] * len(bodies)      # no timings: the batch's wall for each
        else:
            own = [(float(t["prompt_ms"]) + float(t["predicted_ms"])) / 1e3 for t in times]
        outside = max(reply.wall_s - max(own), 0.0)
        return [Reply(b, reply.sent, s + outside) for b, s in zip(bodies, own)], reply.wall_s

    @staticmethod
    def parse_stream(chunk: Mapping[str, Any]) -> tuple[Sequence[int], int | None, bool]:
        """One server-sent event of a streamed ``/completion``: a partial result carries the
        token it just sampled (``tokens``) and the count so far (``tokens_predicted``; a token
        that ends inside a multi-byte character is held back and counted with the next), the
        last one ``stop: true`` and the request's timings; an error arrives as ``error``."""
        if "error" in chunk:
            error = chunk["error"]
            detail = error.get("message", error) if isinstance(error, Mapping) else error
            raise RequestFailed(f"llama-server stopped the stream: {str(detail)[:300]}")
        total = chunk.get("tokens_predicted")
        return chunk.get("tokens") or [], None if total is None else int(total), \
            bool(chunk.get("stop"))

    def measurement(self, prompt: Prompt, body: Mapping[str, Any], wall_s: float, level: int,
                    batch_wall_s: float, counted: AcceptanceCounts | None) -> Measurement:
        t = body.get("timings") or {}
        tokens = tuple(int(x) for x in body.get("tokens") or [])
        accepted = int(t.get("draft_n_accepted") or 0)
        accepted_pos, drafts = (), 0
        if counted is not None and counted.drafts > 0:      # c = 1: this request's counters
            accepted_pos, drafts = counted.accepted_per_position, counted.drafts
        counts = AcceptanceCounts(steps=max(len(tokens) - accepted, 1), prefills=1,
                                  drafts=drafts, drafted=int(t.get("draft_n") or 0),
                                  accepted=accepted, accepted_per_position=accepted_pos)
        return Measurement(prompt_id=prompt.id, category=prompt.category, tokens=tokens,
                           text=str(body.get("content", "")), wall_s=wall_s, counts=counts,
                           draft_time_s=0.0, verify_time_s=0.0,
                           truncated=len(tokens) >= self.settings.budget["max_new_tokens"],
                           concurrency=level, batch_wall_s=batch_wall_s,
                           prompt_s=seconds(t.get("prompt_ms")),
                           decode_s=seconds(t.get("predicted_ms")),
                           decode_tokens=max(len(tokens) - 1, 0))   # after the first token

    def counters(self, server: EngineServer) -> AcceptanceCounts:
        """The server's counts so far, from ``/metrics``."""
        return LIVE_METRICS.read(get_text(server.url + "/metrics")).acceptance()

    def logprobs(self, prompt: Prompt, prefix: Sequence[int],
                 tokens: Sequence[int]) -> dict[int, float]:
        """The baseline's top-20 log-probabilities after prompt + prefix (``n_probs``)."""
        request = {**self.payload(prompt, False), "n_predict": 1, "n_probs": 20,
                   "post_sampling_probs": False,
                   "prompt": list(self.ids[prompt.id]) + list(prefix)}
        replies, _ = send_batch(self.baseline.url + self.endpoint, [request])
        probs = replies[0].body["completion_probabilities"][0]["top_logprobs"]
        return {int(p["id"]): float(p["logprob"]) for p in probs}
