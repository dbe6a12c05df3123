"""The paired protocol at request rates (``budget.request_rate``): the same seeded Poisson schedule
sent to the baseline server and to the method server, one after the other, and the per-rate
figures of both (``tuner.measure.traffic``) side by side.

For each rate r of ``budget.request_rate`` (requests/s), in order:

  1. the schedule: ``budget.requests_per_rate`` send times drawn from a ``torch.Generator``
     seeded with the study's seed and the rate's place, the trial's prompts cycled over them
     (the same schedule, prompts and order for both sides, every trial);
  2. the CPUs settle, then one side gets the whole schedule, then (settled again) the other; the
     side that goes first alternates with the rate's place and the caller's ``parity``;
  3. per side: TTFT, TPOT, ITL and E2E percentiles, output throughput and, under ``search.slo``,
     goodput; the method's keys are ``<figure>@r<rate>``, the baseline's
     ``vanilla_<figure>@r<rate>``, and ``goodput_ratio@r<rate>`` / ``tpot_ratio@r<rate>``
     (vanilla's TPOT p50 over the method's: > 1 is faster) compare them.

Requests beyond the servers' slots (the largest ``budget.concurrency``) wait in the server's
queue, as they would in a deployment with that many slots. Rates measure timing; the lossless
check runs at the concurrency levels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

import torch

from tuner.measure import figures
from tuner.measure.traffic import StreamedRequest, arrival_schedule, rate_summary

if TYPE_CHECKING:
    from tuner.tasks.task import Prompt

# the figures kept per side and rate (the rest of rate_summary is for the console)
KEPT = ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99",
        "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p90",
        "output_tokens_per_s", "request_throughput", "late_send_ms_max")
SEED_STRIDE = 7919              # the k-th rate's schedule: seed * stride + k


@dataclass(frozen=True)
class Traffic:
    """``budget.request_rate``, ``budget.requests_per_rate`` and ``search.slo`` of a study."""
    rates: tuple[float, ...] = ()
    requests_per_rate: int = 8
    slo: Mapping[str, float] | None = None

    def identity(self) -> dict[str, Any] | None:
        """The fingerprint's ``traffic`` key (None: no rates, the key every older study lacks)."""
        return {"request_rate": list(self.rates), "requests_per_rate": self.requests_per_rate,
                "slo": dict(self.slo or {})} if self.rates else None


class RateBackend(Protocol):
    """What the rate protocol needs of a server engine's backend."""

    def stream(self, server: Any, prompts: Sequence[Prompt], offsets: Sequence[float],
               method: bool) -> list[StreamedRequest]:
        """``prompts[i]`` sent at ``offsets[i]`` to ``server`` (None: the baseline), streamed."""

    def settle(self) -> None:
        """Wait for quiet CPUs before a timed side."""


def schedule(rate: float, place: int, count: int, seed: int) -> tuple[float, ...]:
    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + place)
    return arrival_schedule(rate, count, generator)


def measure_rates(backend: RateBackend, method: Any, prompts: Sequence[Prompt],
                  traffic: Traffic, seed: int, parity: int,
                  say: Callable[[str], None] = lambda line: None,
                  requests: dict[float, tuple[list[StreamedRequest], list[StreamedRequest]]]
                  | None = None) -> dict[str, float]:
    """Steps 1–3 of the module docstring for every rate; the trial's per-rate figures (a line
    per rate to ``say``). ``requests``: where given, each rate's streamed requests are kept in
    it, (the method's, the baseline's), for the A/A control to pair them one by one."""
    out: dict[str, float] = {}
    if not traffic.rates:
        return out
    count, slo = traffic.requests_per_rate, traffic.slo
    cycled = [prompts[i % len(prompts)] for i in range(count)]
    for place, rate in enumerate(traffic.rates):
        offsets = schedule(rate, place, count, seed)
        sides = [None, method] if (parity + place) % 2 == 0 else [method, None]
        got: dict[bool, dict[str, float]] = {}
        streamed: dict[bool, list[StreamedRequest]] = {}
        for side in sides:
            backend.settle()
            streamed[side is not None] = backend.stream(side, cycled, offsets, side is not None)
            got[side is not None] = rate_summary(streamed[side is not None], slo or {})
        if requests is not None:
            requests[rate] = (streamed[True], streamed[False])
        out.update(rate_figures(rate, got[True], got[False], bool(slo)))
        say(rate_line(rate, count, got[True], got[False], bool(slo)))
    return out


def rate_line(rate: float, count: int, method: Mapping[str, float],
              vanilla: Mapping[str, float], with_slo: bool) -> str:
    """E.g. 'request rate 4/s (8 requests each): TPOT p50 41.0 ms vs vanilla 63.2 ms, p90 ...'."""
    def both(name: str, digits: int = 1) -> str:
        return f"{method[name]:.{digits}f} vs vanilla {vanilla[name]:.{digits}f}"
    good = f", goodput {both('goodput', 2)} req/s under the SLO" if with_slo else ""
    return (f"request rate {rate:g}/s ({count} requests each): TPOT p50 {both('tpot_ms_p50')} "
            f"ms, p90 {both('tpot_ms_p90')} ms; TTFT p90 {both('ttft_ms_p90', 0)} ms; output "
            f"{both('output_tokens_per_s')} tokens/s{good}")


def rate_figures(rate: float, method: Mapping[str, float], vanilla: Mapping[str, float],
                 with_slo: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in KEPT + (("goodput", "good_fraction") if with_slo else ()):
        if math.isfinite(method[name]) and math.isfinite(vanilla[name]):   # NaN: not measured
            out[figures.rate_key(name, rate)] = method[name]
            out[figures.rate_key(f"vanilla_{name}", rate)] = vanilla[name]
    if method["tpot_ms_p50"] > 0 and math.isfinite(vanilla["tpot_ms_p50"]):   # NaN: one token
        out[figures.rate_key("tpot_ratio", rate)] = vanilla["tpot_ms_p50"] / method["tpot_ms_p50"]
    out[figures.rate_key("throughput_ratio", rate)] = \
        method["output_tokens_per_s"] / vanilla["output_tokens_per_s"]
    if with_slo and vanilla["goodput"] > 0:     # none of vanilla's requests met it: no ratio
        out[figures.rate_key("goodput_ratio", rate)] = method["goodput"] / vanilla["goodput"]
    return out
