"""Time and cost of a planned run on a GPU: step time from the traced FLOPs, run time over the data, GPU-hours, cost.

    step seconds    = `flops.estimate_step_seconds` (FLOPs / (peak x efficiency), bandwidth floor), per process
    steps per epoch = dataset size // global batch (the engine's `StepBatchSampler`), stopped at --max-steps
    run hours       = steps x step seconds / 3600;  GPU-hours = run hours x GPUs;  cost = GPU-hours x price
    data cores      = samples/s the GPUs consume / the per-core samples/s `trainlab bench data` measured

Each process runs its own micro-batches of the step, so the step time of one process is the step time of the run
(DDP's gradient all-reduce overlaps the backward and is not modelled). Prices are the GPU table's EXAMPLES unless
given (`--price NAME=USD_PER_HOUR`).
"""

from __future__ import annotations

import json
import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlab.errors import UsageError
from trainlab.memory.efficiency import Efficiency, cache_folder, efficiency_for
from trainlab.memory.flop_counter import StepFlops
from trainlab.memory.flops import estimate_step_seconds
from trainlab.memory.gpus import GpuProfile, gpu_profile
from trainlab.small_files import read_small_text


@dataclass(frozen=True)
class Price:
    usd_per_hour: float
    source: str  # "example" (the GPU table's) or "given" (--price)


@dataclass(frozen=True)
class DataRate:
    """A stored `trainlab bench data RECIPE --json` result: samples/s one CPU core delivers."""

    samples_per_second_per_core: float
    path: Path


@dataclass(frozen=True)
class RunCost:
    """Time and cost of the run on `gpus` x `gpu` at `micro_batch` x `grad_accumulation` per process."""

    gpu: str
    gpus: int
    micro_batch: int
    grad_accumulation: int
    flops: StepFlops  # one process's optimizer step
    efficiency: Efficiency
    step_seconds: float
    samples_per_second: float  # all GPUs together
    steps: int | None  # optimizer steps of the run (None: the dataset size is unknown)
    run_hours: float | None
    gpu_hours: float | None
    price: Price | None
    cost_usd: float | None
    data_cores: float | None  # CPU cores the data pipeline needs at that rate (None: no stored measurement)


def parse_prices(specs: list[str]) -> dict[str, float]:
    """`NAME=USD_PER_HOUR` specs (`--price`, repeatable) -> GPU profile name -> price.

    Raises:
        UsageError: a spec without `=`, an unknown GPU or a price that is not a positive number.
    """
    prices: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep:
            raise UsageError(f"--price {spec!r}: write NAME=USD_PER_HOUR, e.g. --price H100-80GB=2.49")
        try:
            profile = gpu_profile(name.strip())
        except UsageError as err:
            raise UsageError(f"--price {spec!r}: {err}") from None
        if not profile.peak_tflops:
            raise UsageError(f"--price {spec!r}: price a GPU by name (`trainlab plan --help` lists them), not a size")
        try:
            usd = float(value)
        except ValueError:
            usd = float("nan")
        if not usd > 0 or usd == float("inf"):
            raise UsageError(f"--price {spec!r}: the price must be a positive number of US dollars per GPU-hour")
        prices[profile.name] = usd
    return prices


def price_of(gpu: GpuProfile, prices: dict[str, float]) -> Price | None:
    if gpu.name in prices:
        return Price(prices[gpu.name], "given")
    if gpu.example_usd_per_hour is not None:
        return Price(gpu.example_usd_per_hour, "example")
    return None


def data_rate_path(recipe: str) -> Path:
    """Where `trainlab bench data RECIPE --json` output is read from (the user's cache folder)."""
    return cache_folder() / "bench_data" / f"{recipe}.json"


def measure_data_command(recipe: str, config_flags: str = "") -> str:
    """The command that measures (and stores) the recipe's per-core data rate."""
    flags = f" {config_flags}" if config_flags else ""
    path = _shown_path(data_rate_path(recipe))
    return (
        f"mkdir -p {_shown_path(data_rate_path(recipe).parent)} && trainlab bench data {recipe}{flags} --json > {path}"
    )


def _shown_path(path: Path) -> str:
    """`path` as a shell reads it, the home folder as `~` (the printed command works for whoever runs it)."""
    home = Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else shlex.quote(str(path))


def stored_data_rate(recipe: str) -> DataRate | None:
    """The per-core samples/s of the recipe's training pipeline, as `trainlab bench data RECIPE --json` stored it;
    None when nothing (readable) is stored."""
    path = data_rate_path(recipe)
    try:
        stored = json.loads(read_small_text(path))
    except (OSError, ValueError):
        return None
    rate = stored.get("samples_per_second_per_core") if isinstance(stored, dict) else None
    if not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 1e-6:  # NaN or 1e-300: no rate
        return None
    return DataRate(float(rate), path)


def known_dataset_size(config: Any) -> int | None:
    """Training samples of the configured data when they can be known without reading the data: the toy set's
    `num_samples`, kind fake's `fake_size`, CIFAR-10's 50,000, an image folder's files (listed, not read); capped by
    `train_limit`. None otherwise (then `--dataset-size N`)."""
    size: int | None = None
    data = getattr(config, "data", None)
    if data is None:
        size = getattr(config, "num_samples", None)
    elif data.kind == "fake":
        size = data.fake_size
    elif data.kind == "cifar10":
        size = 50_000
    elif data.kind == "image-folder" and (Path(data.root) / "train").is_dir():
        size = sum(len(files) for _, _, files in os.walk(Path(data.root) / "train"))
    limit = getattr(data, "train_limit", 0) if data is not None else 0
    if size is not None and limit and limit > 0:
        size = min(size, limit)
    return size


def run_cost(
    *,
    flops: StepFlops,
    gpu: GpuProfile,
    gpus: int,
    micro_batch: int,
    grad_accumulation: int,
    compute: str,
    family: str,
    global_batch: int,
    epochs: int,
    max_steps: int,
    dataset_size: int | None,
    prices: dict[str, float],
    data_rate: DataRate | None,
) -> RunCost:
    """The time and cost of the run (see the module docstring). `flops` are one process's for its micro-batch."""
    efficiency = efficiency_for(gpu.name, family)
    step_seconds = estimate_step_seconds(flops, gpu, compute, efficiency.value)
    samples_per_second = global_batch / step_seconds
    steps: int | None = None
    if dataset_size is not None:
        steps = (dataset_size // global_batch) * epochs
        if max_steps > 0:
            steps = min(steps, max_steps)
    run_hours = None if steps is None else steps * step_seconds / 3600
    gpu_hours = None if run_hours is None else run_hours * gpus
    price = price_of(gpu, prices)
    cost = None if gpu_hours is None or price is None else gpu_hours * price.usd_per_hour
    cores = None if data_rate is None else samples_per_second / data_rate.samples_per_second_per_core
    return RunCost(
        gpu.name,
        gpus,
        micro_batch,
        grad_accumulation,
        flops,
        efficiency,
        step_seconds,
        samples_per_second,
        steps,
        run_hours,
        gpu_hours,
        price,
        cost,
        cores,
    )


def to_json(cost: RunCost) -> dict[str, Any]:
    """The issue's keys for one GPU and count."""
    return {
        "gpu": cost.gpu,
        "gpus": cost.gpus,
        "micro_batch": cost.micro_batch,
        "grad_accumulation": cost.grad_accumulation,
        "flops_per_step": cost.flops.total,
        "flops_per_sample": cost.flops.per_sample,
        "flops_forward": cost.flops.forward,
        "flops_backward": cost.flops.backward,
        "flops_optimizer": cost.flops.optimizer,
        "bytes_moved_per_step": cost.flops.bytes_moved,
        "step_seconds": cost.step_seconds,
        "samples_per_second": cost.samples_per_second,
        "steps": cost.steps,
        "run_hours": cost.run_hours,
        "gpu_hours": cost.gpu_hours,
        "usd_per_gpu_hour": None if cost.price is None else cost.price.usd_per_hour,
        "price_source": None if cost.price is None else cost.price.source,
        "cost_usd": cost.cost_usd,
        "efficiency_assumed": cost.efficiency.value,
        "efficiency_source": cost.efficiency.source,
        "efficiency_family": cost.efficiency.family,
        "efficiency_measured_on": cost.efficiency.measured_on or None,  # a shipped measurement: what, where, when
        "data_cores_needed": cost.data_cores,
    }
