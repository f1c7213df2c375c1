"""Measured peak memory: CUDA max allocated / reserved on GPU, peak resident set size on CPU. Never typed in."""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, Any]:
    """Peak memory since the last reset (CUDA) or since process start (CPU RSS high-water mark)."""
    if device.type == "cuda":
        return {
            "peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)),
            "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "memory_kind": "cuda_max_allocated",
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB, macOS bytes
    return {"peak_memory_bytes": int(rss * scale), "memory_kind": "cpu_peak_rss"}


def current_rss_bytes() -> int:
    """Resident set size now (CPU); with `peak_memory` it gives the growth during training."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
