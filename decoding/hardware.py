"""What a measurement ran on: the GPU's name, or the CPU's model name.

A plain description of the machine (speed depends on it), recorded by the tuner (the study
fingerprint, every trial) and by EAGLE head training (a head's README); both import it from here.
"""

from __future__ import annotations

import platform

import torch

__all__ = ["hardware"]


def hardware(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (speed depends on it)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())
