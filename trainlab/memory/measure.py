"""Measure a recipe's real training step on the device present: `trainlab plan RECIPE ... --measure [--steps N]`.

What is timed is the Trainer's own training loop (`engine.loop.Trainer`, built as `trainlab train` builds it: seed,
`recipe.build`, averaged copies, precision, the device, scalers and schedules, `--compile`, the health monitor, the
`StepRunner`), run for `warmup_steps` + `steps` optimizer steps in a throw-away run directory: each step with what
the loop does around it in a training run (the batches drawn through the loader, the skip and NaN checks, health,
the loss kept, progress, metric rows as configured, the FLOP count on the first step, the stop checks). The loop
tells where each epoch's steps start and each step ends (`engine.loop.StepMark`); a step's seconds run from the
previous mark to its end, the device synchronized before each clock is read; s/step is the median of the timed
steps. What happens between epochs and at the end is not run (nothing saved, evaluated, exported or written) and
is in no step. The run's length is the configured one, with epochs added where that is shorter than the measurement.

The batches come from where the run's would:
- the data on this machine: the Trainer's loader (`recipe.build_data`, the step sampler of this process's share of
  `gpus`, the configured workers, pinned memory and collate: `engine.sampler`), epoch after epoch; the time inside
  the loader's `next()` is recorded per step (`data_wait_seconds`);
- the data not on this machine (`recipe.build_data` raises a `UsageError`: a missing root or file; the caller turns
  downloads off): synthetic batches of the real shapes and dtypes, made as the planner's tracer makes its fake ones
  (`recipe.example_batch(micro_batch)`), with the floating tensors filled from a seeded normal draw (an all-zero
  image can take degenerate paths: BatchNorm of a constant) and kept in host memory (pinned on CUDA, as the
  loader's): no data is read, and the measured time is the step's alone (`data_note` says why).

Warm-up steps come first (the first creates the optimizer states, allocates the allocator's segments, picks cuDNN /
inductor kernels, and is the step the loop counts FLOPs on: `engine.throughput`, the count `trainlab train` logs),
unless the caller gives the traced count. Peak memory: on CUDA the allocator's peaks since the training loop began
(`max_memory_allocated`, `max_memory_reserved`); on a CPU the growth of the process's resident set (its high-water
mark minus the resident set when the measurement began), labelled as such.
"""

# Legend: none (batches are dicts of the recipe's tensors; no tensor is named here).

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch

from trainlab.engine.loop import StepMark, Trainer
from trainlab.engine.metrics import MetricsLogger
from trainlab.engine.peak_memory import current_rss_bytes, peak_memory, reset_peak, synchronize
from trainlab.engine.precision import Precision, check_device_support
from trainlab.engine.recipe import Batch, Recipe, TrainParts
from trainlab.engine.run_length import RunLength, run_length
from trainlab.engine.sampler import micro_batch_size, training_loader
from trainlab.engine.signals import StopFlag
from trainlab.engine.throughput import DevicePeak, compute_name, device_peak
from trainlab.errors import UsageError

log = logging.getLogger(__name__)

COUNTED = "counted on the real step (matmul, conv, attention)"
NOT_COUNTED = "not counted (--compile: inductor's kernels bypass the counter)"
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


class _SyntheticData:
    """Stands in for the training data, its sampler and its loader where the data is not on this machine: each epoch
    yields `steps_per_epoch` x `accumulation` micro-batches, cycling through `batches` (read from host memory)."""

    def __init__(self, batches: list[Batch], steps_per_epoch: int, accumulation: int) -> None:
        self._batches, self._count = batches, steps_per_epoch * accumulation

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Every epoch is the same (nothing to set)."""

    def __iter__(self) -> Iterator[Batch]:
        return (self._batches[i % len(self._batches)] for i in range(self._count))


class _StepClock:
    """Times the training loop's optimizer steps at its `StepMark`s: a step's seconds run from the previous mark (the
    previous step's end, or its epoch's start) to its end, the device synchronized before each clock is read; the
    time between an epoch's last step and the next epoch's start (the epoch's end) is in no step. Steps
    `warmup + 1` to `warmup + steps` (1-based) are kept, with their time inside the loader."""

    def __init__(self, device: torch.device, warmup: int, steps: int) -> None:
        self.device, self.warmup, self.steps = device, warmup, steps
        self.seconds: list[float] = []
        self.waited: list[float] = []
        self._last = 0.0
        self._last_waited = 0.0

    def __call__(self, mark: StepMark) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        if not mark.epoch_start and self.warmup < mark.step <= self.warmup + self.steps:
            self.seconds.append(now - self._last)
            self.waited.append(mark.data_wait_seconds - self._last_waited)
        self._last, self._last_waited = now, mark.data_wait_seconds


class _MeasuredRun(Trainer):
    """The Trainer, its loop as `trainlab train` runs it, minus what happens between epochs and at the run's end:
    nothing is saved, evaluated or exported, and nothing is written (`write_outputs=False`). Its data: the recipe's
    through the Trainer's loader of one process's share of `gpus` (or synthetic batches where the data is not on this
    machine); its length: the configured run's, with epochs added where that is shorter than the measurement."""

    def __init__(self, recipe: Recipe[Any], clock: _StepClock, *, gpus: int, dataset_size: int | None) -> None:
        self._gpus, self._needed_steps, self._given_size = gpus, clock.warmup + clock.steps, dataset_size
        self.data, self.data_note = "synthetic", ""
        super().__init__(recipe, write_outputs=False, on_mark=clock)

    def _build_data(self, parts: TrainParts) -> RunLength:
        cfg, recipe = self.config, self.recipe
        try:
            dataset = recipe.build_data(parts, self.device)
        except UsageError as err:
            micro = micro_batch_size(cfg.batch_size, cfg.grad_accumulation, self._gpus)
            self.data_note = f"the data is not on this machine ({str(err).rstrip('.')})"
            size = self._given_size
            steps_per_epoch = -(-SCHEDULE_STEPS // cfg.epochs) if size is None else max(size // cfg.batch_size, 1)
            synthetic = _SyntheticData(
                synthetic_batches(recipe, micro, self.device), steps_per_epoch, cfg.grad_accumulation
            )
            self.train_dataset = self.sampler = self.loader = cast(Any, synthetic)
            self.dataset_size = steps_per_epoch * cfg.batch_size
        else:
            self.train_dataset, self.dataset_size = dataset, len(dataset)  # type: ignore[arg-type]
            self.sampler, self.loader, options = training_loader(
                dataset, cfg, device_type=self.device.type, rank=0, world=self._gpus
            )
            self.data, self.data_note = (
                "loader",
                f"the recipe's data through its training loader ({options.describe()})",
            )
            steps_per_epoch = self.sampler.steps_per_epoch
        needed = self._needed_steps
        epochs = max(cfg.epochs, -(-needed // steps_per_epoch))
        max_steps = -1 if 0 < cfg.max_steps < needed else cfg.max_steps
        self.config = replace(cfg, epochs=epochs, max_steps=max_steps)  # the loop's; the recipe's stays as it is
        return run_length(steps_per_epoch, epochs=epochs, max_steps=max_steps)

    def _end_of_epoch(self, logger: MetricsLogger, stop: StopFlag) -> dict[str, float]:
        return {}  # no checkpoint, no evaluation: outside every timed step

    def save(self, *, is_best: bool = False) -> None:
        """Nothing is saved (the stop after the last timed step saves in a training run)."""

    def _on_fit_end(self) -> None:
        """Nothing is exported."""

    @property
    def counted_flops(self) -> int | None:
        """The FLOPs the loop counted on its first step (None under --compile: not counted)."""
        return self._throughput.flops_per_step


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
    """Run `warmup_steps` then `steps` optimizer steps of `recipe`'s training loop on `device` and time them.

    Args:
        recipe: the recipe with its config (precision, batch size, accumulation, compile, clipping, logging, health
            as configured); run in a throw-away run directory, on `device`, without --max-steps stopping it early.
        device: a device of this machine (`engine.device.resolve_device`).
        steps: timed optimizer steps (>= 1).
        warmup_steps: untimed optimizer steps first (>= 1: the loop counts FLOPs on its first step).
        gpus: processes the global batch is shared by; this process runs one share (no communication measured).
        dataset_size: samples per epoch, for the run's length with synthetic batches (None: `SCHEDULE_STEPS`
            steps); with the data on this machine the length is the Trainer's, from the dataset.
        flops_per_step: one process's FLOPs per optimizer step (the traced count); None: counted on the real step.
        flops_source: where `flops_per_step` comes from (shown with it).

    Raises:
        UsageError: steps or warmup_steps below 1, a batch that does not split, a precision the device lacks.
        KeyboardInterrupt: stopped (Ctrl-C, SIGTERM) before the last timed step.
    """
    if steps < 1:
        raise UsageError(f"--steps {steps}: measure at least 1 optimizer step")
    if warmup_steps < 1:
        raise UsageError(f"--warmup-steps {warmup_steps}: run at least 1 warm-up step (it creates the states)")
    cfg = recipe.config
    precision = Precision.parse(cfg.precision)
    check_device_support(precision, device)
    micro = micro_batch_size(cfg.batch_size, cfg.grad_accumulation, gpus)
    clock = _StepClock(device, warmup_steps, steps)
    reset_peak(device)
    rss_at_start = current_rss_bytes()
    with tempfile.TemporaryDirectory(prefix="trainlab-measure-") as run_dir:
        recipe.config = replace(
            cfg, run_dir=Path(run_dir), device=str(device), resume="auto", overwrite=False, memory_snapshot=""
        )
        try:
            run = _MeasuredRun(recipe, clock, gpus=gpus, dataset_size=dataset_size)
            result = run.fit(stop_at_step=warmup_steps + steps)
        finally:
            recipe.config = cfg
    if len(clock.seconds) < steps:
        raise KeyboardInterrupt(f"--measure stopped at step {result.step} of {warmup_steps + steps}")
    memory = peak_memory(device)
    if device.type != "cuda":
        memory = {
            "peak_memory_bytes": max(memory["peak_memory_bytes"] - rss_at_start, 0),
            "memory_kind": "cpu_peak_rss_growth",
        }
    counted = run.counted_flops
    if flops_per_step is not None:
        flops, source = flops_per_step, flops_source
    else:
        flops, source = (counted, COUNTED) if counted is not None else (0, NOT_COUNTED)
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
        step_seconds=clock.seconds,
        flops_per_step=flops,
        flops_source=source,
        peak=device_peak(device, compute),
        memory=memory,
        data=run.data,
        data_note=run.data_note,
        data_wait_seconds=clock.waited if run.data == "loader" else [],
    )
