"""Measure a recipe's real training step on the device present: `trainlab plan RECIPE ... --measure [--steps N]`.

The set-up is the Trainer's (`engine.assemble.assemble`: seed, `recipe.build`, averaged copies, precision, the
device, one `LossScaler` and `Scheduler` per phase, `--compile`, the health monitor, the `StepRunner`); the batches
come from where the run's would:
- the data on this machine: the Trainer's own loader (`recipe.build_data`, the step sampler of this process's share,
  the configured workers, pinned memory and collate: `engine.sampler`), epoch after epoch, so each timed step holds
  what a `trainlab train` step holds: reading, augmenting and collating its batches (in this process with
  `--num-workers 0`, else waiting for the workers) and the step on them. The time spent in the loader's `next()` is
  recorded per step (`data_wait_seconds`). With the loader around it the step itself is slower than on batches
  held in memory (toy, one CPU thread: 0.86-0.95 ms per step besides the 0.17 ms inside the loader, against
  0.77-0.85 ms; benchmarks/README.md, section 10), so the pipeline's time cannot simply be added from outside;
- the data not on this machine (`recipe.build_data` raises a `UsageError`: a missing root or file; the caller turns
  downloads off): synthetic batches of the real shapes and dtypes, made as the planner's tracer makes its fake ones
  (`recipe.example_batch(micro_batch)`), with the floating tensors filled from a seeded normal draw (an all-zero
  image can take degenerate paths: BatchNorm of a constant) and kept in host memory (pinned on CUDA, as the
  loader's): no data is read, and the measured time is the step's alone (`data_note` says why).

`warmup_steps` optimizer steps run first (the first creates the optimizer states, allocates the allocator's
segments, picks cuDNN / inductor kernels); FLOPs are counted on the last of them (`engine.throughput.count_flops`,
the count `trainlab train` logs) unless the caller gives the traced count. Then `steps` optimizer steps
(accumulation included: `grad_accumulation` micro-batches each) are timed one by one, the device synchronized before
each clock is read; s/step is their median. Peak memory: on CUDA the allocator's peaks since the measurement began
(`max_memory_allocated`, `max_memory_reserved`); on a CPU the growth of the process's resident set (its high-water
mark minus the resident set when the measurement began), labelled as such.
"""

# Legend: none (batches are dicts of the recipe's tensors; no tensor is named here).

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from trainlab.engine.assemble import assemble
from trainlab.engine.data_wait import DataWaitClock
from trainlab.engine.peak_memory import current_rss_bytes, peak_memory, reset_peak, synchronize
from trainlab.engine.precision import Precision, check_device_support
from trainlab.engine.recipe import Batch, Recipe, StepInfo, TrainParts
from trainlab.engine.run_length import RunLength, run_length
from trainlab.engine.sampler import StepBatchSampler, micro_batch_size, training_loader
from trainlab.engine.seeding import set_deterministic
from trainlab.engine.throughput import DevicePeak, compute_name, count_flops, device_peak
from trainlab.errors import UsageError

log = logging.getLogger(__name__)

COUNTED = "counted on the real step (matmul, conv, attention)"
SCHEDULE_STEPS = 1_000_000  # the schedule's horizon when the dataset size is not given (as the planner's trace)


@dataclass
class Measurement:
    """What `measure_step` measured (one process; the per-process share of the global batch).

    Attributes:
        device: the device the steps ran on (`cpu`, `cuda:0`).
        precision: the precision mode.
        compute: the matrix products' dtype (`engine.throughput.compute_name`).
        global_batch, micro_batch, grad_accumulation, gpus: the run measured: global batch = gpus x accumulation x
            micro-batch; one process runs its share.
        warmup_steps, steps: optimizer steps run before the timed ones, and timed.
        step_seconds: each timed step's seconds, in order.
        flops_per_step: one process's FLOPs per optimizer step; flops_source says where it comes from.
        peak: the device's dense peak for `compute` (None on a CPU or an unknown GPU).
        memory: peak memory (see the module docstring); memory_kind names what it is.
        data: where the batches came from: "loader" (the recipe's data through the Trainer's loader) or "synthetic".
        data_note: the loader's description, or why the batches are synthetic.
        data_wait_seconds: each timed step's seconds inside the loader's `next()` (empty for synthetic batches).
    """

    device: str
    precision: str
    compute: str
    global_batch: int
    micro_batch: int
    grad_accumulation: int
    gpus: int
    warmup_steps: int
    steps: int
    step_seconds: list[float]
    flops_per_step: int
    flops_source: str
    peak: DevicePeak
    memory: dict[str, Any] = field(default_factory=dict)
    data: str = "synthetic"
    data_note: str = ""
    data_wait_seconds: list[float] = field(default_factory=list)

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def samples_per_second(self) -> float:
        """Global samples per second: the global batch over the median s/step (the processes run in parallel)."""
        return self.global_batch / self.median_step_seconds

    @property
    def achieved_tflops(self) -> float:
        """One device's achieved TFLOP/s: its FLOPs per step over the median s/step."""
        return self.flops_per_step / self.median_step_seconds / 1e12

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation against the device's peak (None where the peak is unknown)."""
        if self.peak.flops is None:
            return None
        return self.flops_per_step / self.median_step_seconds / self.peak.flops


def synthetic_batches(recipe: Recipe[Any], micro_batch: int, device: torch.device, count: int = 2) -> list[Batch]:
    """`count` host batches of the recipe's shapes and dtypes (`recipe.example_batch`): floating tensors drawn from a
    normal distribution (seeded), integer ones (labels, token ids) left at 0; pinned for a CUDA device."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        batch = recipe.example_batch(micro_batch)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value = torch.randn(value.shape, generator=generator, dtype=value.dtype)
            if isinstance(value, torch.Tensor) and device.type == "cuda":
                value = value.pin_memory()
            batch[key] = value
        batches.append(batch)
    return batches


def _cycle(batches: list[Batch]) -> Iterator[Batch]:
    while True:
        yield from batches


@dataclass
class _Batches:
    """The batches the measured steps draw: the recipe's loader (when its data is on this machine) or synthetic ones;
    filled in by `length_of` while the run is assembled (the data is built where the Trainer builds it)."""

    recipe: Recipe[Any]
    micro: int
    gpus: int
    device: torch.device
    length: RunLength
    iterator: Iterator[Batch] | None = None
    data: str = "synthetic"
    note: str = ""

    def length_of(self, parts: TrainParts) -> RunLength:
        cfg = self.recipe.config
        try:
            dataset = self.recipe.build_data(parts, self.device)
        except UsageError as err:
            self.note = f"the data is not on this machine ({str(err).rstrip('.')})"
            self.iterator = _cycle(synthetic_batches(self.recipe, self.micro, self.device))
            return self.length
        sampler, loader, options = training_loader(dataset, cfg, device_type=self.device.type, rank=0, world=self.gpus)
        self.data, self.note = "loader", f"the recipe's data through its training loader ({options.describe()})"
        self.iterator = _epochs(loader, dataset, sampler)
        return run_length(sampler.steps_per_epoch, epochs=cfg.epochs, max_steps=cfg.max_steps)


def _epochs(loader: Any, dataset: Any, sampler: StepBatchSampler) -> Iterator[Batch]:
    """The loader's batches epoch after epoch, each epoch set on the sampler and the dataset as the Trainer sets it."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        set_epoch = getattr(dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        yield from loader
        epoch += 1


def measure_step(
    recipe: Recipe[Any],
    device: torch.device,
    *,
    steps: int,
    warmup_steps: int = 3,
    gpus: int = 1,
    dataset_size: int | None = None,
    flops_per_step: int | None = None,
    flops_source: str = "",
) -> Measurement:
    """Run `warmup_steps` then `steps` real optimizer steps of `recipe` on `device` and time them.

    Args:
        recipe: the recipe with its config (precision, batch size, accumulation, compile, clipping as configured).
        device: a device of this machine (`engine.device.resolve_device`).
        steps: timed optimizer steps (>= 1).
        warmup_steps: untimed optimizer steps first (>= 1: FLOPs are counted on the last).
        gpus: processes the global batch is shared by; this process runs one share (no communication measured).
        dataset_size: samples per epoch, for the schedule's horizon with synthetic batches (None: `SCHEDULE_STEPS`);
            with the data on this machine the schedule is the Trainer's, from the dataset.
        flops_per_step: one process's FLOPs per optimizer step (the traced count); None: counted on the real step.
        flops_source: where `flops_per_step` comes from (shown with it).

    Raises:
        UsageError: steps or warmup_steps below 1, a batch that does not split, a precision the device lacks.
    """
    if steps < 1:
        raise UsageError(f"--steps {steps}: measure at least 1 optimizer step")
    if warmup_steps < 1:
        raise UsageError(f"--warmup-steps {warmup_steps}: run at least 1 warm-up step (it creates the states)")
    cfg = recipe.config
    precision = Precision.parse(cfg.precision)
    check_device_support(precision, device)
    micro = micro_batch_size(cfg.batch_size, cfg.grad_accumulation, gpus)
    length = _length(cfg.epochs, cfg.max_steps, cfg.batch_size, dataset_size)
    set_deterministic(cfg.deterministic)
    reset_peak(device)
    rss_at_start = current_rss_bytes()
    with precision.default_dtype():
        source = _Batches(recipe, micro, gpus, device, length)
        run = assemble(
            recipe,
            device=device,
            precision=precision,
            length_of=source.length_of,
            compile_models=cfg.compile,
            health_every=cfg.health_every,
        )
        length = run.length
        for model in run.parts.models.values():
            model.train()
        assert source.iterator is not None
        batches = DataWaitClock(source.iterator)
        counted: int | None = None
        seconds: list[float] = []
        waited: list[float] = []
        for step in range(warmup_steps + steps):
            info = StepInfo(
                step=step,
                total_steps=length.total_steps,
                steps_per_epoch=length.steps_per_epoch,
                epoch=step // length.steps_per_epoch,
                log_now=False,
                num_micro_steps=cfg.grad_accumulation,
            )
            synchronize(device)
            began, waited_before = time.perf_counter(), batches.waited
            if step == warmup_steps - 1 and flops_per_step is None:
                _, counted = count_flops(lambda: run.runner.run(batches, info))  # noqa: B023 - called at once
            else:
                run.runner.run(batches, info)
            synchronize(device)
            if step >= warmup_steps:
                seconds.append(time.perf_counter() - began)
                waited.append(batches.waited - waited_before)
        memory = peak_memory(device)
    if device.type != "cuda":
        memory = {
            "peak_memory_bytes": max(memory["peak_memory_bytes"] - rss_at_start, 0),
            "memory_kind": "cpu_peak_rss_growth",
        }
    flops = flops_per_step if flops_per_step is not None else counted
    assert flops is not None
    compute = compute_name(precision)
    return Measurement(
        device=str(device),
        precision=precision.name,
        compute=compute,
        global_batch=cfg.batch_size,
        micro_batch=micro,
        grad_accumulation=cfg.grad_accumulation,
        gpus=gpus,
        warmup_steps=warmup_steps,
        steps=steps,
        step_seconds=seconds,
        flops_per_step=flops,
        flops_source=flops_source if flops_per_step is not None else COUNTED,
        peak=device_peak(device, compute),
        memory=memory,
        data=source.data,
        data_note=source.note,
        data_wait_seconds=waited if source.data == "loader" else [],
    )


def _length(epochs: int, max_steps: int, batch_size: int, dataset_size: int | None) -> RunLength:
    """The run's length as the Trainer derives it from the dataset size (or the planner's long run without one)."""
    if dataset_size is None:
        return run_length(-(-SCHEDULE_STEPS // epochs), epochs=epochs, max_steps=max_steps)
    return run_length(max(dataset_size // batch_size, 1), epochs=epochs, max_steps=max_steps)
