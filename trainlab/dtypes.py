"""Dtype helpers every layer may use (a leaf module: it imports only torch)."""

from __future__ import annotations

import torch


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """`x` as float32 if it is a 16-bit or integer tensor; unchanged if it is already float32 or float64.

    The upcast before a loss or a statistic. Unlike `.float()` it keeps the fp64 reference mode in float64
    (`trainlab.engine.precision`), so an fp64 run computes every loss in float64.
    """
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
