"""The planner: trace the configured run, add what lives outside the allocator, and answer the planning questions.

`plan(recipe, PlanRequest(...))` returns a `Plan`: the breakdown of the configured micro-batch, the total against the
GPU, the largest micro-batch that fits (a search over traced micro-batches), the `--grad-accumulation` that keeps
the global batch, the GPUs the global batch needs, and levers with their predicted totals.
`auto_accumulation(recipe, device, capacity)` answers only the accumulation question, for
`trainlab train --grad-accumulation auto`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainlab.engine.recipe import Recipe
from trainlab.engine.sampler import micro_batch_size
from trainlab.errors import UsageError
from trainlab.memory.breakdown import Breakdown, breakdown
from trainlab.memory.fsdp_memory import FsdpMemory, FsdpPlanner, FsdpSettings
from trainlab.memory.gpus import GpuProfile
from trainlab.memory.moco_keys import accumulation_effect, moco_plan_notes
from trainlab.memory.trace import PlanDevice, trace_training

log = logging.getLogger(__name__)

SAFETY_MARGIN = 0.0  # a plan "fits" when the predicted total is at most the GPU's memory; the margin is printed


@dataclass(frozen=True)
class PlanRequest:
    device: PlanDevice
    gpu: GpuProfile | None = None
    gpus: int = 1
    search: bool = True  # search the largest micro-batch and levers (needs --gpu)
    fsdp: FsdpSettings | None = None  # --fsdp: parameters, gradients and optimizer states sharded over the GPUs


@dataclass
class Overheads:
    """Memory outside the traced tensors (CUDA only), all estimates until measured on the GPU."""

    context_bytes: int = 0
    cublas_workspace_bytes: int = 0
    cudnn_workspace_bytes: int = 0
    nccl_bytes: int = 0
    ddp_buckets_bytes: int = 0

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))


@dataclass
class Lever:
    name: str
    description: str
    total_bytes: int | None  # None: could not be predicted (the reason is in `description`)
    fits: bool | None


@dataclass
class Plan:
    recipe: str
    precision: str
    global_batch: int
    gpus: int
    breakdown: Breakdown
    overheads: Overheads
    total_bytes: int
    gpu: GpuProfile | None
    fits: bool | None = None
    margin_bytes: int | None = None
    max_micro_batch: int | None = None
    min_micro_batch: int = 1  # the smallest micro-batch the model trains on (2 with BatchNorm)
    max_micro_batch_total_bytes: int | None = None
    suggested_grad_accumulation: int | None = None
    gpus_needed: int | None = None
    levers: list[Lever] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # recipe-specific lines (MoCo: keys under accumulation)
    traces: int = 1
    activation_checkpointing: bool = False
    # --compile runs are traced as the eager step (inductor's fused kernels usually keep fewer intermediates)
    compiled: bool = False
    fsdp: FsdpMemory | None = None  # --fsdp over several GPUs: one rank's sharded states and gathered working set


def overheads(
    device: PlanDevice, gpu: GpuProfile | None, gpus: int, gradients_bytes: int, has_conv: bool, fsdp: bool = False
) -> Overheads:
    if device != "cuda" or gpu is None:
        return Overheads()
    return Overheads(
        context_bytes=gpu.context_bytes,
        cublas_workspace_bytes=gpu.cublas_workspace_bytes,
        cudnn_workspace_bytes=gpu.cudnn_workspace_bytes if has_conv else 0,
        nccl_bytes=gpu.nccl_bytes if gpus > 1 else 0,
        # DDP's gradient buckets: one more gradient-sized copy (gradient_as_bucket_view is off in the engine)
        ddp_buckets_bytes=gradients_bytes if gpus > 1 and not fsdp else 0,  # FSDP: its reduce-scatter buffer
    )


class _Tracer:
    """Traces (and caches) breakdowns of the recipe at a micro-batch, accumulation and precision."""

    def __init__(self, recipe: Recipe[Any], device: PlanDevice) -> None:
        self.recipe, self.device = recipe, device
        self.cache: dict[tuple[int, int, str, bool], Breakdown] = {}

    def __call__(
        self, micro_batch: int, accumulation: int, precision: str | None = None, checkpointing: bool | None = None
    ) -> Breakdown:
        cfg = self.recipe.config
        precision = precision or cfg.precision
        checkpointing = cfg.activation_checkpointing if checkpointing is None else checkpointing
        key = (micro_batch, accumulation, precision, checkpointing)
        if key not in self.cache:
            recipe = self.recipe
            if precision != cfg.precision or checkpointing != cfg.activation_checkpointing:
                config = dataclasses.replace(cfg, precision=precision, activation_checkpointing=checkpointing)
                recipe = type(recipe)(config)
            run = trace_training(recipe, device=self.device, micro_batch=micro_batch, grad_accumulation=accumulation)
            self.cache[key] = breakdown(run)
            log.info(
                "traced micro-batch %d x %d (%s%s)",
                micro_batch,
                accumulation,
                precision,
                ", activation checkpointing" if checkpointing else "",
            )
        return self.cache[key]


def _checkpointing_supported(tracer: _Tracer) -> bool:
    """Whether the recipe's models can recompute activations (`set_grad_checkpointing`): a trace with it on is
    refused otherwise (see `engine.recipe.apply_activation_checkpointing`)."""
    try:
        tracer(1, 1, checkpointing=True)
    except UsageError as err:
        if "--activation-checkpointing" not in str(err):
            raise
        return False
    return True


def plan(recipe: Recipe[Any], request: PlanRequest) -> Plan:
    """Trace the configured run and answer the planning questions (see the module docstring)."""
    cfg = recipe.config
    if request.gpus < 1:
        raise UsageError(f"--gpus must be >= 1, got {request.gpus}")
    micro = micro_batch_size(cfg.batch_size, cfg.grad_accumulation, request.gpus)
    tracer = _Tracer(recipe, request.device)
    sharding = FsdpPlanner(recipe, request.fsdp) if request.fsdp is not None and request.gpus > 1 else None

    def total(b: Breakdown, gpus: int = request.gpus) -> int:
        fsdp = sharding is not None and gpus > 1
        extra = overheads(request.device, request.gpu, gpus, b.gradients_bytes, b.uses_convolution, fsdp)
        return (sharding.reserved(b, gpus) if sharding is not None and fsdp else b.peak_reserved_bytes) + extra.total

    main = tracer(micro, cfg.grad_accumulation)
    result = Plan(
        recipe=recipe.name,
        precision=cfg.precision,
        global_batch=cfg.batch_size,
        gpus=request.gpus,
        breakdown=main,
        overheads=overheads(
            request.device, request.gpu, request.gpus, main.gradients_bytes, main.uses_convolution, bool(sharding)
        ),
        total_bytes=total(main),
        fsdp=sharding.memory(main) if sharding is not None else None,
        gpu=request.gpu,
        activation_checkpointing=cfg.activation_checkpointing,
        compiled=cfg.compile,
    )
    if recipe.name == "moco":
        result.notes = moco_plan_notes(cfg, request.gpus, cfg.grad_accumulation, micro)
    if request.gpu is None:
        return result
    capacity = request.gpu.total_bytes
    result.fits = result.total_bytes <= capacity
    result.margin_bytes = capacity - result.total_bytes
    if not request.search:
        return result
    per_gpu_batch = cfg.batch_size // request.gpus

    def total_at(m: int) -> int:
        # below the per-GPU batch the run accumulates: from the 2nd micro-batch on, gradients live beside the
        # activations (and fragment the segments), and micro-batches 3.. repeat the 2nd
        return total(tracer(m, 1 if m == per_gpu_batch else 2))

    configured_fits_whole = bool(result.fits) and micro == per_gpu_batch and cfg.grad_accumulation == 1
    lower = result.min_micro_batch = smallest_micro_batch(tracer)
    result.max_micro_batch = largest_fitting(total_at, capacity, per_gpu_batch, configured_fits_whole, lower)
    if result.max_micro_batch:
        m = result.max_micro_batch
        result.max_micro_batch_total_bytes = total(tracer(m, 1 if m == per_gpu_batch else 2))
        result.suggested_grad_accumulation = smallest_accumulation(per_gpu_batch, result.max_micro_batch)
        result.gpus_needed = next(
            (
                n
                for n in range(1, cfg.batch_size + 1)
                if cfg.batch_size % n == 0 and cfg.batch_size // n <= result.max_micro_batch
            ),
            None,
        )
    result.levers = _levers(recipe, request, tracer, total, result, micro)
    if sharding is None and request.gpus > 1:
        result.levers.append(_fsdp_lever(recipe, request, tracer, result, micro))
    result.traces = len(tracer.cache)
    return result


def smallest_accumulation(per_gpu_batch: int, max_micro_batch: int) -> int:
    """The smallest k that divides the per-GPU batch with a micro-batch per_gpu_batch / k <= max_micro_batch."""
    if max_micro_batch < 1:
        raise ValueError("no micro-batch fits")
    return next(
        k for k in range(1, per_gpu_batch + 1) if per_gpu_batch % k == 0 and per_gpu_batch // k <= max_micro_batch
    )


@dataclass(frozen=True)
class AutoAccumulation:
    """What `--grad-accumulation auto` resolves to."""

    micro_batch: int
    grad_accumulation: int
    predicted_bytes: int  # the predicted total at that micro-batch (reserved peak + workspaces on CUDA)
    capacity_bytes: int
    largest_micro_batch: int  # the largest micro-batch that fits (it may not divide the batch)
    traces: int


def auto_accumulation(recipe: Recipe[Any], device: PlanDevice, capacity: GpuProfile, gpus: int = 1) -> AutoAccumulation:
    """The smallest accumulation whose micro-batch (per-GPU batch / accumulation) fits in `capacity`.

    The recipe's configured `grad_accumulation` is ignored. Each candidate micro-batch is traced as `plan` traces it
    (with accumulation when it is smaller than the per-GPU batch, so gradients live beside the activations), and the
    total adds the allocator-external overheads of `capacity` on CUDA (pass `context_bytes=0` when `capacity` is
    memory that is free after the context exists, as `torch.cuda.mem_get_info` reports it).

    Raises:
        UsageError: the batch does not split over `gpus`, or even micro-batch 1 does not fit (the message names
            the levers).
    """
    cfg = recipe.config
    if gpus < 1 or cfg.batch_size % gpus:
        raise UsageError(f"batch size {cfg.batch_size} does not split over {gpus} process(es)")
    per_gpu_batch = cfg.batch_size // gpus
    tracer = _Tracer(recipe, device)

    def total_at(m: int) -> int:
        b = tracer(m, 1 if m == per_gpu_batch else 2)
        return b.peak_reserved_bytes + overheads(device, capacity, gpus, b.gradients_bytes, b.uses_convolution).total

    lower = smallest_micro_batch(tracer)
    largest = largest_fitting(total_at, capacity.total_bytes, per_gpu_batch, lower=lower)
    if largest == 0:
        levers = "--precision bf16-amp"
        if not cfg.activation_checkpointing and _checkpointing_supported(tracer):
            levers += ", --activation-checkpointing"
        raise UsageError(
            f"--grad-accumulation auto: even micro-batch {lower} needs {total_at(lower) / 2**30:,.2f} GiB but "
            f"{capacity.name} is {capacity.total_bytes / 2**30:,.2f} GiB; try {levers}, more GPUs or a larger device "
            f"(`trainlab plan {recipe.name} --gpu NAME` shows each)"
        )
    k = smallest_accumulation(per_gpu_batch, largest)
    m = per_gpu_batch // k
    return AutoAccumulation(m, k, total_at(m), capacity.total_bytes, largest, len(tracer.cache))


def largest_fitting(
    total_at: Callable[[int], int], capacity: int, upper: int, known_upper_fits: bool = False, lower: int = 1
) -> int:
    """The largest m in [lower, upper] with total_at(m) <= capacity; 0 when even m = lower does not fit (`lower`: the
    smallest micro-batch the model trains on, 2 with BatchNorm).

    The predicted total grows about linearly with the micro-batch (activations), in steps (allocator segments).
    So instead of bisecting with a trace per step, guess from the straight line through the two traced ends of the
    bracket, then trace the guess and its neighbour, which usually closes the bracket (4 traces in all). A guess
    that leaves more than half of the bracket open makes the next guess the midpoint, so a badly bent curve still
    takes no more traces than bisection. Assumes total_at is non-decreasing in m.
    """
    totals: dict[int, int] = {}

    def at(m: int) -> int:
        if m not in totals:
            totals[m] = total_at(m)
        return totals[m]

    if known_upper_fits or at(upper) <= capacity:
        return upper
    if lower >= upper or at(lower) > capacity:
        return 0
    low, high = lower, upper  # at(low) <= capacity < at(high)
    bisect = False
    while high - low > 1:
        width = high - low
        if bisect:
            guess = (low + high) // 2
        else:
            slope = (at(high) - at(low)) / (high - low)
            guess = low + int((capacity - at(low)) // slope) if slope > 0 else (low + high) // 2
        guess = min(max(guess, low + 1), high - 1)
        if at(guess) <= capacity:
            low = guess
            if guess + 1 < high:
                if at(guess + 1) <= capacity:
                    low = guess + 1
                else:
                    high = guess + 1
        else:
            high = guess
            if guess - 1 > low:
                if at(guess - 1) <= capacity:
                    low = guess - 1
                else:
                    high = guess - 1
        bisect = 2 * (high - low) > width
    return low


BATCHNORM_NEEDS_TWO = "Expected more than 1 value per channel when training"  # torch's BatchNorm on one sample


def smallest_micro_batch(tracer: _Tracer) -> int:
    """1, or 2 where the model holds a BatchNorm that refuses a batch of one in training (one value per channel)."""
    try:
        tracer(1, 2)
    except ValueError as err:
        if BATCHNORM_NEEDS_TWO not in str(err):
            raise
        return 2
    return 1


def _levers(
    recipe: Recipe[Any],
    request: PlanRequest,
    tracer: _Tracer,
    total: Callable[..., int],
    result: Plan,
    micro: int,
) -> list[Lever]:
    assert request.gpu is not None
    capacity = request.gpu.total_bytes
    cfg = recipe.config
    levers: list[Lever] = []
    if cfg.precision == "fp32":
        try:
            b = tracer(micro, cfg.grad_accumulation, "bf16-amp")
            t = total(b)
            levers.append(Lever("bf16", "--precision bf16-amp (fp32 weights, bf16 autocast)", t, t <= capacity))
        except UsageError as err:
            levers.append(Lever("bf16", f"--precision bf16-amp is refused by the recipe: {err}", None, None))
    if cfg.activation_checkpointing:
        pass  # already on: the plan above is traced with it
    else:
        try:
            t = total(tracer(micro, cfg.grad_accumulation, checkpointing=True))
        except UsageError as err:  # the recipe's models cannot recompute (no set_grad_checkpointing)
            if "--activation-checkpointing" not in str(err):
                raise
            description = f"--activation-checkpointing is not implemented by recipe {recipe.name!r}"
            levers.append(Lever("activation checkpointing", description, None, None))
        else:
            description = f"--activation-checkpointing (micro-batch {micro}, about one more forward per step)"
            levers.append(Lever("activation checkpointing", description, t, t <= capacity))
    if result.max_micro_batch and result.suggested_grad_accumulation and result.suggested_grad_accumulation > 1:
        k = result.suggested_grad_accumulation
        m = cfg.batch_size // request.gpus // k
        t = total(tracer(m, k))
        description = f"--grad-accumulation {k} (micro-batch {m}, same global batch)"
        if recipe.name == "moco":
            description += f"; {accumulation_effect(cfg, request.gpus, k)}"
        levers.append(Lever("smaller micro-batch", description, t, t <= capacity))
    if result.gpus_needed and result.gpus_needed > request.gpus:
        n = result.gpus_needed
        t = total(tracer(cfg.batch_size // n, 1), n)
        levers.append(
            Lever("more GPUs", f"--gpus {n} (micro-batch {cfg.batch_size // n}, no accumulation)", t, t <= capacity)
        )
    return levers


def _fsdp_lever(recipe: Recipe[Any], request: PlanRequest, tracer: _Tracer, result: Plan, micro: int) -> Lever:
    """`--fsdp` on the same GPUs: its total at the configured micro-batch and the largest micro-batch it allows."""
    assert request.gpu is not None
    sharding = FsdpPlanner(recipe, FsdpSettings(world=request.gpus))
    capacity = request.gpu.total_bytes
    per_gpu_batch = recipe.config.batch_size // request.gpus

    def total_at(m: int, accumulation: int) -> int:
        b = tracer(m, accumulation)
        extra = overheads(request.device, request.gpu, request.gpus, b.gradients_bytes, b.uses_convolution, True)
        return sharding.reserved(b) + extra.total

    t = total_at(micro, recipe.config.grad_accumulation)
    largest = largest_fitting(
        lambda m: total_at(m, 1 if m == per_gpu_batch else 2), capacity, per_gpu_batch, lower=result.min_micro_batch
    )
    ddp = result.max_micro_batch or 0
    if result.fits:
        gain = f"largest micro-batch {largest} (DDP: {ddp})" if largest > ddp else f"no larger micro-batch ({ddp})"
    else:
        gain = f"DDP does not fit; largest micro-batch {largest}" if largest else "does not fit either"
    description = f"--fsdp (states sharded over {request.gpus} GPUs, micro-batch {micro}): {gain}"
    return Lever("fsdp", description, t, t <= capacity)
