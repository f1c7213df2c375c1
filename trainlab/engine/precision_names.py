"""The precision modes by name (the meaning of each is `trainlab/engine/precision.py`'s table).

Kept apart from `precision.py` so the configs that name a mode (`--precision`, `trainlab bench precision --modes`)
are parsed without importing torch.
"""

from __future__ import annotations

from typing import Literal, get_args

PrecisionName = Literal[
    "fp32", "fp16", "fp16-scale", "bf16", "fp16-amp", "fp16-amp-scale", "bf16-amp", "bf16-amp-scale", "fp64"
]
PRECISION_MODES: tuple[str, ...] = get_args(PrecisionName)
LAB_PRECISIONS: tuple[str, ...] = tuple(m for m in PRECISION_MODES if m != "fp64")  # the eight training modes
