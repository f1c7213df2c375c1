"""Outputs of the few ops whose fake implementation runs a Python decomposition of hundreds of ops, from the shape rule
of the kernel itself.

On fake tensors torch answers some ops with a Python decomposition written for compilers (it prefers them to C++ meta
kernels that cannot take symbolic sizes), which computes the whole result on fake tensors to learn its size:
`upsample_bicubic2d` runs ~400 ops, about 40 ms a call, and a traced VAR step meets it at every scale of the tokenizer.
The memo (`memory.fake_memo`) asks these rules instead on the first call of each input layout (a rule answers
`NotImplemented` where its inputs are not the plain case, and the fake mode answers as before); what a rule returns
is what the kernel allocates (the tracer never sees a decomposition's inner ops: only the output is recorded), and
`tests/test_memory_fake_shape_rules.py` holds each rule to the fake mode's own answer.

Shape legend: N batch, C channels, H / W input height / width, h / w output height / width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

_aten = torch.ops.aten


def _fresh(mode: FakeTensorMode, like: FakeTensor, shape: Sequence[int], memory_format: torch.memory_format) -> Any:
    with torch._C._DisableTorchDispatch():  # a plain meta tensor, not one more trip through the modes
        meta = torch.empty(shape, dtype=like.dtype, device="meta", memory_format=memory_format)
    return FakeTensor(mode, meta, like.fake_device)


def _upsample_bicubic2d(
    mode: FakeTensorMode,
    x_NCHW: FakeTensor,
    output_size: Sequence[int],
    align_corners: bool,
    scales_h: float | None = None,
    scales_w: float | None = None,
) -> Any:
    """ATen's `upsample_bicubic2d` meta function: (N, C, h, w) in the input's suggested memory format."""
    if x_NCHW.dim() != 4 or len(output_size) != 2 or min(output_size) <= 0 or 0 in x_NCHW.shape[1:]:
        return NotImplemented  # the fake mode's own path raises the kernel's error
    n, c = x_NCHW.shape[:2]
    return _fresh(mode, x_NCHW, (n, c, *output_size), suggest_memory_format(x_NCHW))


def _upsample_bicubic2d_vec(
    mode: FakeTensorMode,
    x_NCHW: FakeTensor,
    output_size: Sequence[int] | None,
    align_corners: bool,
    scale_factors: Sequence[float] | None,
) -> Any:
    """ATen's `compute_output_size`: the given size, else floor(input size x scale factor)."""
    if output_size is None:
        if scale_factors is None or len(scale_factors) != 2 or x_NCHW.dim() != 4:
            return NotImplemented
        output_size = [math.floor(size * scale) for size, scale in zip(x_NCHW.shape[2:], scale_factors, strict=True)]
    return _upsample_bicubic2d(mode, x_NCHW, output_size, align_corners)


SHAPE_RULES: dict[Any, Callable[..., Any]] = {
    _aten.upsample_bicubic2d.default: _upsample_bicubic2d,
    _aten.upsample_bicubic2d.vec: _upsample_bicubic2d_vec,
}
