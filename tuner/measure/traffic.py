"""Traffic at a request rate: an open-loop, seeded Poisson arrival schedule and what a serving
benchmark reports of it (vLLM's ``bench serve``, SGLang's ``bench_serving``).

Requests arrive at the scheduled times whether or not earlier ones have finished (open loop), so
a server that falls behind builds a queue, as in deployment. Each request's tokens are timed as
they stream in (server-sent events), on the client's clock:

  * TTFT: from sending to the first token;
  * TPOT: per request, (last token - first token) / (tokens - 1), the decode phase's time per
    output token;
  * ITL (inter-token latency): every gap between consecutive token arrivals, pooled over
    requests (a speculative step that accepts k drafts arrives as a burst: k gaps near 0 and one
    long one; TPOT averages them, ITL shows them);
  * E2E: from sending to the last token.

Per rate: p50/p90/p99 of each, output throughput (tokens over the span from the first send to the
last token) and *goodput*: requests per second that met every bound of the SLO (``ttft_ms``,
``tpot_ms``, ``e2e_ms``; vLLM's ``--goodput`` definition). Nothing here does I/O:
``tuner.engines.stream`` sends the schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")      # per-request bounds (milliseconds)
MAX_REQUESTS = 1000             # requests in one schedule, at most (budget.requests_per_rate)
MAX_SCHEDULE_S = 600            # a schedule's expected length (requests / rate), at most
PERCENTILES = (50, 90, 99)


def arrival_schedule(rate: float, count: int, generator: torch.Generator) -> tuple[float, ...]:
    """``count`` send times in seconds from the start, Poisson at ``rate`` requests/s: the first
    at 0, then exponential gaps of mean 1/rate (drawn in float64 from ``generator``)."""
    if not rate > 0 or count < 1:
        raise ValueError(f"rate {rate!r} must be > 0 and count {count!r} >= 1")
    gaps = torch.empty(count - 1, dtype=torch.float64).exponential_(rate, generator=generator)
    # exponential_(lambd) draws with mean 1 / lambd
    return (0.0, *(float(t) for t in torch.cumsum(gaps, 0)))


@dataclass(frozen=True)
class StreamedRequest:
    """One request of a schedule, on the client's clock (seconds from the schedule's start)."""
    index: int                          # its place in the schedule
    scheduled: float                    # when it was due
    sent: float                         # when it was sent
    token_times: tuple[float, ...]      # when each output token arrived (a burst shares a time)
    tokens: tuple[int, ...] = ()        # the token ids, where the server streams them

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def e2e_s(self) -> float | None:
        return self.token_times[-1] - self.sent if self.token_times else None

    @property
    def gaps(self) -> tuple[float, ...]:
        t = self.token_times
        return tuple(b - a for a, b in zip(t, t[1:]))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's and
    vLLM's default); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def meets(request: StreamedRequest, slo: Mapping[str, float]) -> bool:
    """Every bound of ``slo`` (milliseconds) holds for this request; a bound on a figure the
    request lacks (TPOT of a one-token answer) holds vacuously, as in vLLM."""
    figures = {"ttft_ms": request.ttft_s, "tpot_ms": request.tpot_s, "e2e_ms": request.e2e_s}
    return bool(request.token_times) and all(
        figures[key] is None or 1e3 * figures[key] <= bound for key, bound in slo.items())


def rate_summary(requests: Sequence[StreamedRequest], slo: Mapping[str, float]
                 ) -> dict[str, float]:
    """What one server did with one schedule: the module docstring's figures (``ttft_ms_p90``,
    ``tpot_ms_p50``, ``itl_ms_p99``, ``e2e_ms_p50``, ``output_tokens_per_s``,
    ``request_throughput``, ``goodput``, ``good_fraction``, ``late_send_ms_max``: how far behind
    its schedule the client sent)."""
    done = [r for r in requests if r.token_times]
    if not done:
        raise ValueError("no request of the schedule returned a token")
    start = min(r.sent for r in requests)
    span = max(r.token_times[-1] for r in done) - start
    out = {"requests": float(len(requests)),
           "output_tokens": float(sum(len(r.token_times) for r in done)),
           "duration_s": span,
           "late_send_ms_max": 1e3 * max(r.sent - r.scheduled for r in requests)}
    out["output_tokens_per_s"] = out["output_tokens"] / span
    out["request_throughput"] = len(done) / span
    series = {"ttft_ms": [r.ttft_s for r in done], "tpot_ms": [r.tpot_s for r in done],
              "e2e_ms": [r.e2e_s for r in done],
              "itl_ms": [g for r in done for g in r.gaps]}
    for name, values in series.items():
        ms = [1e3 * v for v in values if v is not None]
        out[f"{name}_mean"] = sum(ms) / len(ms) if ms else float("nan")
        for q in PERCENTILES:
            out[f"{name}_p{q}"] = percentile(ms, q)
    good = sum(meets(r, slo) for r in done)
    out["good_fraction"] = good / len(requests)
    out["goodput"] = good / span
    return out
