"""Clocks and memory around one generation: device-synchronised wall time, peak memory.

Every generation is timed as a whole (synchronised before and after on CUDA; text is decoded after
the window closes); the decoding loop only marks its draft/verify phases.
"""

from __future__ import annotations

import resource
import time
from typing import Any, Callable

import torch

from decoding import generate


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Timer = Callable[[Any, list[int], int, torch.device], tuple[Any, float]]


def time_generation(method: Any, ids: list[int], max_new_tokens: int,
                    device: torch.device) -> tuple[Any, float]:
    """Generate (token ids only: text decoding stays outside the window) and time it."""
    synchronize(device)
    began = time.perf_counter()
    out = generate(method, ids, max_new_tokens)
    synchronize(device)
    return out, time.perf_counter() - began


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA allocator stats; Linux VmHWM via clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    """Peak GPU memory allocated (CUDA) or the process's peak RSS since the last reset (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in open("/proc/self/status", encoding="ascii"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


