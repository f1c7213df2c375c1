"""Precision modes: one value names how weights, the forward pass and loss scaling are handled.

| mode             | weights / optimizer state | forward             | loss scaling              |
|------------------|---------------------------|---------------------|---------------------------|
| fp32             | fp32                      | fp32                | none                      |
| fp16, bf16       | 16-bit (BatchNorm fp32)   | 16-bit              | none                      |
| fp16-scale       | fp16 (BatchNorm fp32)     | fp16                | static (GradScaler refuses fp16 grads) |
| fp16-amp, bf16-amp | fp32                    | autocast 16-bit     | none                      |
| fp16-amp-scale, bf16-amp-scale | fp32        | autocast 16-bit     | dynamic `torch.amp.GradScaler` |

Anything else (`fp32-scale`, `bf16-scale`, `fp32-amp`, ...) is refused with a one-line error.
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

from trainlab.errors import UsageError

log = logging.getLogger(__name__)

PRECISION_MODES = (
    "fp32",
    "fp16",
    "fp16-scale",
    "bf16",
    "fp16-amp",
    "fp16-amp-scale",
    "bf16-amp",
    "bf16-amp-scale",
)
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_WHY_REFUSED = {
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
    def is_pure_low_precision(self) -> bool:
        return self.param_dtype != torch.float32

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    def prepare_model(self, model: nn.Module, keep_batchnorm_fp32: bool = True) -> nn.Module:
        """Cast weights for pure 16-bit modes (BatchNorm kept fp32 by default, as apex O2 and airbench do)."""
        if not self.is_pure_low_precision:
            return model
        model.to(self.param_dtype)
        if keep_batchnorm_fp32:
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.float()
        return model

    def cast_input(self, x: Any) -> Any:
        """Cast floating tensors of a batch to the weight dtype in pure 16-bit modes (AMP leaves inputs alone)."""
        if not self.is_pure_low_precision:
            return x
        if isinstance(x, torch.Tensor):
            return x.to(self.param_dtype) if x.is_floating_point() else x
        if isinstance(x, (list, tuple)):
            return type(x)(self.cast_input(v) for v in x)
        if isinstance(x, dict):
            return {k: self.cast_input(v) for k, v in x.items()}
        return x


def check_device_support(precision: Precision, device: torch.device) -> None:
    """Refuse a precision the device cannot run, with a one-line reason. Logs the (slow) CPU fp16 case."""
    dtype = precision.compute_dtype
    if dtype == torch.float32:
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
