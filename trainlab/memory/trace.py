"""Trace a recipe's real training step on fake tensors: the engine's own `StepRunner`, no data, no real memory.

The set-up is the Trainer's own (`engine.assemble.assemble`: seed, `recipe.build`, averaged copies, precision cast,
frozen and averaged models in eval mode, one `LossScaler` and `Scheduler` per phase, the `StepRunner`), with this
module's hooks: models placed on fake CPU tensors in place, their storages labelled, optimizers hooked, the recipe
wrapped to mark regions. Then `StepRunner.run` runs, so forward, loss, backward, unscale, clip, optimizer step,
scaler update, the recipe's `after_optimizer_step` and the averaged copies' update are the training code, not a
model of it. Batches come from `recipe.example_batch(micro_batch)`. The recipe is built inside
`user_files.shapes_only`: frozen models need no weights file (a given one is read for its shapes only).

The run's length: no data is read, so the planner assumes a long run of about `PLANNED_TOTAL_STEPS` optimizer steps
over the config's epochs, stopped by `--max-steps` when that is set (`engine.run_length`: the same definition as the
Trainer's). Traced optimizer steps: the first (it creates the optimizer states) and the last two before the run
stops, so phases that start late (a GAN's discriminator) and progressive schedules are at their largest; the
steady-state window is everything after the first traced step. With `repeat_last_step` the last traced step is a copy
of the one before it (`memory.step_repeat`), where the trace has the shape for one.

For `device="cuda"` the step is still traced on fake CPU tensors: autograd on fake CUDA tensors needs a real CUDA
context (reference B.3), and fake parameters cannot be moved between devices. What differs on CUDA is substituted:
512-byte block rounding and the allocator's segments (`memory.allocator`), foreach optimizer temporaries
(optimizers left on their default implementation switch to foreach, as torch does on CUDA; a recipe that picks
fused AdamW on CUDA is traced as foreach, which over-counts its temporaries), and CUDA autocast's fp32 /
fp32-dtype cast policy where it differs from CPU's (`memory.cuda_autocast`: layer_norm, group_norm, softmax,
log_softmax, sum, exp, pow, ... in fp32). The SDPA backend's saved tensors are still CPU's.
"""

# Shape legend: B micro-batch.

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from trainlab.engine.assemble import AssemblyHooks, assemble
from trainlab.engine.precision import LossScaler, Precision
from trainlab.engine.recipe import Batch, Recipe, StepInfo, TrainParts
from trainlab.engine.run_length import RunLength, run_length
from trainlab.memory.cuda_autocast import CudaAutocastPolicy
from trainlab.memory.flop_counter import FlopCounter, StepFlops
from trainlab.memory.step_repeat import repeat_last_step
from trainlab.memory.tracer import Region, StorageTracer, Trace, tracing
from trainlab.user_files import shapes_only

if TYPE_CHECKING:
    from trainlab.memory.fsdp_memory import FsdpLayout

log = logging.getLogger(__name__)

PlanDevice = Literal["cpu", "cuda"]

PLANNED_TOTAL_STEPS = 1_000_000  # no dataset is read, so the run length is unknown: plan the end of a long run


@dataclass
class TracedRun:
    """A trace plus the static facts a breakdown needs."""

    trace: Trace
    device: PlanDevice
    micro_batch: int
    grad_accumulation: int
    parameters_bytes: int
    trainable_parameters: int
    parameters: int
    frozen_bytes: int
    uses_convolution: bool
    optimizers: list[str]
    flops: StepFlops | None = None  # the last traced optimizer step's (with `count_flops`)
    layout: FsdpLayout | None = None  # the traced build's FSDP shard units (with `layout`)


class _Stopped(Exception):
    """The traced run has gone as far as `first_forward` wants."""


class _RegionRecipe(Recipe[Any]):
    """Delegates to the real recipe and tells the tracer which part of the step is running."""

    def __init__(self, inner: Recipe[Any], tracer: StorageTracer, forward_only: bool = False) -> None:
        # no super().__init__: a pure proxy
        self.inner, self.tracer, self.forward_only = inner, tracer, forward_only
        self.config = inner.config
        self.name = inner.name

    def build(self, device: torch.device) -> Any:
        raise NotImplementedError("the proxy only runs steps")

    def build_data(self, parts: Any, device: torch.device) -> Any:
        raise NotImplementedError("the proxy only runs steps")

    def example_batch(self, batch_size: int) -> Batch:
        return self.inner.example_batch(batch_size)

    def debug_config(self) -> Any:
        return self.inner.debug_config()

    def phase_active(self, phase: str, step: int) -> bool:
        return self.inner.phase_active(phase, step)

    def has_first_pass(self, phase: str, info: StepInfo) -> bool:
        return self.inner.has_first_pass(phase, info)

    def first_pass(
        self, models: Mapping[str, nn.Module], micro_batches: Iterable[Batch], phase: str, info: StepInfo
    ) -> None:
        self.tracer.region = "forward"  # what it keeps (MoCo's keys) lives through the step's forwards
        self.tracer.trace.first_pass = True
        self.inner.first_pass(models, micro_batches, phase, info)

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        self.tracer.region = "forward"
        out = self.inner.train_step(models, batch, phase, info)
        if self.forward_only:
            raise _Stopped
        self.tracer.region = "backward"
        return out

    def after_optimizer_step(self, models: Mapping[str, nn.Module], phase: str, info: StepInfo) -> dict[str, float]:
        self.tracer.region = "after_step"
        self.tracer.in_recipe_hook = True
        try:
            return self.inner.after_optimizer_step(models, phase, info)
        finally:
            self.tracer.in_recipe_hook = False


def traced_step_indices(stop_step: int) -> list[int]:
    """The first optimizer step, then the last two before `stop_step` (or every step of a run shorter than three)."""
    if stop_step <= 3:
        return list(range(max(stop_step, 2)))
    return [0, stop_step - 2, stop_step - 1]


def planned_length(epochs: int, max_steps: int) -> RunLength:
    """The length the planner assumes: about `PLANNED_TOTAL_STEPS` steps over `epochs`, stopped at `max_steps`."""
    return run_length(-(-PLANNED_TOTAL_STEPS // epochs), epochs=epochs, max_steps=max_steps)


def _batches(recipe: Recipe[Any], tracer: StorageTracer, micro_batch: int) -> Iterator[Batch]:
    while True:
        previous: Region = tracer.region
        tracer.region = "batch"
        tracer.trace.micro_step_starts.append(len(tracer.trace.events))
        batch = recipe.example_batch(micro_batch)
        tracer.region = previous
        yield batch


def _use_foreach(optimizer: torch.optim.Optimizer) -> None:
    """torch's CUDA default: the foreach implementation where the recipe chose neither fused nor foreach."""
    for group in optimizer.param_groups:
        if "foreach" in group and group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True


def first_forward(recipe: Recipe[Any], *, device: PlanDevice, micro_batch: int, grad_accumulation: int) -> None:
    """Set up the traced run and run its first micro-batch's forward only (the recipe's first pass included), for
    what that raises at this micro-batch (BatchNorm refuses one value per channel) at a fraction of a trace's cost."""
    try:
        _traced_run(recipe, device, micro_batch, grad_accumulation, None, None, False, stop="forward")
    except _Stopped:
        return


def trace_training(
    recipe: Recipe[Any],
    *,
    device: PlanDevice,
    micro_batch: int,
    grad_accumulation: int,
    length: RunLength | None = None,
    cuda_autocast: bool | None = None,
    count_flops: bool = False,
    repeat_last_step: bool = False,
    layout: bool = False,
) -> TracedRun:
    """Run the recipe's training step on fake tensors and record every storage allocation and free.

    Args:
        recipe: a recipe with its config (the config's precision, clipping and loss scale apply).
        device: "cpu" (the run as it executes on this CPU) or "cuda" (see the module docstring).
        micro_batch: samples per micro-batch on one process.
        grad_accumulation: micro-batches per optimizer step.
        length: the run's length (default: `planned_length` of the config's epochs and --max-steps).
        cuda_autocast: substitute CUDA autocast's cast policy (default: when `device` is "cuda").
        count_flops: also count the FLOPs and bytes of the last traced optimizer step (`memory.flop_counter`).
        repeat_last_step: the last traced step copied from the one before it where the trace has the shape for it
            (`memory.step_repeat`: a third less tracing; unchecked, see there), else traced; not with `count_flops`.
        layout: also give the built models' FSDP shard units (`fsdp_memory.parts_layout`: what `recipe_layout`
            builds the recipe for), in `TracedRun.layout`.

    Returns:
        The trace, with parameters, gradients, optimizer states, frozen models and averaged copies labelled.
    """
    if repeat_last_step and count_flops:
        raise ValueError("a repeated step has no FLOP count: repeat_last_step excludes count_flops")
    return _traced_run(
        recipe,
        device,
        micro_batch,
        grad_accumulation,
        length,
        cuda_autocast,
        count_flops,
        repeat=repeat_last_step,
        layout=layout,
    )


def _traced_run(
    recipe: Recipe[Any],
    device: PlanDevice,
    micro_batch: int,
    grad_accumulation: int,
    length: RunLength | None,
    cuda_autocast: bool | None,
    count_flops: bool,
    stop: Literal["forward"] | None = None,
    repeat: bool = False,
    layout: bool = False,
) -> TracedRun:
    cfg = recipe.config
    precision = Precision.parse(cfg.precision)
    planned = length or planned_length(cfg.epochs, cfg.max_steps)
    tracer = StorageTracer()
    cpu = torch.device("cpu")
    use_cuda_policy = device == "cuda" if cuda_autocast is None else cuda_autocast
    use_cuda_policy = use_cuda_policy and precision.autocast_dtype is not None  # no autocast: the policy is idle

    def place(model: nn.Module, applied: Precision | None) -> nn.Module:
        _prepare_in_place(model, applied, cfg.keep_batchnorm_fp32)
        return model

    def after_build(parts: TrainParts, averaged: dict[str, nn.Module]) -> None:
        for model in parts.models.values():
            model.train()
        if device == "cuda":
            for phase in parts.phases:
                _use_foreach(phase.optimizer)
        _label_model_states(tracer, parts.models, parts.frozen, averaged)
        for phase in parts.phases:
            _hook_optimizer(tracer, phase.optimizer)

    hooks = AssemblyHooks(
        place=place,
        after_build=after_build,
        step_recipe=lambda r: _RegionRecipe(r, tracer, forward_only=stop == "forward"),
    )
    counter = FlopCounter(tracer) if count_flops else None
    with (
        shapes_only(),
        tracing(tracer),
        torch.random.fork_rng(devices=[]),
        CudaAutocastPolicy(enabled=use_cuda_policy),
        precision.default_dtype(),
    ):
        run = assemble(recipe, device=cpu, precision=precision, length_of=lambda parts: planned, hooks=hooks)
        parts, runner = run.parts, run.runner
        shard_layout = _parts_layout(parts, precision) if layout else None
        for scaler in runner.scalers.values():
            _mark_micro_steps_end(tracer, scaler)
        batches = _batches(recipe, tracer, micro_batch)
        steps = traced_step_indices(planned.stop_step)
        repeated: Trace | None = None
        for position, step in enumerate(steps):
            if repeat and position == 2 and len(steps) == 3:
                repeated = repeat_last_step(tracer.trace)
                if repeated is not None:
                    break
            tracer.step = position
            tracer.region = "batch"
            tracer.mark_step_start()
            info = StepInfo(
                step=step,
                total_steps=planned.total_steps,
                steps_per_epoch=planned.steps_per_epoch,
                epoch=step // planned.steps_per_epoch,
                log_now=True,
                num_micro_steps=grad_accumulation,
            )
            last = position == len(steps) - 1  # only the last step is counted (op by op, a third of a trace)
            with counter if counter is not None and last else contextlib.nullcontext():
                runner.run(batches, info)
        tracer.mark_end()
        tracer.region = "after_step"
        trained = [p for m in parts.models.values() for p in m.parameters()]
        frozen_bytes = sum(_state_bytes(m) for m in parts.frozen.values())
        traced = TracedRun(
            trace=tracer.trace,
            device=device,
            micro_batch=micro_batch,
            grad_accumulation=grad_accumulation,
            parameters_bytes=sum(p.numel() * p.element_size() for p in trained),
            trainable_parameters=sum(p.numel() for p in trained if p.requires_grad),
            parameters=sum(p.numel() for p in trained),
            frozen_bytes=frozen_bytes,
            uses_convolution=tracer.uses_convolution,
            optimizers=[type(p.optimizer).__name__.lower() for p in parts.phases],
            flops=None if counter is None else counter.step_flops(len(steps) - 1, micro_batch * grad_accumulation),
            layout=shard_layout,
        )
        del run, runner, parts, batches
    traced.trace.events = traced.trace.events[: traced.trace.end]
    if repeated is not None:
        traced.trace = repeated
    return traced


def _parts_layout(parts: TrainParts, precision: Precision) -> FsdpLayout:
    from trainlab.memory.fsdp_memory import parts_layout  # it imports the breakdown, which imports this module

    return parts_layout(parts, precision)


def _mark_micro_steps_end(tracer: StorageTracer, scaler: LossScaler) -> None:
    """Mark where a step's micro-batches end: the step runner unscales the gradients right after the last one."""
    unscale = scaler.unscale_

    def marked(optimizer: torch.optim.Optimizer) -> None:
        tracer.trace.micro_steps_ends.append(len(tracer.trace.events))
        unscale(optimizer)

    scaler.unscale_ = marked  # type: ignore[method-assign]


def _prepare_in_place(model: nn.Module, precision: Precision | None, keep_batchnorm_fp32: bool) -> None:
    """`Precision.prepare_model` and `.to(cpu)` by assigning `.data`: fake parameters cannot be swapped by
    `Module.to` while the optimizer holds them (the real Trainer's `.to` keeps the same Parameter objects too)."""
    dtype = precision.param_dtype if precision is not None and precision.casts_weights else None
    low = precision is not None and precision.is_pure_low_precision
    for module in model.modules():
        keep = keep_batchnorm_fp32 and low and isinstance(module, nn.modules.batchnorm._BatchNorm)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            target = dtype if (dtype is not None and tensor.is_floating_point() and not keep) else tensor.dtype
            if tensor.device.type != "cpu" or tensor.dtype != target:
                with torch.no_grad():
                    tensor.data = tensor.data.to("cpu", target)


def _state_bytes(model: nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _label_model_states(
    tracer: StorageTracer,
    models: Mapping[str, nn.Module],
    frozen: Mapping[str, nn.Module],
    averaged: Mapping[str, nn.Module],
) -> None:
    for model in models.values():
        for p in model.parameters():
            tracer.label(p, "parameter")
        for b in model.buffers():
            tracer.label(b, "buffer")
    for model in frozen.values():
        for t in [*model.parameters(), *model.buffers()]:
            tracer.label(t, "frozen")
    for model in averaged.values():  # updated once per step, like a momentum encoder: recipe state
        for t in [*model.parameters(), *model.buffers()]:
            tracer.label(t, "recipe_state")


def _hook_optimizer(tracer: StorageTracer, optimizer: torch.optim.Optimizer) -> None:
    """Label gradients when the optimizer starts its step and its states when it ends."""

    def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    tracer.label(p.grad, "gradient")
        tracer.region = "optimizer"

    def after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    tracer.label(value, "optimizer_state")
        tracer.region = "after_step"

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
