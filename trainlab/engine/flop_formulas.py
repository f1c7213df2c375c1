"""The FLOP formulas of model FLOPs: matrix products, convolutions and attention (2 FLOPs per multiply-add).

`MATRIX_FORMULAS` maps an aten op to `torch.utils.flop_counter`'s formula for it (called with the op's arguments and
`out_val=` its output), plus CPU's fused attention (`_scaled_dot_product_flash_attention_for_cpu`, forward and
backward), which torch's table lacks and which the same attention formulas as CUDA's kernels count. One table for
the two counters: the training loop's (`engine.throughput`, over the real step) and the planner's
(`memory.flop_counter`, over the traced step on fake tensors).
"""

# Shape legend: B batch, H heads, L queries, S keys, E head dim.

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


def _cpu_flash_attention(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    """(B, H, L, E) queries against (B, H, S, E) keys and values: 2 BHLSE + 2 BHLSE."""
    return sdpa_flop_count(_shape(query), _shape(key), _shape(value))


def _cpu_flash_attention_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(_shape(grad_out), _shape(query), _shape(key), _shape(value))


def _registry() -> dict[Any, Callable[..., int]]:
    formulas: dict[Any, Callable[..., int]] = dict(flop_registry)
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_attention),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_attention_backward),
    ):
        if hasattr(aten, name):
            formulas[getattr(aten, name)] = formula
    return formulas


MATRIX_FORMULAS: dict[Any, Callable[..., int]] = _registry()
