"""Per-concurrency-level numbers of an engine trial (``budget.concurrency``), with their baseline.

For each level c (requests in flight together) the summary gets, each paired with the baseline
measured on the same batches at the same level:

  * ``tokens_per_s@c<c>``: throughput, output tokens over the batches' wall time (first send to
    last answer), and ``vanilla_tokens_per_s@c<c>``; ``throughput_ratio@c<c>`` their ratio;
  * ``speedup@c<c>``: the geometric mean of the requests' paired speedups (per-request latency per
    token, the number one user of that server feels);
  * ``<figure>_lcb@c<c>``: the one-sided 95 % lower confidence bound of ``speedup``,
    ``decode_speedup`` and ``throughput_ratio``, which the level's decision reads
    (``tuner.answer.decide``); over the batches, the level's independent units (at c > 1 a
    batch's requests share its schedule: ``tuner.measure.measurement.unit_ratios``), so a level
    measured in one batch has no bound (0.0);
  * ``decode_speedup@c<c>``: the same of the decode phase alone (the server's own decode time
    per token after the first; the prefill left out);
  * ``tpot_ms@c<c>`` / ``vanilla_tpot_ms@c<c>``: the server's own decode time per output token
    (over all output tokens, as recorded since engines came; ``decode_speedup`` divides by the
    tokens after the first);
  * ``acceptance_rate@c<c>``, ``mean_accepted_tokens@c<c>`` (tokens per target forward, the
    prefill counted) and ``decode_tokens_per_step@c<c>`` (per decode step: what bounds the decode
    phase), from the level's ``decoding.acceptance.AcceptanceCounts``.
``throughput_ratio`` (no level) is the geometric mean of the levels' throughput ratios: one number
for "faster under the loads you serve".
"""

from __future__ import annotations

from typing import Sequence

from decoding.acceptance import total
from tuner.measure.intervals import lower_bound
from tuner.measure.evaluator import Paired
from tuner.measure.figures import level_key
from tuner.measure.measurement import Measurement, geometric_mean, unit_ratios


def level_summary(pairs: Sequence[Paired]) -> dict[str, float]:
    levels = sorted({p.method.concurrency for p in pairs})
    out: dict[str, float] = {}
    ratios = []
    for c in levels:
        group = [p for p in pairs if p.method.concurrency == c]
        ms, refs = [p.method for p in group], [p.baseline for p in group]
        method_tps, base_tps = throughput(ms), throughput(refs)
        ratios.append(method_tps / base_tps)
        counts = total([m.counts for m in ms])
        figures = {"tokens_per_s": method_tps, "vanilla_tokens_per_s": base_tps,
                   "throughput_ratio": method_tps / base_tps,
                   "speedup": geometric_mean([m.speedup for m in ms]),
                   "tpot_ms": tpot_ms(ms), "vanilla_tpot_ms": tpot_ms(refs)}
        figures["speedup_lcb"] = lower_bound(unit_ratios(ms, "speedup"))
        figures["throughput_ratio_lcb"] = lower_bound(batch_ratios(group, c))
        out.update({level_key(name, c): value for name, value in figures.items()})
        out.update(decode_speedup(ms, c))
        out.update({level_key("acceptance_rate", c): counts.acceptance_rate,
                    level_key("mean_accepted_tokens", c): counts.tokens_per_forward,
                    level_key("decode_tokens_per_step", c): counts.tokens_per_decode_step})
    out["throughput_ratio"] = geometric_mean(ratios)
    return out


def throughput(ms: Sequence[Measurement]) -> float:
    """Output tokens over the wall time of the distinct batches they came in.

    ``ms`` in the order measured: a batch's requests come together and share its
    ``batch_wall_s``; a batch holds at most ``concurrency`` of them, so two batches that happen
    to take the same time still count twice. A run without a batch counts its own wall time."""
    wall_s, in_batch, last = 0.0, 0, None
    for m in ms:
        if m.batch_wall_s is None:
            wall_s, last = wall_s + m.wall_s, None
            continue
        key = (m.batch_wall_s, m.concurrency)
        if key == last and in_batch < m.concurrency:
            in_batch += 1
            continue
        wall_s, in_batch, last = wall_s + m.batch_wall_s, 1, key
    return sum(m.new_tokens for m in ms) / wall_s


def tpot_ms(ms: Sequence[Measurement]) -> float:
    decoded = [(m.decode_s, m.new_tokens) for m in ms if m.decode_s is not None]
    if not decoded:
        return float("nan")
    return 1e3 * sum(d for d, _ in decoded) / max(sum(n for _, n in decoded), 1)


def decode_speedup(ms: Sequence[Measurement], level: int) -> dict[str, float]:
    """``decode_speedup@c<level>``: the geometric mean of the requests' paired decode-phase
    speedups (none where the server reported no decode time), and its lower bound over the
    batches (``ms`` in the order measured)."""
    values = [m.decode_speedup for m in ms if m.decode_speedup is not None]
    if not values:
        return {}
    bound = lower_bound(unit_ratios(ms, "decode_speedup"))
    return {level_key("decode_speedup", level): geometric_mean(values),
            level_key("decode_speedup_lcb", level): bound}


def batch_ratios(group: Sequence[Paired], level: int) -> list[float]:
    """Per batch of ``level`` requests (in the order measured), the method's throughput over
    the baseline's on it."""
    out = []
    for start in range(0, len(group), level):
        batch = group[start:start + level]
        ms, refs = [p.method for p in batch], [p.baseline for p in batch]
        out.append(throughput(ms) / throughput(refs))
    return out
