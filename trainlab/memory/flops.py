"""FLOPs of a recipe's training step and the step time they predict on a GPU.

    count_step_flops(recipe, ...)   trace one optimizer step on fake tensors and count its FLOPs (`flop_counter`)
    compute_name(precision)         the compute dtype a precision mode's matrix products run in (fp32, bf16, fp16)
    estimate_step_seconds(...)      FLOPs / (peak x efficiency), floored by bytes moved / bandwidth

trainlab enables no TF32, so fp32 runs use the GPU's plain fp32 peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainlab.engine.precision import Precision
from trainlab.engine.recipe import Recipe
from trainlab.engine.sampler import micro_batch_size
from trainlab.engine.throughput import compute_name as throughput_compute_name
from trainlab.errors import UsageError
from trainlab.memory.flop_counter import StepFlops
from trainlab.memory.gpus import GpuProfile

if TYPE_CHECKING:
    from trainlab.memory.trace import PlanDevice

__all__ = ["StepFlops", "compute_name", "count_step_flops", "estimate_step_seconds"]


def count_step_flops(
    recipe: Recipe[Any],
    *,
    gpus: int = 1,
    micro_batch: int | None = None,
    grad_accumulation: int | None = None,
    device: PlanDevice = "cuda",
) -> StepFlops:
    """FLOPs of one optimizer step of `recipe` on one of `gpus` processes, traced on fake tensors (no data, no
    weights, no GPU). The step is the last one the planner traces (late phases and schedules at their largest).

    Args:
        recipe: the recipe with its config (precision, batch size, accumulation).
        gpus: processes the global batch is split over.
        micro_batch: samples per micro-batch (default: the config's batch / accumulation / gpus).
        grad_accumulation: micro-batches per optimizer step (default: the config's).
        device: "cuda" (CUDA's autocast policy and foreach optimizers) or "cpu".
    """
    from trainlab.memory.trace import trace_training  # imported here: importing flops stays light

    cfg = recipe.config
    accumulation = cfg.grad_accumulation if grad_accumulation is None else grad_accumulation
    micro = micro_batch_size(cfg.batch_size, accumulation, gpus) if micro_batch is None else micro_batch
    run = trace_training(recipe, device=device, micro_batch=micro, grad_accumulation=accumulation, count_flops=True)
    assert run.flops is not None
    return run.flops


def compute_name(precision: str) -> str:
    """The `GpuProfile.peak_tflops` key of a `--precision` mode: the dtype its matrix products run in, as the
    training loop names it (`engine.throughput.compute_name`; fp32 unless TF32 matmuls are allowed)."""
    return throughput_compute_name(Precision.parse(precision))


def estimate_step_seconds(flops: StepFlops, gpu: GpuProfile, compute: str, efficiency: float) -> float:
    """Seconds per optimizer step: FLOPs / (the GPU's dense peak for `compute` x `efficiency`), and at least the
    bytes moved / the memory bandwidth.

    Raises:
        UsageError: the GPU has no known peak for `compute` (a GPU given by size, or bf16 on a V100).
    """
    peak = gpu.peak_flops(compute)
    if peak is None:
        raise UsageError(
            f"no {compute} peak throughput is known for {gpu.name}; pass a GPU by name (`trainlab plan --gpu all` "
            "lists them) or another --precision"
        )
    if not 0 < efficiency <= 1:
        raise ValueError(f"an efficiency is in (0, 1], got {efficiency}")
    compute_seconds = flops.total / (peak * efficiency)
    bandwidth = gpu.bandwidth_gb_per_s * 1e9
    return max(compute_seconds, flops.bytes_moved / bandwidth if bandwidth > 0 else 0.0)
