"""The planner: trace the configured run, add what lives outside the allocator, and answer the planning questions.

`plan(recipe, PlanRequest(...))` returns a `Plan`: the breakdown of the configured micro-batch, the total against the
GPU, the largest micro-batch that fits (a search over traced micro-batches), the `--grad-accumulation` that keeps
the global batch, the GPUs the global batch needs, and levers with their predicted totals.
`auto_accumulation(recipe, device, capacity)` answers only the accumulation question, for
`trainlab train --grad-accumulation auto`.

Time and cost: the configured step's FLOPs are counted in its trace; with a GPU, `run_cost` turns them into step
time, run time, GPU-hours and cost; `request.candidates` (`--gpu all`) adds one row per GPU x count that fits.
Per-GPU memory is `overheads` + the traced reserved peak (`_totals`): a sharded mode (FSDP) would divide the
parameter, gradient and optimizer-state bytes of the trace by its sharding factor there.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainlab.engine.recipe import Recipe
from trainlab.engine.sampler import micro_batch_size
from trainlab.errors import UsageError, first_line
from trainlab.memory.accumulation_fit import first_micro_batch_only, second_micro_batches_repeat_first
from trainlab.memory.batch_fit import FittedRun, affine_through, fit_micro_batch, fit_quadratic
from trainlab.memory.breakdown import Breakdown, breakdown
from trainlab.memory.flop_counter import StepFlops
from trainlab.memory.flops import compute_name
from trainlab.memory.fsdp_memory import FsdpLayout, FsdpMemory, FsdpPlanner, FsdpSettings, recipe_layout
from trainlab.memory.gpus import GpuProfile
from trainlab.memory.log_once import each_message_once
from trainlab.memory.run_cost import DataRate, RunCost, known_dataset_size, run_cost, stored_data_rate
from trainlab.memory.trace import PlanDevice, TracedRun, first_forward
from trainlab.memory.trace_workers import TraceJob, TraceWorkers, fork_runs_autograd, trace_job

log = logging.getLogger(__name__)

SAFETY_MARGIN = 0.0  # a plan "fits" when the predicted total is at most the GPU's memory; the margin is printed


@dataclass(frozen=True)
class PlanRequest:
    device: PlanDevice
    gpu: GpuProfile | None = None
    gpus: int = 1
    search: bool = True  # search the largest micro-batch and levers (needs --gpu)
    fsdp: FsdpSettings | None = None  # --fsdp: parameters, gradients and optimizer states sharded over the GPUs
    candidates: tuple[GpuProfile, ...] = ()  # `--gpu all` or a list: the table of GPUs x counts that fit
    counts: tuple[int, ...] = (1, 2, 4, 8)  # GPU counts of the table
    prices: dict[str, float] = field(default_factory=dict)  # --price NAME=USD_PER_HOUR
    dataset_size: int | None = None  # training samples (None: unknown, no run time)
    # processes tracing the configurations known ahead at once (`memory.trace_workers`; a script calling `plan` with
    # workers > 1 needs the `if __name__ == "__main__":` guard of any multiprocessing program)
    workers: int = 1
    # ... from a fork server (where they cannot be forked) only when the first forward took this long (a trace is
    # ~5-10 x that); forked workers start before it, whatever it takes
    workers_from_seconds: float = 0.0


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
    min_micro_batch: int | None = None  # where even it does not fit: the smallest micro-batch the model trains on
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
    flops: StepFlops | None = None  # one process's optimizer step of the configured run
    family: str = ""  # the efficiency family (`Recipe.model_family`)
    compute: str = ""  # the compute dtype of the matrix products (`flops.compute_name`)
    dataset_size: int | None = None
    data_rate: DataRate | None = None
    cost: RunCost | None = None  # with --gpu: the configured run, or the suggested accumulation where it does not fit
    candidates: list[Candidate] = field(default_factory=list)
    epochs: int = 1
    max_steps: int = -1


@dataclass
class Candidate:
    """One row of the `--gpu all` table: a GPU and count that fits, at its largest micro-batch."""

    gpu: GpuProfile
    gpus: int
    micro_batch: int
    grad_accumulation: int
    total_bytes: int
    margin_bytes: int
    cost: RunCost | None  # None: no peak known for the compute dtype on that GPU
    cheapest: bool = False
    fastest: bool = False


# What the plan leaves out for fp32 convolutions on CUDA, as measured (benchmarks/README sections 13c and 13f).
CUDNN_FP32_NOTE = (
    "not in these numbers: cuDNN's benchmark mode picks fp32 convolution algorithms with large workspaces inside the "
    "allocator (CIFAR ResNet-18 at micro-batch 128 peaked at 3,707 MiB against the 679 planned, on an H100 and an "
    "H200; 559 MiB against 405 with bf16-amp); --deterministic true turns benchmark mode off"
)


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
    """Breakdowns of the recipe at a micro-batch, accumulation and precision: traced, or (for the configured precision
    and checkpointing, micro-batches from `FIT_FROM` on) read from the affine fit of `memory.batch_fit`, which is
    traced once per accumulation at `FIT_POINTS` and checked against a third trace before it is used: one already
    traced at that accumulation where there is one (the smallest micro-batch's, when it agrees), else `FIT_CHECK`.
    The fit at accumulation 1 first tries the fit points already traced at accumulation 2, cut to their first
    micro-batch (`memory.accumulation_fit`), checked against a real trace at accumulation 1; that check also stands
    for the fit at accumulation 2 where the second micro-batches repeat the first ones, so with the configured run
    traced at accumulation 1 (the plan's first trace) both fits cost two traces. Where the affine fit fails, a fit of
    degree 2 through its two points and its check (MoCo's B x B logits) is checked against one more trace
    (`QUADRATIC_CHECKS`); where that fails too, every micro-batch is traced."""

    FIT_POINTS = (4, 8)
    FIT_CHECK = 6
    QUADRATIC_CHECKS = (12, 16)  # the check of a fit of degree 2 (the first not among its points)
    FIT_FROM = 2

    def __init__(self, recipe: Recipe[Any], device: PlanDevice) -> None:
        self.recipe, self.device = recipe, device
        self.cache: dict[tuple[int, int, str, bool], Breakdown] = {}
        self.runs: dict[tuple[int, int], TracedRun] = {}  # traces of the configured precision and checkpointing
        self.fits: dict[int, FittedRun | None] = {}  # accumulation -> fit (None: it does not hold)
        self.flops: dict[tuple[int, int], StepFlops] = {}
        self.traced = 0
        self.smallest: int | None = None  # `smallest_micro_batch`'s answer
        self.workers: TraceWorkers | None = None  # traces started ahead (`start_workers`)
        # the fit's points at accumulation 2 are traced with their last step copied (`memory.step_repeat`), used only
        # once a fit through them holds (checked against real traces), else traced again in full
        self.copies = recipe.last_step_repeats_previous
        self.copied: set[tuple[int, int]] = set()  # held runs whose last step is a copy
        self._layout: FsdpLayout | None = None

    def __call__(
        self,
        micro_batch: int,
        accumulation: int,
        precision: str | None = None,
        checkpointing: bool | None = None,
        count_flops: bool = False,
    ) -> Breakdown:
        cfg = self.recipe.config
        precision = precision or cfg.precision
        checkpointing = cfg.activation_checkpointing if checkpointing is None else checkpointing
        key = (micro_batch, accumulation, precision, checkpointing)
        configured = precision == cfg.precision and checkpointing == cfg.activation_checkpointing
        if count_flops and (micro_batch, accumulation) not in self.flops:
            self.cache.pop(key, None)
        if key in self.cache:
            return self.cache[key]
        if configured and (micro_batch, accumulation) in self.copied:
            self._fit(accumulation)  # checks the copy (or traces the point again in full)
        held = self.runs.get((micro_batch, accumulation)) if configured else None
        if held is not None and (not count_flops or held.flops is not None):
            self.cache[key] = breakdown(held)
            return self.cache[key]
        fit = self._fit(accumulation) if configured and micro_batch >= self.FIT_FROM and not count_flops else None
        if fit is not None:
            self.cache[key] = breakdown(fit(micro_batch))
        else:
            run = self._trace(micro_batch, accumulation, precision, checkpointing, count_flops)
            if configured:
                self.runs[(micro_batch, accumulation)] = run
            self.cache[key] = breakdown(run)
        return self.cache[key]

    def layout(self) -> FsdpLayout:
        """The recipe's FSDP shard units: from the trace started with them (`TraceJob.layout`), else built once
        (`fsdp_memory.recipe_layout`)."""
        started = [] if self.workers is None else self.workers.started()
        job = next((job for job in started if job.layout), None)
        if self._layout is None and job is not None:  # its trace sets `_layout` (`_trace`)
            self(job.micro_batch, job.grad_accumulation, job.precision, job.checkpointing, job.count_flops)
        if self._layout is None:
            self._layout = recipe_layout(self.recipe)
        return self._layout

    def _trace(
        self,
        micro_batch: int,
        accumulation: int,
        precision: str,
        checkpointing: bool,
        count_flops: bool,
        repeat_last_step: bool = False,
    ) -> TracedRun:
        job = TraceJob(micro_batch, accumulation, precision, checkpointing, count_flops, repeat_last_step)
        try:
            if self.workers is not None and self.workers.has(job):  # started ahead
                run = self.workers.take(job)
            else:
                run = trace_job(self.recipe, self.device, job)
        except RuntimeError as err:  # sizes no tensor can have: bad input, not a bug of the tracer
            if "overflow" not in str(err).lower():
                raise
            raise UsageError(
                f"a micro-batch of {micro_batch} needs tensors larger than any device's address space "
                f"({first_line(err)}); plan a smaller --batch-size"
            ) from None
        self.traced += 1
        if run.flops is not None:
            self.flops[(micro_batch, accumulation)] = run.flops
        if run.layout is not None and self._layout is None:
            self._layout = run.layout
        log.debug(
            "traced micro-batch %d x %d (%s%s)",
            micro_batch,
            accumulation,
            precision,
            ", activation checkpointing" if checkpointing else "",
        )
        return run

    def _started(self, job: TraceJob) -> bool:
        return self.workers is not None and self.workers.has(job)

    def start_workers(self, jobs: list[TraceJob], workers: int, forks: bool | None = None) -> None:
        """Trace `jobs` ahead, in `workers` processes (`memory.trace_workers`; `forks` as there); later calls take
        them."""
        self.workers = TraceWorkers(self.recipe, self.device, jobs, workers, forks)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def _configured_run(self, micro_batch: int, accumulation: int) -> TracedRun:
        if (micro_batch, accumulation) not in self.runs:
            cfg = self.recipe.config
            with_flops = TraceJob(micro_batch, accumulation, cfg.precision, cfg.activation_checkpointing, True)
            flops = self._started(with_flops)
            copy = not flops and self.copies and accumulation == 2 and micro_batch in self.FIT_POINTS
            run = self._trace(micro_batch, accumulation, cfg.precision, cfg.activation_checkpointing, flops, copy)
            self.runs[(micro_batch, accumulation)] = run
            if copy:
                self.copied.add((micro_batch, accumulation))
        return self.runs[(micro_batch, accumulation)]

    def _held(self, accumulation: int) -> list[int]:
        """Micro-batches of the configured precision and checkpointing traced (or started) at `accumulation`."""
        cfg = self.recipe.config
        started = [] if self.workers is None else self.workers.started()
        return [m for (m, k) in self.runs if k == accumulation] + [
            job.micro_batch
            for job in started
            if (job.grad_accumulation, job.precision, job.checkpointing)
            == (accumulation, cfg.precision, cfg.activation_checkpointing)
        ]

    def _fit(self, accumulation: int) -> FittedRun | None:
        if accumulation not in self.fits:
            fit = self._fit_once(accumulation)
            copied = [(m, k) for (m, k) in self.copied if k == accumulation]
            if fit is None and copied:  # the copied steps may be what does not hold: the points traced in full
                log.debug(
                    "micro-batch fit at accumulation %d: tracing its points again without copied steps", accumulation
                )
                self.copies = False
                for key in copied:
                    self.copied.discard(key)
                    del self.runs[key]
                    self.cache = {k: b for k, b in self.cache.items() if k[:2] != key}
                fit = self._fit_once(accumulation)
            self.fits[accumulation] = fit
            log.debug("micro-batch fit at accumulation %d: %s", accumulation, "holds" if fit else "does not hold")
        return self.fits[accumulation]

    def _fit_once(self, accumulation: int) -> FittedRun | None:
        fit = self._fit_from_accumulation_2() if accumulation == 1 else None
        if fit is not None:
            log.debug("micro-batch fit at accumulation 1: derived from accumulation 2")
            return fit
        low, high = (self._configured_run(m, accumulation) for m in self.FIT_POINTS)
        fit = self._fit_checked_at_accumulation_1(low, high) if accumulation == 2 else None
        if fit is not None:
            log.debug("micro-batch fit at accumulation 2: checked at accumulation 1")
            return fit
        others = [m for (m, k) in self.runs if k == accumulation and m not in self.FIT_POINTS]
        larger = [m for m in others if m >= self.FIT_FROM]
        if not larger and others:  # a trace below `FIT_FROM` (the smallest micro-batch's) checks it when it can
            fit = fit_micro_batch(low, high, self.runs[(max(others), accumulation)])
        if fit is None:
            check = self._configured_run(max(larger) if larger else self.FIT_CHECK, accumulation)
            fit = fit_micro_batch(low, high, check)
            if fit is None:  # of degree 2 (MoCo's B x B logits), through the three, checked by one more trace
                points = sorted([low, high, check], key=lambda r: r.micro_batch)
                fourth = next(m for m in self.QUADRATIC_CHECKS if m not in {p.micro_batch for p in points})
                fit = fit_quadratic(points, self._configured_run(fourth, accumulation))
        return fit

    def _fit_checked_at_accumulation_1(self, low: TracedRun, high: TracedRun) -> FittedRun | None:
        """The fit at accumulation 2 through `low` and `high` without a third trace: where their first micro-batches
        give the fit at accumulation 1 that a trace already held at accumulation 1 confirms (that fit is kept), and
        each step's second micro-batch allocates what its first one did (`memory.accumulation_fit`). None otherwise."""
        held = [m for m in self._held(1) if m >= self.FIT_FROM and m not in self.FIT_POINTS]
        if not held or (1 in self.fits and self.fits[1] is None) or not second_micro_batches_repeat_first(low, high):
            return None
        derived = [first_micro_batch_only(r) for r in (low, high)]
        if derived[0] is None or derived[1] is None:
            return None
        at_1 = fit_micro_batch(derived[0], derived[1], self._configured_run(max(held), 1))
        if at_1 is None:
            return None
        self.fits.setdefault(1, at_1)
        return affine_through(low, high)

    def _fit_from_accumulation_2(self) -> FittedRun | None:
        """The fit at accumulation 1 through the fit points already traced at accumulation 2, each cut to its first
        micro-batch (`memory.accumulation_fit`), checked against a real trace at accumulation 1: the configured one
        where there is one, else one at `FIT_CHECK` (which the fallback then uses as its check). None where the
        accumulation-2 points are not traced yet or the derived fit does not give the check's bytes."""
        if any(m not in self._held(2) for m in self.FIT_POINTS):
            return None
        derived = [first_micro_batch_only(self._configured_run(m, 2)) for m in self.FIT_POINTS]
        low, high = derived
        if low is None or high is None:
            return None
        larger = [m for m in self._held(1) if m >= self.FIT_FROM and m not in self.FIT_POINTS]
        check = self._configured_run(max(larger) if larger else self.FIT_CHECK, 1)
        return fit_micro_batch(low, high, check)


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
    tracer = _Tracer(recipe, request.device)
    with each_message_once():
        try:
            return _plan(recipe, request, tracer)
        finally:
            tracer.close()


def _known_jobs(cfg: Any, micro: int, searching: bool, copies: bool) -> list[TraceJob]:
    """The configurations a plan with a GPU traces whatever it finds, in the order the plan needs them: the
    configured run (with its FLOPs), the fit's two points (at accumulation 2; the search needs them and the configured
    run), then the levers' runs at the configured micro-batch (activation checkpointing, bf16 for an fp32 run) when
    the plan searches, so that the search runs beside the last trace. The planner's own process waits: with as many
    workers as cores, one more tracing process would only share a core. `copies`: the fit's points are traced with
    their last step copied (`_Tracer.copies`)."""
    precision, checkpointing, accumulation = cfg.precision, cfg.activation_checkpointing, cfg.grad_accumulation
    jobs = [TraceJob(micro, accumulation, precision, checkpointing, count_flops=True)]
    jobs += [
        TraceJob(m, 2, precision, checkpointing, count_flops=False, repeat_last_step=copies)
        for m in _Tracer.FIT_POINTS
        if (m, 2) != (micro, accumulation)
    ]
    if searching and not checkpointing:
        jobs.append(TraceJob(micro, accumulation, precision, True, count_flops=False))
    if searching and precision == "fp32":
        jobs.append(TraceJob(micro, accumulation, "bf16-amp", checkpointing, count_flops=False))
    return jobs


def _plan(recipe: Recipe[Any], request: PlanRequest, tracer: _Tracer) -> Plan:
    cfg = recipe.config
    if request.gpus < 1:
        raise UsageError(f"--gpus must be >= 1, got {request.gpus}")
    micro = micro_batch_size(cfg.batch_size, cfg.grad_accumulation, request.gpus)
    dataset_size = request.dataset_size if request.dataset_size is not None else known_dataset_size(cfg)
    no_batch = None  # the memory is planned all the same; a run of no step has no time or cost
    if dataset_size is not None and dataset_size < cfg.batch_size:
        no_batch = (
            f"the dataset's {dataset_size:,} samples hold no batch of {cfg.batch_size:,}: `trainlab train` refuses "
            "this run (no run time or cost is given); lower --batch-size, or plan with --dataset-size N"
        )
        dataset_size = None
    searching = request.gpu is not None and request.search
    if request.workers > 1 and (searching or request.candidates):
        jobs = _known_jobs(cfg, micro, searching, tracer.copies)
        forks = bool(jobs) and fork_runs_autograd()

        def start_workers() -> None:
            workers = min(request.workers, len(jobs))
            log.info("tracing %d configurations in %d worker processes at once", len(jobs), workers)
            tracer.start_workers(jobs, workers, forks)

        if forks:  # forked workers start in ~0.1 s; the first one logs the recipe's facts and, where the FSDP plan
            # or lever needs them, its shard units: the recipe is not built in this process
            layout = request.gpus > 1 and (request.fsdp is not None or searching)
            jobs[0] = dataclasses.replace(jobs[0], layout=layout, logs_facts=True)
            start_workers()
        else:  # from a fork server (seconds to start) only where a trace takes long enough to gain
            started = time.perf_counter()
            smallest_micro_batch(tracer)
            if jobs and time.perf_counter() - started >= request.workers_from_seconds:
                start_workers()
    sharding = (
        FsdpPlanner(recipe, request.fsdp, tracer.layout()) if request.fsdp is not None and request.gpus > 1 else None
    )

    def total(b: Breakdown, gpus: int = request.gpus) -> int:
        fsdp = sharding is not None and gpus > 1
        extra = overheads(request.device, request.gpu, gpus, b.gradients_bytes, b.uses_convolution, fsdp)
        return (sharding.reserved(b, gpus) if sharding is not None and fsdp else b.peak_reserved_bytes) + extra.total

    main = tracer(micro, cfg.grad_accumulation, count_flops=True)
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
        flops=tracer.flops[(micro, cfg.grad_accumulation)],
        family=recipe.model_family(),
        compute=compute_name(cfg.precision),
        dataset_size=dataset_size,
        data_rate=stored_data_rate(recipe.name),
        epochs=cfg.epochs,
        max_steps=cfg.max_steps,
    )
    result.notes = recipe.plan_notes(request.gpus, cfg.grad_accumulation, micro)
    if no_batch is not None:
        result.notes.append(no_batch)
    if request.device == "cuda" and main.uses_convolution and cfg.precision == "fp32" and not cfg.deterministic:
        result.notes.append(CUDNN_FP32_NOTE)
    if request.candidates:
        result.candidates = _candidates(recipe, request, tracer, result)
    if request.gpu is None:
        result.traces = tracer.traced
        return result
    capacity = request.gpu.total_bytes
    result.fits = result.total_bytes <= capacity
    result.margin_bytes = capacity - result.total_bytes
    if result.fits:
        result.cost = _cost(result, request, request.gpu, request.gpus, micro, cfg.grad_accumulation)
    if not request.search:
        result.traces = tracer.traced
        return result
    per_gpu_batch = cfg.batch_size // request.gpus
    at = _totals(tracer, request.device, request.gpu, request.gpus, sharding)
    result.max_micro_batch = largest_micro_batch(at, capacity, per_gpu_batch, lambda: smallest_micro_batch(tracer))
    if result.max_micro_batch == 0:  # the search found the smallest micro-batch, and even that does not fit
        result.min_micro_batch = smallest_micro_batch(tracer)
    if result.max_micro_batch:
        m = result.max_micro_batch
        result.max_micro_batch_total_bytes = at(m, 1 if m >= per_gpu_batch else 2)
        k = result.suggested_grad_accumulation = smallest_accumulation(per_gpu_batch, min(m, per_gpu_batch))
        if result.cost is None:
            result.cost = _cost(result, request, request.gpu, request.gpus, per_gpu_batch // k, k)
    result.gpus_needed = gpus_needed(tracer, request.device, request.gpu, cfg.batch_size, result.max_micro_batch)
    result.levers = _levers(recipe, request, tracer, total, result, micro)
    if sharding is None and request.gpus > 1:
        result.levers.append(_fsdp_lever(recipe, request, tracer, result, micro))
    result.traces = tracer.traced
    return result


def _totals(
    tracer: _Tracer, device: PlanDevice, gpu: GpuProfile, gpus: int, sharding: FsdpPlanner | None = None
) -> Callable[[int, int], int]:
    """total(micro-batch, accumulation) on `gpus` x `gpu`: the reserved peak (one FSDP rank's with `sharding` over
    several GPUs) plus what lives outside the allocator."""
    fsdp = sharding is not None and gpus > 1

    def at(micro_batch: int, accumulation: int) -> int:
        b = tracer(micro_batch, accumulation)
        peak = sharding.reserved(b, gpus) if sharding is not None and fsdp else b.peak_reserved_bytes
        return peak + overheads(device, gpu, gpus, b.gradients_bytes, b.uses_convolution, fsdp).total

    return at


def largest_micro_batch(
    at: Callable[[int, int], int], capacity: int, per_gpu_batch: int, lower: int | Callable[[], int]
) -> int:
    """The largest micro-batch that fits, not capped at the per-GPU batch: below it the run accumulates (from the
    2nd micro-batch on, gradients live beside the activations, and micro-batches 3.. repeat the 2nd); from it on,
    one micro-batch per step. Above the per-GPU batch the bound doubles until a micro-batch does not fit."""

    def total_at(m: int) -> int:
        return at(m, 1 if m >= per_gpu_batch else 2)

    if total_at(per_gpu_batch) > capacity:
        return largest_fitting(total_at, capacity, per_gpu_batch, lower=lower)
    low, high = per_gpu_batch, 2 * per_gpu_batch
    while total_at(high) <= capacity:
        if high >= MAX_MICRO_BATCH:
            return high
        low, high = high, 2 * high
    return largest_fitting(total_at, capacity, high, lower=low)


MAX_MICRO_BATCH = 1 << 16  # the search's bound above the per-GPU batch
EVERY_MODEL_TRAINS_ON = 2  # micro-batch 1 only where no BatchNorm sees one value per channel


def _candidates(recipe: Recipe[Any], request: PlanRequest, tracer: _Tracer, plan: Plan) -> list[Candidate]:
    """Every GPU of `request.candidates` x count of `request.counts` (dividing the global batch) that fits: the
    largest micro-batch dividing the per-GPU batch that fits, the accumulation that keeps the global batch, time and
    cost.
    Sorted by cost (then run time, step time); the cheapest and the fastest marked."""
    batch = recipe.config.batch_size
    rows: list[Candidate] = []
    for gpu in request.candidates:
        for n in request.counts:
            if batch % n:
                continue
            per_gpu = batch // n
            at = _totals(tracer, request.device, gpu, n)
            k = _smallest_fitting_accumulation(at, gpu.total_bytes, per_gpu, lambda: smallest_micro_batch(tracer))
            if k is None:
                continue
            total = at(per_gpu // k, 1 if k == 1 else 2)
            cost = _cost(plan, request, gpu, n, per_gpu // k, k)
            rows.append(Candidate(gpu, n, per_gpu // k, k, total, gpu.total_bytes - total, cost))

    def order(row: Candidate) -> tuple[float, float, float]:
        c = row.cost
        if c is None:
            return (math.inf, math.inf, math.inf)
        return (
            c.cost_usd if c.cost_usd is not None else math.inf,
            c.run_hours if c.run_hours is not None else math.inf,
            c.step_seconds,
        )

    rows.sort(key=order)
    timed = [r for r in rows if r.cost is not None]
    if timed:
        if timed[0].cost is not None and timed[0].cost.cost_usd is not None:
            timed[0].cheapest = True
        min(timed, key=lambda r: r.cost.step_seconds if r.cost else math.inf).fastest = True
    return rows


def _smallest_fitting_accumulation(
    at: Callable[[int, int], int], capacity: int, per_gpu: int, smallest: Callable[[], int]
) -> int | None:
    """The smallest accumulation k dividing `per_gpu` whose micro-batch per_gpu / k fits (None: not even the smallest
    micro-batch), bisected over those divisors only: every row of the table evaluates micro-batches from the same few,
    so the GPUs and counts share their traces' replays. Micro-batch 1 (traced for real, not fitted; refused by
    BatchNorm where `smallest()` says 2) is tried only where no larger one fits."""
    ks = [k for k in divisors(per_gpu) if per_gpu // k >= EVERY_MODEL_TRAINS_ON]

    def fits(k: int) -> bool:
        return at(per_gpu // k, 1 if k == 1 else 2) <= capacity

    if not ks or not fits(ks[-1]):
        return per_gpu if smallest() == 1 and fits(per_gpu) else None
    high = len(ks) - 1
    low = 0  # ks[high] fits; the totals grow with the micro-batch
    while low < high:
        middle = (low + high) // 2
        if fits(ks[middle]):
            high = middle
        else:
            low = middle + 1
    return ks[high]


def gpus_needed(
    tracer: _Tracer, device: PlanDevice, gpu: GpuProfile, batch: int, max_micro_batch: int | None
) -> int | None:
    """The smallest GPU count n (dividing the global batch) whose per-GPU batch fits without accumulation, with the
    overheads of n processes (NCCL, DDP buckets); None when none up to the batch size does."""
    if not max_micro_batch:
        return None  # the model states alone do not fit: DDP replicates them on every GPU
    counts = [n for n in divisors(batch) if batch // n <= 2 * max_micro_batch]
    for n in counts:
        if _totals(tracer, device, gpu, n)(batch // n, 1) <= gpu.total_bytes:
            return n
    return None


def _cost(
    plan: Plan, request: PlanRequest, gpu: GpuProfile, gpus: int, micro: int, accumulation: int
) -> RunCost | None:
    """Time and cost on `gpus` x `gpu` (None where the GPU has no known peak for the compute dtype)."""
    assert plan.flops is not None
    cfg_samples = plan.breakdown.micro_batch * plan.breakdown.grad_accumulation
    flops = plan.flops.scaled(cfg_samples, micro * accumulation)
    if gpu.peak_flops(plan.compute) is None:
        return None
    return run_cost(
        flops=flops,
        gpu=gpu,
        gpus=gpus,
        micro_batch=micro,
        grad_accumulation=accumulation,
        compute=plan.compute,
        family=plan.family,
        global_batch=plan.global_batch,
        epochs=plan.epochs,
        max_steps=plan.max_steps,
        dataset_size=plan.dataset_size,
        prices=request.prices,
        data_rate=plan.data_rate,
    )


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending, from its prime factors (trial division up to the square root of what is
    left: a batch of 2**40 has 41 divisors, found in microseconds, where scanning 1..n would take hours)."""
    factors: dict[int, int] = {}
    rest, p = n, 2
    while p * p <= rest:
        while rest % p == 0:
            factors[p] = factors.get(p, 0) + 1
            rest //= p
        p += 1 if p == 2 else 2
    if rest > 1:
        factors[rest] = factors.get(rest, 0) + 1
    found = [1]
    for prime, power in factors.items():
        found = [d * prime**e for d in found for e in range(power + 1)]
    return sorted(found)


def smallest_accumulation(per_gpu_batch: int, max_micro_batch: int) -> int:
    """The smallest k that divides the per-GPU batch with a micro-batch per_gpu_batch / k <= max_micro_batch."""
    if max_micro_batch < 1:
        raise ValueError("no micro-batch fits")
    return next(k for k in divisors(per_gpu_batch) if per_gpu_batch // k <= max_micro_batch)


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
    return AutoAccumulation(m, k, total_at(m), capacity.total_bytes, largest, tracer.traced)


def largest_fitting(
    total_at: Callable[[int], int],
    capacity: int,
    upper: int,
    known_upper_fits: bool = False,
    lower: int | Callable[[], int] = 1,
) -> int:
    """The largest m in [lower, upper] with total_at(m) <= capacity; 0 when even m = lower does not fit (`lower`: the
    smallest micro-batch the model trains on, 2 with BatchNorm; or a function that finds it, called only where
    micro-batch 2, which every model trains on, does not fit).

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
    if callable(lower):
        lower = (
            EVERY_MODEL_TRAINS_ON
            if upper > EVERY_MODEL_TRAINS_ON and at(EVERY_MODEL_TRAINS_ON) <= capacity
            else lower()
        )
    if lower >= upper:
        return 0
    # the bracket's low end: lower + 1 where it fits (then lower does too, and the smallest micro-batch, which the
    # planner traces for real, is not traced), else lower
    low, high = lower, upper  # at(low) <= capacity < at(high)
    if lower + 1 < upper and at(lower + 1) <= capacity:
        low = lower + 1
    elif at(lower) > capacity:
        return 0
    elif lower + 1 < upper:
        high = lower + 1
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
    """1, or 2 where the model holds a BatchNorm that refuses a batch of one in training (one value per channel): the
    first forward at micro-batch 1 tells (`trace.first_forward`; a whole trace there is needed only if the search
    goes down to 1)."""
    if tracer.smallest is not None:
        return tracer.smallest
    try:
        first_forward(tracer.recipe, device=tracer.device, micro_batch=1, grad_accumulation=2)
    except ValueError as err:
        if BATCHNORM_NEEDS_TWO not in str(err):
            raise
        tracer.smallest = 2
    else:
        tracer.smallest = 1
    return tracer.smallest


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
        t = total(tracer(m, min(k, 2)))  # micro-batches 3.. repeat the 2nd
        description = f"--grad-accumulation {k} (micro-batch {m}, same global batch)"
        effect = recipe.accumulation_note(request.gpus, k)
        description += f"; {effect}" if effect else ""
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
    sharding = FsdpPlanner(recipe, FsdpSettings(world=request.gpus), tracer.layout())
    at = _totals(tracer, request.device, request.gpu, request.gpus, sharding)
    t = at(micro, recipe.config.grad_accumulation)
    capacity = request.gpu.total_bytes
    per_gpu_batch = recipe.config.batch_size // request.gpus
    largest = largest_micro_batch(at, capacity, per_gpu_batch, lambda: smallest_micro_batch(tracer))
    ddp = result.max_micro_batch or 0
    if not largest:
        gain = "does not fit either"
    elif not ddp:
        gain = f"DDP does not fit at any micro-batch; largest micro-batch {largest}"
    elif largest > ddp:
        gain = f"largest micro-batch {largest} (DDP: {ddp})"
    else:
        gain = f"no larger micro-batch ({ddp})"
    description = f"--fsdp (states sharded over {request.gpus} GPUs, micro-batch {micro}): {gain}"
    return Lever("fsdp", description, t, t <= capacity)
