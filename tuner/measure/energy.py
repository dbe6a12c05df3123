"""GPU energy from NVML (``nvidia-ml-py``, imported as ``pynvml``).

The total-energy counter (mJ, Volta and newer) is read at both ends of a window; where it is not
supported, board power is integrated by a 10 Hz sampling thread. Windows shorter than 1 s are
reported but flagged (the counter updates about every 100 ms). Without a GPU the reading is
``available=False`` with the reason.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MIN_WINDOW_S = 1.0


@dataclass(frozen=True)
class EnergyReading:
    available: bool
    reason: str            # why unavailable, or the method used
    joules: float | None
    seconds: float


def nvml_uuid(device: "torch.device") -> str | None:
    """NVML's UUID ("GPU-...") of the GPU a torch device is on, or None for a CPU device.

    NVML numbers GPUs physically and ignores ``CUDA_VISIBLE_DEVICES``; torch numbers them after
    that mask. The UUID is the same in both worlds, so it is what links them.
    """
    import torch
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


class EnergyMeter:
    """Context manager measuring the energy of the GPU that ``device`` is on over its block."""

    def __init__(self, device: "torch.device | None" = None) -> None:
        self.reason, self._nvml, self._handle = "", None, None
        if device is not None and device.type != "cuda":
            self.reason = f"NVML unavailable: the model runs on {device.type}, not an NVIDIA GPU"
            return
        try:
            import pynvml
        except ImportError:
            self.reason = "nvidia-ml-py not installed"
            return
        try:
            pynvml.nvmlInit()
            uuid = nvml_uuid(device) if device is not None else None
            self._handle = (pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else
                            pynvml.nvmlDeviceGetHandleByIndex(0))
            self._nvml = pynvml
        except pynvml.NVMLError as err:
            self.reason = f"NVML unavailable ({err}): no NVIDIA GPU/driver on this machine"

    @property
    def available(self) -> bool:
        return self._handle is not None

    def __enter__(self) -> EnergyMeter:
        self._start, self._joules, self._stop = time.perf_counter(), None, threading.Event()
        self.reading: EnergyReading | None = None
        if not self.available:
            return self
        try:
            self._start_mj = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            self._method = "nvml_total_energy"
        except self._nvml.NVMLError:
            self._method, self._joules = "power_integration", 0.0
            self._thread = threading.Thread(target=self._integrate, daemon=True)
            self._thread.start()
        return self

    def _integrate(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(0.1):
            now = time.perf_counter()
            watts = self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
            self._joules += watts * (now - last)
            last = now

    def __exit__(self, *exc) -> None:
        seconds = time.perf_counter() - self._start
        if not self.available:
            self.reading = EnergyReading(False, self.reason, None, seconds)
            return
        if self._method == "nvml_total_energy":
            joules = (self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
                      - self._start_mj) / 1000.0
        else:
            self._stop.set()
            self._thread.join()
            joules = self._joules
        note = self._method if seconds >= MIN_WINDOW_S else f"{self._method} (window < 1 s)"
        self.reading = EnergyReading(True, note, joules, seconds)
