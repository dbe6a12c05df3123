"""Roofline cost surfaces: a forward's seconds estimated from the model's shapes and a machine's
published (GPUs) or measured (this CPU) memory bandwidth and peak matmul throughput. An ESTIMATE
everywhere it is shown: no model ran on that machine.

A forward of ``rows`` tokens for each of ``batch`` sequences after ``context`` cached tokens
moves at least
    bytes = every matmul weight once + batch · (context + rows) · KV bytes per token
and computes
    FLOPs = 2 · matmul parameters · rows · batch            (the linear layers and LM head)
          + 4 · layers · attention width · rows · (context + rows) · batch   (QKᵀ and AV),
so it takes at least max(bytes / bandwidth, FLOPs / peak). Kernel launches, Python, sampling and
the loop's own work are not in it (``HardwareProfile.step_overhead_s`` stays empty): on a small
model a roofline is a lower bound far below what a framework reaches, and its *ratios* (the
cost of verifying n tokens over one) are what a prediction uses.

``GPUS``: the named GPUs with their datasheet figures (dense BF16 tensor throughput, i.e.
without 2:4 sparsity; HBM or GDDR bandwidth). On a GPU the weights are priced at 2 bytes (bf16)
except int8 weights (1 byte), and the KV cache at 2 bytes per value. ``measure_cpu`` measures
this CPU's read bandwidth and fp32 matmul throughput with the threads given, so the roofline can
be compared cell by cell with the measured surface (``compare``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tuner.config.errors import ConfigError
from tuner.predict.surface import CostSurface

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Machine:
    """What a roofline needs of a machine: its memory bandwidth and peak matmul throughput."""

    name: str
    bandwidth_gb_s: float          # 1e9 bytes per second
    peak_tflops: float             # 1e12 multiply-adds × 2 per second
    source: str                    # the datasheet, or how it was measured
    bf16: bool = True              # weights and KV cache priced at 2 bytes (int8 weights at 1)


# NVIDIA datasheets (dense BF16 tensor throughput; the datasheets' larger figures are with 2:4
# sparsity). Accepted names are matched without case, spaces or dashes.
GPUS: dict[str, Machine] = {
    "H100": Machine("NVIDIA H100 SXM5 80GB", 3350.0, 989.4,
                    "NVIDIA H100 datasheet: 3.35 TB/s HBM3, 989 TFLOPS BF16 dense"),
    "H200": Machine("NVIDIA H200 SXM 141GB", 4800.0, 989.4,
                    "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 989 TFLOPS BF16 dense"),
    "A100": Machine("NVIDIA A100 SXM4 80GB", 2039.0, 312.0,
                    "NVIDIA A100 datasheet: 2,039 GB/s HBM2e, 312 TFLOPS BF16 dense"),
    "L40S": Machine("NVIDIA L40S 48GB", 864.0, 362.05,
                    "NVIDIA L40S datasheet: 864 GB/s GDDR6, 362 TFLOPS BF16 dense"),
    "L4": Machine("NVIDIA L4 24GB", 300.0, 121.0,
                  "NVIDIA L4 datasheet: 300 GB/s GDDR6, 121 TFLOPS BF16 dense"),
    "RTX4090": Machine("NVIDIA GeForce RTX 4090 24GB", 1008.0, 165.2,
                       "NVIDIA Ada whitepaper: 1,008 GB/s GDDR6X, 165 TFLOPS BF16 dense "
                       "(FP32 accumulate)"),
}
CPU = "cpu"                        # this machine, measured (``measure_cpu``)


def _key(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def machine_named(name: str, setting: str = "--roofline") -> str:
    """The ``GPUS`` key (or ``cpu``) for ``name``; one ``ConfigError`` line when unknown."""
    known = {_key(k): k for k in GPUS} | {CPU: CPU}
    if _key(str(name)) in known:
        return known[_key(str(name))]
    raise ConfigError(f"{setting}={name!r} is not a GPU this roofline knows: allowed are "
                      f"{sorted(GPUS) + [CPU]} (cpu: this machine, its bandwidth measured)")


@dataclass(frozen=True)
class ModelShape:
    """A model's shapes as a roofline prices them."""

    name: str
    weight_bytes: float            # every matmul weight, read once per forward
    matmul_params: int             # multiply-adds per token in the linear layers and LM head
    layers: int
    attention_width: int           # query heads × head dim
    kv_bytes_per_token: float      # K and V of every layer

    @classmethod
    def of(cls, model: nn.Module, name: str, *, bf16: bool = False) -> ModelShape:
        """From a loaded model: its ``nn.Linear`` (and dynamically quantised int8 linear)
        layers, its config's attention shape and its decoder layers. ``bf16``: price float
        weights and the KV cache at 2 bytes (a GPU deployment) instead of as loaded."""
        import torch
        from torch.ao.nn.quantized.dynamic import Linear as Int8Linear
        weight_bytes, params, float_bytes = 0.0, 0, 4
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                weight = module.weight
                float_bytes = weight.element_size()
                weight_bytes += weight.numel() * (2 if bf16 else weight.element_size())
                params += weight.numel()
            elif isinstance(module, Int8Linear):
                weight = module.weight()                     # [out, in] int8
                weight_bytes += weight.numel()
                params += weight.numel()
        config = model.config
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        inner = getattr(model, "model", model)
        layers = len(inner.layers) if hasattr(inner, "layers") else \
            int(config.num_hidden_layers)
        kv_value_bytes = 2 if bf16 else float_bytes
        return cls(name, weight_bytes, params, layers, heads * head_dim,
                   2.0 * layers * kv_heads * head_dim * kv_value_bytes)


def step_seconds(shape: ModelShape, machine: Machine, context: int, rows: int,
                 batch: int = 1) -> float:
    """The roofline of one forward (module docstring)."""
    moved = shape.weight_bytes + batch * (context + rows) * shape.kv_bytes_per_token
    flops = 2.0 * shape.matmul_params * rows * batch + \
        4.0 * shape.layers * shape.attention_width * rows * (context + rows) * batch
    return max(moved / (machine.bandwidth_gb_s * 1e9), flops / (machine.peak_tflops * 1e12))


def surface(shape: ModelShape, machine: Machine, contexts: Sequence[int], rows: Sequence[int],
            prefill: Sequence[int], batch: int = 1) -> CostSurface:
    """A cost surface on the grid of a measured one, every cell from ``step_seconds``."""
    return CostSurface(
        tuple(contexts), tuple(rows),
        tuple(tuple(step_seconds(shape, machine, c, n, batch) for n in rows) for c in contexts),
        tuple((n, step_seconds(shape, machine, 0, n, batch)) for n in prefill))


def measure_cpu(threads: int, *, megabytes: int = 1024, repeats: int = 5) -> Machine:
    """This CPU's read bandwidth (a sum over a ``megabytes`` fp32 tensor, far beyond its
    caches) and fp32 matmul throughput (2048² × 2048² products), the best of ``repeats`` each,
    with ``threads`` torch threads (as the measured surface used)."""
    import torch

    from decoding.hardware import hardware
    torch.set_num_threads(threads)
    big = torch.ones(megabytes * 2**20 // 4)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)

    def best(run: Any) -> float:
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return min(times)
    bandwidth = big.numel() * 4 / best(lambda: big.sum()) / 1e9
    tflops = 2 * 2048**3 / best(lambda: torch.mm(a, b)) / 1e12
    return Machine(hardware(torch.device("cpu")), bandwidth, tflops,
                   f"measured here with {threads} threads: read bandwidth (sum over "
                   f"{megabytes} MiB fp32) {bandwidth:.1f} GB/s, fp32 matmul (2048^3) "
                   f"{1e3 * tflops:.0f} GFLOPS", bf16=False)


def compare(estimate: CostSurface, measured: CostSurface) -> dict[str, Any]:
    """The roofline against a measured surface, cell by cell on the measured grid:
    ``estimate / measured − 1`` per cell, the median |error| over decode cells, and the error of
    the *ratio* a prediction uses (the cost of n rows over the grid's first row count, usually
    one, at the same context; the first column itself, 0 by construction, left out)."""
    cells, ratios = [], []
    for context, line in zip(measured.contexts, measured.seconds):
        one = estimate.step_s(context, measured.rows[0])
        for n, seconds in zip(measured.rows, line):
            guess = estimate.step_s(context, n)
            cells.append({"context": context, "rows": n, "measured_s": seconds,
                          "estimate_s": guess, "error": guess / seconds - 1.0})
            if n != measured.rows[0]:
                ratios.append((guess / one) / (seconds / line[0]) - 1.0)
    prefill = [{"tokens": n, "measured_s": s, "estimate_s": estimate.prefill_s(n),
                "error": estimate.prefill_s(n) / s - 1.0} for n, s in measured.prefill]
    return {"cells": cells, "prefill": prefill,
            "median_abs_error": statistics.median(abs(c["error"]) for c in cells),
            "median_abs_ratio_error": statistics.median(abs(r) for r in ratios)
            if ratios else None,
            "median_abs_prefill_error": statistics.median(abs(p["error"]) for p in prefill)
            if prefill else None}


def describe(machine: Machine, shapes: Mapping[str, ModelShape]) -> str:
    """The note a roofline profile carries: an estimate, from what."""
    parts = [f"{role} {s.name}: {s.weight_bytes / 1e6:.0f} MB of matmul weights, "
             f"{s.kv_bytes_per_token / 1e3:.1f} kB KV per token" for role, s in shapes.items()]
    return (f"ESTIMATE (roofline, not measured): {machine.source}; " + "; ".join(parts) +
            "; no launch, framework or loop overhead (a lower bound)")
