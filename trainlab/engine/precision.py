"""Precision modes: one value names how weights, the forward pass and loss scaling are handled.

| mode             | weights / optimizer state | forward             | loss scaling              |
|------------------|---------------------------|---------------------|---------------------------|
| fp32             | fp32                      | fp32                | none                      |
| fp16, bf16       | 16-bit (BatchNorm fp32)   | 16-bit              | none                      |
| fp16-scale       | fp16 (BatchNorm fp32)     | fp16                | static (GradScaler refuses fp16 grads) |
| fp16-amp, bf16-amp | fp32                    | autocast 16-bit     | none                      |
| fp16-amp-scale, bf16-amp-scale | fp32        | autocast 16-bit     | dynamic `torch.amp.GradScaler` |
| fp64             | fp64 (BatchNorm too)      | fp64                | none                      |

Anything else (`fp32-scale`, `bf16-scale`, `fp32-amp`, ...) is refused with a one-line error.

`fp64` is the reference mode, not a training mode: weights, inputs and every float the run creates (the default
dtype is float64 while the engine builds, loads data and trains, so data generation and augmentation run in
float64 too). Its use is numerical checking: two CPUs with different kernels (AVX2 / AVX-512, MKL code paths) agree
on an fp64 run to about 1e-13 where fp32 runs part after a few steps, which is what makes the golden losses portable
(`tests/test_golden_losses.py`). Code that upcasts 16-bit values for a loss uses `at_least_float32` rather than
`.float()`, which would round fp64 down (`trainlab/dtypes.py`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from trainlab.engine.precision_names import PRECISION_MODES
from trainlab.errors import UsageError

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
_WHY_REFUSED = {
    "fp64-amp": "autocast has no float64 mode; use fp64 (float64 throughout)",
    "fp64-amp-scale": "autocast has no float64 mode; use fp64 (float64 throughout)",
    "fp64-scale": "float64 gradients need no loss scaling; use fp64",
    "fp32-scale": "loss scaling only helps 16-bit gradients; use fp32, or fp16-amp-scale",
    "fp32-amp": "autocast to fp32 is a no-op; use fp32",
    "fp32-amp-scale": "autocast to fp32 is a no-op and needs no scaling; use fp32",
    "bf16-scale": "bf16 has fp32's exponent range, so pure bf16 needs no loss scale; use bf16 (or bf16-amp-scale)",
}


@dataclass(frozen=True)
class Precision:
    """A parsed precision mode. Build with `Precision.parse("bf16-amp")`."""

    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    scaling: Literal["none", "static", "dynamic"]

    @staticmethod
    def parse(name: str) -> Precision:
        if name in _WHY_REFUSED:
            raise UsageError(f"precision {name!r} is not a valid combination: {_WHY_REFUSED[name]}")
        if name not in PRECISION_MODES:
            raise UsageError(f"unknown precision {name!r}; choose one of: {', '.join(PRECISION_MODES)}")
        parts = name.split("-")
        dtype = _DTYPES[parts[0]]
        amp = "amp" in parts
        scale = "scale" in parts
        scaling: Literal["none", "static", "dynamic"] = "none"
        if scale:
            scaling = "dynamic" if amp else "static"
        return Precision(
            name=name,
            param_dtype=torch.float32 if amp else dtype,
            autocast_dtype=dtype if amp else None,
            scaling=scaling,
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.autocast_dtype or self.param_dtype

    @property
    def casts_weights(self) -> bool:
        """Whether weights (and floating inputs) are cast away from fp32: the pure 16-bit modes and fp64."""
        return self.param_dtype != torch.float32

    @property
    def is_pure_low_precision(self) -> bool:
        return self.param_dtype in (torch.float16, torch.bfloat16)

    def default_dtype(self) -> contextlib.AbstractContextManager[Any]:
        """The default float dtype the run creates tensors in: float64 for fp64, else unchanged (float32)."""
        if self.param_dtype != torch.float64:
            return contextlib.nullcontext()
        return _default_dtype(torch.float64)

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    def prepare_model(self, model: nn.Module, keep_batchnorm_fp32: bool = True) -> nn.Module:
        """Cast weights for pure 16-bit modes (BatchNorm kept fp32 by default, as apex O2 and airbench do) and fp64."""
        if not self.casts_weights:
            return model
        model.to(self.param_dtype)
        if keep_batchnorm_fp32 and self.is_pure_low_precision:
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.float()
        return model

    def cast_input(self, x: Any) -> Any:
        """Cast floating tensors of a batch to the weight dtype in pure 16-bit modes and fp64 (AMP leaves inputs
        alone)."""
        if not self.casts_weights:
            return x
        if isinstance(x, torch.Tensor):
            return x.to(self.param_dtype) if x.is_floating_point() else x
        if isinstance(x, (list, tuple)):
            return type(x)(self.cast_input(v) for v in x)
        if isinstance(x, dict):
            return {k: self.cast_input(v) for k, v in x.items()}
        return x


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def check_device_support(precision: Precision, device: torch.device) -> None:
    """Refuse a precision the device cannot run, with a one-line reason. Logs the (slow) CPU fp16 case."""
    dtype = precision.compute_dtype
    if dtype in (torch.float32, torch.float64):
        if dtype == torch.float64 and device.type not in ("cpu", "cuda"):
            raise UsageError(f"{device.type} has no float64 kernels; use --precision fp32")
        return
    if device.type == "cuda":
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            name = torch.cuda.get_device_name(device)
            raise UsageError(f"{name} has no native bf16 (needs compute capability >= 8.0); use fp16-amp-scale or fp32")
        if dtype == torch.float16 and torch.cuda.get_device_capability(device) < (5, 3):
            raise UsageError(f"{torch.cuda.get_device_name(device)} cannot compute in fp16; use fp32")
        return
    try:  # probe: the ops a training step needs must exist for this dtype on this device
        a = torch.ones(2, 2, device=device, dtype=dtype)
        (a @ a).sum()
        torch.nn.functional.conv2d(torch.ones(1, 1, 3, 3, device=device, dtype=dtype), a.view(1, 1, 2, 2))
    except RuntimeError as err:
        first = str(err).splitlines()[0]
        raise UsageError(f"{device.type} cannot compute in {dtype} ({first}); use fp32 or bf16") from None
    if device.type == "cpu" and dtype == torch.float16:
        log.warning("fp16 on CPU runs without native kernels on most CPUs (often 40-75x slower than fp32)")


class LossScaler:
    """One interface over the three scaling policies, driven once per optimizer step by the engine.

    * none: identity.
    * dynamic: `torch.amp.GradScaler` (fp32 weights under autocast).
    * static: multiply the loss by a constant, divide the gradients by it before clipping; an overflow (non-finite
      gradient) skips the step. Used for pure fp16 weights, which GradScaler refuses.
    """

    def __init__(self, precision: Precision, device_type: str, static_scale: float = 1024.0) -> None:
        self.policy = precision.scaling
        self.static_scale = float(static_scale)
        self.grad_scaler: torch.amp.GradScaler | None = None
        if self.policy == "dynamic":
            self.grad_scaler = torch.amp.GradScaler(device_type)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if self.grad_scaler is not None:
            return self.grad_scaler.scale(loss)
        if self.policy == "static":
            return loss * self.static_scale
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place, exactly once per optimizer step (before clipping)."""
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(optimizer)
        elif self.policy == "static":
            inv = 1.0 / self.static_scale
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv)

    def step(self, optimizer: torch.optim.Optimizer, grads_finite: bool) -> bool:
        """Step the optimizer unless gradients overflowed. Returns True if the step was taken."""
        if self.grad_scaler is not None:
            # GradScaler skips the step itself on inf/NaN (the same gradients that made the norm non-finite)
            # and lowers the scale; `update` must run on every optimizer step either way.
            self.grad_scaler.step(optimizer)
            self.grad_scaler.update()
            return grads_finite
        if not grads_finite:
            return False
        optimizer.step()
        return True

    @property
    def current_scale(self) -> float:
        if self.grad_scaler is not None:
            return float(self.grad_scaler.get_scale())
        return self.static_scale if self.policy == "static" else 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.grad_scaler is not None and state.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state["grad_scaler"])


def grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> tuple[float, bool]:
    """Total L2 gradient norm (clipped in place to `max_norm` when > 0). Returns (norm, finite).

    Always returns a float: parameters without gradients are ignored, and no gradient at all gives 0.0.
    """
    grads = [p for p in parameters if p.grad is not None]
    if not grads:
        return 0.0, True
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in grads if p.grad is not None], foreach=True)
    from torch.distributed.tensor import DTensor  # torch.distributed only where gradients are

    if isinstance(norm, DTensor):  # --fsdp: the norm of the sharded gradients, the same on every rank
        norm = norm.full_tensor()
    value = float(norm)
    return value, math.isfinite(value)


@contextlib.contextmanager
def only_requires_grad(trainable: list[nn.Parameter], all_params: list[nn.Parameter]) -> Iterator[None]:
    """Temporarily freeze every parameter not in `trainable` (multi-optimizer recipes such as GANs)."""
    keep = {id(p) for p in trainable}
    saved = [(p, p.requires_grad) for p in all_params]
    for p in all_params:
        if id(p) not in keep:
            p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)
