"""Training throughput: images/s, achieved TFLOP/s and model FLOPs utilisation (MFU), logged with the metrics.

FLOPs per optimizer step are counted on the real step, not modelled: the first optimizer step this process trains
runs under a dispatch mode that adds up the formulas of `engine.flop_formulas` for the matrix products, convolutions
and attention kernels of the forward and the backward (the "model FLOPs" of MFU, as nanoGPT, torchtitan and PaLM
count them; elementwise ops, norms and the optimizer's update are not counted). A step that grows (VAR's
progressive schedule, a phase that starts late) is counted again in a later epoch, at the first step
`RECOUNT_STEPS` steps or more after the latest count. A counted step costs more host time than the others (about
2-3 x on the CPU debug models, where Python dispatch dominates: `benchmarks/bench_plan_measure.py`), so counting
at most once in `RECOUNT_STEPS` steps keeps the cost under 1 % of training; the other steps cost nothing.

The clock is the loop's own: the window the data-wait clock (`engine.data_wait`) measures between two log rows. For
each training log row: `images_per_second` (global batch x steps in the window / its seconds), `achieved_tflops`
(FLOPs of one process's step x steps / seconds, per device) and `mfu` (achieved / the device's dense peak for the
step's compute dtype, only where the peak is known: a CUDA GPU of `memory.gpus.GPU_PROFILES`, found by its device
name; a CPU has no known peak and logs no MFU). Under `--compile` inductor's kernels bypass the counter: no FLOPs
are counted and only images/s is logged (said once at the start).
"""

# Legend: none (no tensors are named here).

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainlab.engine.flop_formulas import MATRIX_FORMULAS
from trainlab.engine.precision import Precision

log = logging.getLogger(__name__)

T = TypeVar("T")

RECOUNT_STEPS = 500
"""Optimizer steps between two FLOP counts, at least (and the next count is in a later epoch)."""


def compute_name(precision: Precision) -> str:
    """The name of the dtype the step's matrix products run in, as `GpuProfile.peak_flops` takes it: bf16, fp16,
    fp64, tf32 (fp32 weights with TF32 matmuls allowed: `torch.set_float32_matmul_precision("high")`) or fp32."""
    dtype = precision.compute_dtype
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.float64:
        return "fp64"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


@dataclass(frozen=True)
class DevicePeak:
    """The dense peak FLOP/s of the device for a compute dtype, and what it is (or why it is not known).

    Attributes:
        flops: FLOP/s, None where not known (a CPU, a GPU not in the table, a dtype the GPU has no unit for).
        gpu: the GPU profile's name ('' where none matched).
        why: one line for the log: the profile and dtype, or the reason the peak is unknown.
    """

    flops: float | None
    gpu: str
    why: str


def device_peak(device: torch.device, compute: str) -> DevicePeak:
    """The peak of `device` for the compute dtype `compute` (`compute_name`), from the GPU table."""
    if device.type != "cuda":
        return DevicePeak(None, "", f"unknown peak on {device.type} (no MFU)")
    from trainlab.memory.gpus import profile_for_device_name

    name = torch.cuda.get_device_name(device)
    profile = profile_for_device_name(name)
    if profile is None:
        return DevicePeak(None, "", f"unknown peak: {name!r} is not in the GPU table (trainlab/memory/gpus.py)")
    flops = profile.peak_flops(compute)
    if flops is None:
        return DevicePeak(None, profile.name, f"unknown peak: {profile.name} lists no {compute} peak")
    return DevicePeak(flops, profile.name, f"{profile.name} dense {compute} peak {flops / 1e12:,.1f} TFLOP/s")


class _FlopCounter(TorchDispatchMode):
    """Adds up `engine.flop_formulas`' formulas for the ops that have one, and runs every op as it is.

    Not `FlopCounterMode` itself: that one decomposes some ops to count inside them, and the decomposed kernels sum in
    another order (a GAN's discriminator loss moved by 2e-15 in fp64), while counting must not change the step."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = MATRIX_FORMULAS.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


def count_flops(run: Callable[[], T]) -> tuple[T, int]:
    """Run `run()` under the FLOP counter; returns its result and the FLOPs counted (forward and backward matrix
    products, convolutions, attention). The results are those of `run()` alone, bit for bit."""
    counter = _FlopCounter()
    with counter:
        result = run()
    return result, counter.flops


class Throughput:
    """Images/s, achieved TFLOP/s and MFU of the training loop (see the module docstring).

    Args:
        global_batch: images per optimizer step over all processes.
        peak: the device's peak (`device_peak`).
        count: count FLOPs (False under --compile: images/s only).
    """

    def __init__(self, *, global_batch: int, peak: DevicePeak, count: bool) -> None:
        self.global_batch = global_batch
        self.peak = peak
        self.count = count
        self.flops_per_step: int | None = None  # one process's optimizer step, the latest count
        self._counted: tuple[int, int] | None = None  # (epoch, step) of the latest count
        self._window_step = 0

    def due(self, epoch: int, step: int) -> bool:
        """Whether the optimizer step `step` (0-based) of `epoch` is counted: the first this process runs, then the
        first step of a later epoch than the latest count's that is `RECOUNT_STEPS` or more steps after it."""
        if not self.count:
            return False
        if self._counted is None:
            return True
        counted_epoch, counted_step = self._counted
        return epoch != counted_epoch and step - counted_step >= RECOUNT_STEPS

    def run_step(self, step: Callable[[], T], epoch: int, step_index: int) -> T:
        """Run one optimizer step (`step_index`, 0-based, of `epoch`), counting its FLOPs when `due`."""
        if not self.due(epoch, step_index):
            return step()
        result, flops = count_flops(step)
        self._counted = (epoch, step_index)
        self.flops_per_step = flops
        return result

    def start_window(self, step: int) -> None:
        """A new timing window starts after `step` optimizer steps (the data-wait clock's window started too)."""
        self._window_step = step

    def window(self, step: int, seconds: float) -> dict[str, float]:
        """The metrics of the window that ends after `step` optimizer steps, `seconds` long; starts the next one."""
        steps, self._window_step = step - self._window_step, step
        return self.rates(steps / seconds if seconds > 0 and steps > 0 else 0.0)

    def rates(self, steps_per_second: float) -> dict[str, float]:
        """images_per_second, achieved_tflops (per device) and mfu at a rate of optimizer steps per second (only
        what is known: no FLOPs before the first count, no MFU without a peak)."""
        if steps_per_second <= 0:
            return {}
        out = {"images_per_second": self.global_batch * steps_per_second}
        if self.flops_per_step is not None:
            achieved = self.flops_per_step * steps_per_second
            out["achieved_tflops"] = achieved / 1e12
            if self.peak.flops is not None:
                out["mfu"] = achieved / self.peak.flops
        return out

    def describe(self) -> str:
        """One line for the start of the run: what is counted and the peak MFU is measured against."""
        if not self.count:
            return "throughput: images/s only (--compile: inductor's kernels bypass the FLOP counter)"
        return f"throughput: FLOPs counted on the first step (again after {RECOUNT_STEPS} steps); {self.peak.why}"
