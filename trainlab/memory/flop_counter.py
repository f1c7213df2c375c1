"""Count the FLOPs and the bytes moved of a traced training step, op by op, over the tracer's own dispatch.

`FlopCounter` is a `TorchDispatchMode` that runs on top of the `StorageTracer` (same fake tensors, same ops) and
reads the tracer's `region` and `step`, so the counts fall into forward / backward / optimizer of each traced step.

What is counted (the convention of model FLOPs utilisation, MFU):
  - forward and backward: matrix products, convolutions and attention, with the formulas of
    `engine.flop_formulas` (the training loop's counter uses the same table); elementwise ops (norms, activations,
    losses) are not counted, as MFU does not.
  - optimizer: the optimizer's step and the recipe's after-step update (EMA, momentum encoder), one FLOP per
    element each op writes (two for the fused multiply-adds `addcmul`, `addcdiv`, `lerp`); copies, fills, views
    and allocations are not FLOPs.
Bytes moved: the inputs and outputs of every counted op (a floor for the step's memory traffic: elementwise
ops of forward and backward would add more unless fused).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainlab.engine.flop_formulas import MATRIX_FORMULAS

if TYPE_CHECKING:
    from trainlab.memory.tracer import StorageTracer

aten = torch.ops.aten


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one optimizer step (all its micro-batches, one process) and the bytes its counted ops move.

    Attributes:
        forward, backward: matrix-product, convolution and attention FLOPs (2 per multiply-add).
        optimizer: elementwise FLOPs of the optimizer step and the recipe's after-step update.
        total: forward + backward + optimizer.
        per_sample: total / samples per optimizer step on the process (rounded).
        bytes_moved: bytes read and written by the counted ops (0 when not counted).
    """

    forward: int
    backward: int
    optimizer: int
    total: int
    per_sample: int
    bytes_moved: int = 0

    @staticmethod
    def of(forward: int, backward: int, optimizer: int, samples: int, bytes_moved: int = 0) -> StepFlops:
        total = forward + backward + optimizer
        return StepFlops(forward, backward, optimizer, total, round(total / max(samples, 1)), bytes_moved)

    def scaled(self, samples: int, to_samples: int) -> StepFlops:
        """The step at `to_samples` per process instead of `samples`: forward, backward and the bytes of the
        counted ops scale with the samples (every counted op works per sample; MoCo's logits against the whole
        batch's keys are an approximation), the optimizer's FLOPs do not."""
        if samples == to_samples:
            return self
        ratio = to_samples / samples
        optimizer_bytes = 0  # not kept apart: the bytes are scaled as a whole (the optimizer's are a small part)
        return StepFlops.of(
            round(self.forward * ratio),
            round(self.backward * ratio),
            self.optimizer,
            to_samples,
            round(self.bytes_moved * ratio) + optimizer_bytes,
        )


# elementwise ops that are not arithmetic: copies, fills, allocations, views, comparisons of no consequence
_NOT_FLOPS = {
    "_to_copy", "copy", "copy_", "clone", "detach", "alias", "view", "_unsafe_view", "reshape", "expand", "t",
    "transpose", "permute", "select", "slice", "unsqueeze", "squeeze", "as_strided", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
    "full_like", "fill", "fill_", "zero_", "new_zeros", "new_ones", "scalar_tensor", "lift_fresh", "_foreach_copy_",
    "_foreach_zero_", "_local_scalar_dense", "stack", "cat", "_foreach_add", "_to_copy_",
}  # fmt: skip
_TWO_FLOPS = ("addcmul", "addcdiv", "lerp")  # a multiply and an add per element


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    written: list[torch.Tensor] = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            written += _tensors(value)
    return written


class FlopCounter(TorchDispatchMode):
    """Counts FLOPs and bytes per (traced step, part): part is forward, backward or optimizer (see the module
    docstring). Enter it inside the tracer's `tracing` so that it sees the same ops."""

    def __init__(self, tracer: StorageTracer) -> None:
        super().__init__()
        self.tracer = tracer
        self.flops: dict[tuple[int, str], int] = defaultdict(int)
        self.bytes: dict[tuple[int, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        region = self.tracer.region
        if region in ("forward", "backward"):
            formula = MATRIX_FORMULAS.get(func.overloadpacket)
            if formula is not None:
                part = (self.tracer.step, str(region))
                self.flops[part] += int(formula(*args, out_val=out, **kwargs))
                self.bytes[part] += _bytes(_tensors((args, kwargs))) + _bytes(_tensors(out))
        elif region in ("optimizer", "after_step"):
            name = func.overloadpacket.__name__
            if name not in _NOT_FLOPS:
                written = _tensors(out) or _written(func, args, kwargs)
                elements = sum(t.numel() for t in written)
                key = (self.tracer.step, "optimizer")
                self.flops[key] += elements * (2 if name.strip("_").startswith(_TWO_FLOPS) else 1)
                self.bytes[key] += _bytes(_tensors((args, kwargs))) + (_bytes(_tensors(out)) if _tensors(out) else 0)
        return out

    def step_flops(self, step: int, samples: int) -> StepFlops:
        """The counts of traced step `step` (the tracer's step position); `samples` per optimizer step."""
        return StepFlops.of(
            self.flops[(step, "forward")],
            self.flops[(step, "backward")],
            self.flops[(step, "optimizer")],
            samples,
            sum(self.bytes[(step, part)] for part in ("forward", "backward", "optimizer")),
        )
