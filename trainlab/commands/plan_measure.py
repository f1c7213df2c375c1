"""`trainlab plan RECIPE ... --measure [--steps N]`: the plan, then the real step measured on the device present.

On the device the training flag `--device` names (default: the recipe's; `auto` is CUDA when present, else the
CPU): the memory plan for that device (on CUDA against the present GPU's profile), then `memory.measure.measure_step`
(warm-up steps, then N timed optimizer steps of the Trainer's own training loop, as `trainlab train` runs them, in a
throw-away run directory where nothing is written: on the recipe's data through its training loader when the data is
on this machine, else on synthetic batches; downloads are turned off), and beside each other:
measured and estimated s/step, samples/s, achieved TFLOP/s and MFU (where the device's peak is known), the measured
and the planned peak memory, and the projection of the whole run (the configured epochs x steps per epoch of the
dataset size). The projected s/step is the measured one where the loader ran (its time is inside the steps); with
synthetic batches it adds the data pipeline's time from a stored `trainlab bench data RECIPE --json` rate, where one
is stored (the step's slow-down by the loader around it is then not included). On CUDA with a known peak the
measured efficiency (MFU against the traced FLOPs the estimate uses) is stored for the GPU and the recipe family
(`memory.efficiency.store_measured`); later estimates for that GPU and family use it, and the output says so.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from trainlab.errors import UsageError
from trainlab.json_out import dumps_json

if TYPE_CHECKING:
    import torch

    from trainlab.commands.plan import PlanOptions
    from trainlab.engine.recipe import Recipe
    from trainlab.engine.run_length import RunLength
    from trainlab.memory.gpus import GpuProfile
    from trainlab.memory.measure import Measurement
    from trainlab.memory.planner import Plan
    from trainlab.memory.trace import PlanDevice


def present_device(name: str, gpu: str | None) -> tuple[torch.device, GpuProfile | None]:
    """The device `--measure` runs on and its GPU profile (None: a CPU, or a GPU not in the table).

    Raises:
        UsageError: `--gpu` names another GPU than the present device (one line: measure there, or drop one flag).
    """
    import torch

    from trainlab.engine.device import resolve_device
    from trainlab.memory.gpus import gpu_profile, profile_for_device_name

    device = resolve_device(name)
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--measure runs on cpu or cuda, not {device.type}; pass --device cpu or cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    present = profile_for_device_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if gpu is not None and (gpu.strip().lower() == "all" or "," in gpu):
        raise UsageError(
            f"--measure times the one device present, --gpu {gpu} plans several: drop --measure to compare GPUs, or "
            "drop --gpu to measure here"
        )
    if gpu is not None:
        wanted = gpu_profile(gpu)
        here = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU (the CPU)"
        if present is None or present.name != wanted.name:
            raise UsageError(
                f"--measure runs on the device present ({here}), not {wanted.name}: run it on a {wanted.name}, or "
                "drop --measure to estimate, or drop --gpu to measure here"
            )
    return device, present


@dataclass(frozen=True)
class Estimate:
    """The planner's estimate beside the measurement (None fields: no estimate, with `why`)."""

    step_seconds: float | None
    efficiency: float | None
    efficiency_source: str
    family: str
    why: str


def estimate_of(result: Plan) -> Estimate:
    """The planner's time estimate of the configured run on the present GPU (made before a new measurement is
    stored): its step seconds and the efficiency it assumed or had measured."""
    cost = result.cost
    if cost is None:
        device = "a CPU" if result.breakdown.device == "cpu" else "this GPU"
        why = f"no estimate: no data-sheet peak for {device}" + (f" in {result.compute}" if result.gpu else "")
        return Estimate(None, None, "", result.family, why)
    e = cost.efficiency
    why = f"{cost.gpu}, {result.compute}, efficiency {e.value:.3f} {e.source} ({e.family})"
    return Estimate(cost.step_seconds, e.value, e.source, result.family, why)


def measure_main(recipe: Recipe[Any], options: PlanOptions, recipe_flags: list[str], prices: list[str]) -> int:
    """`trainlab plan RECIPE ... --measure`: see the module docstring. Returns the exit code."""
    import torch

    from trainlab.commands.plan import _hand, checked_prices, config_flags, render, to_json
    from trainlab.commands.plan_cost import render_time_and_cost
    from trainlab.memory.measure import measure_step
    from trainlab.memory.planner import PlanRequest, plan

    device, gpu = present_device(recipe.config.device, options.gpu)
    device_type: PlanDevice = "cuda" if device.type == "cuda" else "cpu"
    request = PlanRequest(
        device=device_type,
        gpu=gpu,
        gpus=options.gpus,
        prices=checked_prices(prices, (gpu,) if gpu is not None else ()),
        dataset_size=options.dataset_size or None,
    )
    result = plan(recipe, request)
    estimate = estimate_of(result)
    assert result.flops is not None  # the planner counts the configured step's FLOPs
    # the planner traced `recipe` on fake tensors: build the real one anew; never download data to measure
    fresh = type(recipe)(without_downloads(recipe.config))
    measured = measure_step(
        fresh,
        device,
        steps=options.steps,
        gpus=options.gpus,
        dataset_size=result.dataset_size,
        flops_per_step=result.flops.total,
        flops_source="traced, as the estimate counts them",
    )
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    stored = store_efficiency(measured, gpu, estimate.family, device_name)
    per_core = result.data_rate.samples_per_second_per_core if result.data_rate is not None else None
    num_workers = recipe.config.num_workers
    data_seconds = data_seconds_per_step(measured, per_core)
    keys = measured_json(measured, estimate, _length(recipe, result.dataset_size), stored, data_seconds, num_workers)
    if options.json:
        print(dumps_json({**to_json(result, _hand(recipe, result)), **keys}, indent=2))
    else:
        print(render(result, _hand(recipe, result)))
        print(render_time_and_cost(result, config_flags(recipe_flags)))
        print()
        print(render_measured(measured, estimate, keys, stored, num_workers))
    return 0


def store_efficiency(measured: Measurement, gpu: GpuProfile | None, family: str, device_name: str) -> str:
    """Store the measured efficiency (its MFU) for `gpu` and `family` where it is a CUDA device's with a known peak;
    returns the line saying so ('' where nothing is stored: a CPU, a GPU not in the table, no peak for the dtype)."""
    import torch

    from trainlab.memory.efficiency import store_measured

    mfu = measured.mfu
    if gpu is None or mfu is None or not measured.device.startswith("cuda") or not 0 < mfu <= 1:
        return ""
    path = store_measured(
        gpu.name,
        family,
        mfu,
        {
            "measured_step_seconds": measured.median_step_seconds,
            "precision": measured.precision,
            "micro_batch": measured.micro_batch,
            "grad_accumulation": measured.grad_accumulation,
            "torch": torch.__version__,
            "device_name": device_name,
        },
    )
    return f"stored: efficiency {mfu:.3f} in {path}; later estimates for GPU {gpu.name} and family {family} use it"


def without_downloads(config: Any) -> Any:
    """`config` with its `download` flags (the data group's, the recipe's own) turned off."""
    data = getattr(config, "data", None)
    if data is not None and getattr(data, "download", False):
        config = replace(config, data=replace(data, download=False))
    if getattr(config, "download", False):
        config = replace(config, download=False)
    return config


def data_seconds_per_step(measured: Measurement, per_core: float | None) -> float | None:
    """Seconds one process's data pipeline takes for its share of a step: with the loader measured, the median time
    inside its `next()` per timed step; with synthetic batches, at `per_core` samples/s per core (the stored
    `trainlab bench data RECIPE --json` rate; None: not stored)."""
    if measured.data == "loader":
        return statistics.median(measured.data_wait_seconds)
    return None if per_core is None else measured.global_batch / measured.gpus / per_core


def projected_step_seconds(measured: Measurement, data_seconds: float | None, num_workers: int) -> float:
    """The run's s/step: the measured step where the loader ran (its time is inside); with synthetic batches the
    measured step plus the data pipeline's time where the training process builds the batches itself
    (`--num-workers 0`), or at least the pipeline's time shared by the loader workers."""
    step = measured.median_step_seconds
    if data_seconds is None or measured.data == "loader":
        return step
    return step + data_seconds if num_workers == 0 else max(step, data_seconds / num_workers)


def measured_json(
    measured: Measurement,
    estimate: Estimate,
    run_length: RunLength | None,
    stored: str,
    data_seconds: float | None,
    num_workers: int,
) -> dict[str, Any]:
    """The `--json` keys `--measure` adds to the plan's (whose `flops_per_step`, `step_seconds`, `efficiency_assumed`
    and `efficiency_source` are the estimate's, made before this measurement was stored)."""
    out: dict[str, Any] = {
        "measured_device": measured.device,
        "measured_step_seconds": measured.median_step_seconds,
        "measured_step_seconds_all": measured.step_seconds,
        "measured_samples_per_second": measured.samples_per_second,
        "measured_tflops": measured.achieved_tflops,
        "measured_mfu": measured.mfu,
        "measured_steps": measured.steps,
        "measured_warmup_steps": measured.warmup_steps,
        "measured_peak_memory_bytes": measured.memory.get("peak_memory_bytes"),
        "measured_memory_kind": measured.memory.get("memory_kind"),
        "measured_reserved_bytes": measured.memory.get("cuda_max_reserved_bytes"),
        "measured_peak_tflops": None if measured.peak.flops is None else measured.peak.flops / 1e12,
        "measured_peak_source": measured.peak.why,
        "efficiency_stored": bool(stored),
        "measured_data": measured.data,
        "measured_data_note": measured.data_note,
    }
    projected = projected_step_seconds(measured, data_seconds, num_workers)
    steps = None if run_length is None else run_length.stop_step
    out["measured_data_seconds_per_step"] = data_seconds
    out["projected_step_seconds"] = projected
    out["projected_run_steps"] = steps
    out["projected_run_seconds"] = None if steps is None else steps * projected
    return out


def _length(recipe: Recipe[Any], dataset_size: int | None) -> RunLength | None:
    """The configured run's length for `dataset_size` samples per epoch, as the Trainer derives it (None: unknown)."""
    from trainlab.engine.run_length import run_length

    if dataset_size is None:
        return None
    cfg = recipe.config
    return run_length(max(dataset_size // cfg.batch_size, 1), epochs=cfg.epochs, max_steps=cfg.max_steps)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def render_measured(
    measured: Measurement, estimate: Estimate, keys: dict[str, Any], stored: str, num_workers: int
) -> str:
    """The measured section below the plan."""
    from trainlab.engine.metrics import flops_rate

    s = measured.median_step_seconds
    spread = f"{min(measured.step_seconds):.4g}-{max(measured.step_seconds):.4g}"
    lines = [
        f"measured on {measured.device} ({measured.precision}, micro-batch {measured.micro_batch} x accumulation "
        f"{measured.grad_accumulation}; {measured.warmup_steps} warm-up + {measured.steps} timed optimizer steps, "
        f"{'batches from the loader' if measured.data == 'loader' else 'synthetic batches'}):",
        f"  s/step             {s:.4g} (median; range {spread})"
        + (
            f"; estimated {estimate.step_seconds:.4g} ({estimate.why})"
            if estimate.step_seconds is not None
            else f"; {estimate.why}"
        ),
        f"  samples/s          {measured.samples_per_second:,.4g} (global batch {measured.global_batch})",
        f"  achieved           {flops_rate(measured.achieved_tflops)} per device ({measured.flops_per_step:,} "
        f"FLOPs per step, {measured.flops_source})",
        "  MFU                "
        + (f"{100 * measured.mfu:.1f}% of {measured.peak.why}" if measured.mfu is not None else measured.peak.why),
    ]
    memory = measured.memory
    if memory.get("memory_kind") == "cuda_max_allocated":
        lines.append(
            f"  peak memory        allocated {memory['peak_memory_bytes'] / 2**30:,.2f} GiB, reserved "
            f"{memory['cuda_max_reserved_bytes'] / 2**30:,.2f} GiB (torch.cuda.max_memory_allocated / _reserved)"
        )
    else:
        lines.append(
            "  peak memory        not measured on a CPU; resident set growth "
            f"{memory['peak_memory_bytes'] / 2**20:,.0f} MiB (high-water mark)"
        )
    data = keys["measured_data_seconds_per_step"]
    projected = keys["projected_step_seconds"]
    if measured.data == "loader":
        lines.append(
            f"  data               {measured.data_note}: inside each timed step, {data:.4g} s of it in the "
            f"loader (median); projected {projected:.4g} s/step"
        )
    elif data is None:
        lines.append(
            f"  data               not read ({measured.data_note}) and not counted: a run with --num-workers 0 adds "
            "its pipeline's time to every step (`trainlab bench data RECIPE --json` stores it per core; later "
            "--measure runs add it)"
            if num_workers == 0
            else f"  data               not read ({measured.data_note}): {num_workers} loader worker(s) must deliver "
            f"{measured.samples_per_second:,.4g} samples/s to keep this pace (`trainlab bench data RECIPE`: per core)"
        )
    else:
        how = "added to each step (--num-workers 0)" if num_workers == 0 else f"shared by {num_workers} worker(s)"
        lines.append(
            f"  data               not read ({measured.data_note}): {data:.4g} s per step at the stored per-core "
            f"rate, {how}: projected {projected:.4g} s/step (the loader's slow-down of the step not included)"
        )
    if keys.get("projected_run_seconds") is not None:
        lines.append(
            f"  whole run          {keys['projected_run_steps']:,} optimizer steps x {projected:.4g} s = "
            f"{_duration(keys['projected_run_seconds'])}" + ("" if data is not None else " (data loading not included)")
        )
    else:
        lines.append("  whole run          not projected: the dataset size is not known")
    if stored:
        lines.append(stored)
    return "\n".join(lines)
