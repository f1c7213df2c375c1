"""CUDA autocast's cast policy, substituted into a trace that runs under CPU autocast (`plan --device cuda`).

The planner traces on CPU, so `torch.autocast` applies CPU's op lists. CUDA's lists differ (PyTorch
`aten/src/ATen/autocast_mode.h`: `AT_FORALL_FP32`, `AT_FORALL_FP32_SET_OPT_DTYPE`; CPU's lists are in
`autocast_mode.cpp`, `TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`). Ops CUDA runs in fp32 that CPU autocast leaves in
the input's dtype (checked on this torch for the common ones: a bf16 input gives a bf16 output on CPU):

- fp32 policy (every floating input cast to fp32, the op runs without autocast): layer_norm, group_norm, exp,
  expm1, log, log2, log10, log1p, reciprocal, rsqrt, pow, acos, asin, cosh, sinh, tan, erfinv, softplus,
  cosine_similarity, logsumexp, dist, pdist, renorm.
- fp32_set_opt_dtype policy (when the first argument is a 16/32-bit float and no `dtype` is given, the op runs with
  `dtype=float32`): softmax, log_softmax, sum, cumsum, cumprod, linalg.vector_norm, linalg.matrix_norm.

`CudaAutocastPolicy` is a `TorchFunctionMode` that applies those two policies to the Python calls that reach these
ops (`F.layer_norm`, `torch.softmax`, `Tensor.sum`, `x ** 2`, ...) while CPU autocast is on, above autograd, so
what autograd saves for backward (the fp32 copies and outputs) is what CUDA would save. Not substituted (left to
CPU's rules, noted here so nothing is silently assumed): ops reached only from inside a C++ composite (for example
the log_softmax inside `F.cross_entropy`: CPU runs the whole `cross_entropy_loss` in fp32, CUDA its log_softmax and
nll_loss, so both keep fp32 log-probabilities); CUDA's `promote` list (addcdiv, addcmul, atan2, bilinear, cross,
dot, grid_sampler, index_put, tensordot, scatter_add) against CPU's (stack, cat, index_copy); the lower-precision
ops CUDA lists and CPU does not (addmv, addr, mv, einsum, chain_matmul, linalg_multi_dot, RNN cells; MoCo's
`torch.einsum` still runs in 16 bits on CPU, through the bmm CPU lists). The losses and cdist are fp32 on both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

_T = torch.Tensor

# CUDA's fp32 policy, by the Python functions and methods that reach the op
FP32_OPS: frozenset[Callable[..., Any]] = frozenset(
    {
        F.layer_norm,
        torch.layer_norm,
        torch.native_layer_norm,
        F.group_norm,
        torch.group_norm,
        F.softplus,
        F.cosine_similarity,
        torch.cosine_similarity,
        F.pdist,
        torch.pdist,
        torch.dist,
        _T.dist,
        torch.renorm,
        _T.renorm,
        torch.logsumexp,
        _T.logsumexp,
        torch.pow,
        _T.pow,
        _T.__pow__,
        _T.__rpow__,
        *(getattr(mod, name) for mod in (torch, _T) for name in ("exp", "expm1", "log", "log2", "log10", "log1p")),
        *(getattr(mod, name) for mod in (torch, _T) for name in ("reciprocal", "rsqrt", "acos", "asin", "cosh")),
        *(getattr(mod, name) for mod in (torch, _T) for name in ("sinh", "tan", "erfinv")),
    }
)

# CUDA's fp32_set_opt_dtype policy
SET_DTYPE_OPS: frozenset[Callable[..., Any]] = frozenset(
    {
        F.softmax,
        F.log_softmax,
        torch.softmax,
        torch.log_softmax,
        _T.softmax,
        _T.log_softmax,
        torch.sum,
        _T.sum,
        torch.cumsum,
        _T.cumsum,
        torch.cumprod,
        _T.cumprod,
        torch.linalg.vector_norm,
        torch.linalg.matrix_norm,
    }
)


_WATCHED = FP32_OPS | SET_DTYPE_OPS | {torch.Tensor.backward}

_BACKWARD_OPTIONS = ("gradient", "retain_graph", "create_graph", "inputs")  # all unset: the engine's `loss.backward()`


def _plain_backward(kwargs: dict[str, Any]) -> bool:
    return all(kwargs.get(k) is None or kwargs.get(k) is False for k in _BACKWARD_OPTIONS)


def _eligible(x: Any) -> bool:
    """CUDA autocast's `is_eligible`: a floating tensor other than float64."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _to_fp32(x: Any) -> Any:
    return x.float() if _eligible(x) and x.dtype != torch.float32 else x


class CudaAutocastPolicy(TorchFunctionMode):
    """While CPU autocast is enabled, run the ops above with CUDA autocast's policy instead of CPU's.

    Args:
        enabled: False makes the mode a pass-through (so callers can enter it unconditionally).
    """

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _WATCHED or not self.enabled:  # every torch call and tensor attribute read comes here
            return func(*args, **kwargs)
        if func is torch.Tensor.backward and len(args) == 1 and _plain_backward(kwargs):
            return self._backward(args[0])
        if not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        if func in FP32_OPS:
            args, kwargs = tree_map(_to_fp32, (args, kwargs))
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        if func in SET_DTYPE_OPS and args and _eligible(args[0]) and kwargs.get("dtype") is None:
            if not _dtype_given_positionally(func, args):
                kwargs = {**kwargs, "dtype": torch.float32}
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` with this mode active in the autograd engine, so that activation checkpointing's
        recomputation (which re-enters CPU autocast) casts as the forward did. A mode is popped while its handler
        runs, and `Tensor.backward` / `torch.autograd.backward` would hand the call back to it, so the engine is
        called as `torch.autograd.backward` calls it (the plain `loss.backward()` form the engine uses)."""
        try:  # private torch entry points (tested with torch 2.14): a newer torch that moved them gets one line
            from torch.autograd import _make_grads
            from torch.autograd.graph import _engine_run_backward
        except ImportError as err:
            from trainlab.errors import UsageError

            raise UsageError(
                f"planning with CUDA's autocast policy needs torch internals this torch {torch.__version__} lacks "
                f"({err}); plan with --device cpu, or use torch 2.14"
            ) from None

        with self:
            grads = _make_grads((loss,), (None,), is_grads_batched=False)
            _engine_run_backward((loss,), grads, False, False, (), allow_unreachable=True, accumulate_grad=True)


def _dtype_given_positionally(func: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    """`F.softmax(x, dim, _stacklevel, dtype)` and `x.sum(dim, keepdim, dtype)` style calls: a dtype among the
    positional arguments counts as given."""
    return any(isinstance(a, torch.dtype) for a in args[1:])
