"""`trainlab plan`'s time and cost: the lines under the memory table, the `--gpu all` table and their JSON keys."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainlab.memory.efficiency import ASSUMED, SHIPPED
from trainlab.memory.run_cost import RunCost, measure_data_command
from trainlab.memory.run_cost import to_json as cost_json

if TYPE_CHECKING:
    from trainlab.memory.planner import Candidate, Plan

EFFICIENCY_SOURCE = "trainlab/memory/efficiency.py ASSUMED (documented guesses until measured with --measure)"


def time_and_cost_json(result: Plan) -> dict[str, Any]:
    """The issue's keys: FLOPs always; step time, run time, GPU-hours, cost with one GPU; `candidates` with a table."""
    out: dict[str, Any] = {
        "flops_per_step": result.flops.total if result.flops else None,
        "flops_per_sample": result.flops.per_sample if result.flops else None,
        "flops_forward": result.flops.forward if result.flops else None,
        "flops_backward": result.flops.backward if result.flops else None,
        "flops_optimizer": result.flops.optimizer if result.flops else None,
        "bytes_moved_per_step": result.flops.bytes_moved if result.flops else None,
        "efficiency_family": result.family,
        "compute_dtype": result.compute,
        "dataset_size": result.dataset_size,
        "data_samples_per_second_per_core": result.data_rate.samples_per_second_per_core if result.data_rate else None,
    }
    if result.cost is not None:
        cost = cost_json(result.cost)
        out.update(
            {
                k: cost[k]
                for k in (
                    "step_seconds",
                    "samples_per_second",
                    "steps",
                    "run_hours",
                    "gpu_hours",
                    "cost_usd",
                    "usd_per_gpu_hour",
                    "price_source",
                    "efficiency_assumed",
                    "efficiency_source",
                    "efficiency_measured_on",
                    "data_cores_needed",
                )
            }
        )
    if result.candidates:
        out["candidates"] = [_candidate_json(c) for c in result.candidates]
    return out


def _candidate_json(c: Candidate) -> dict[str, Any]:
    row: dict[str, Any] = {
        "gpu": c.gpu.name,
        "gpus": c.gpus,
        "micro_batch": c.micro_batch,
        "grad_accumulation": c.grad_accumulation,
        "total_bytes": c.total_bytes,
        "margin_bytes": c.margin_bytes,
        "cheapest": c.cheapest,
        "fastest": c.fastest,
    }
    if c.cost is not None:
        row.update({k: v for k, v in cost_json(c.cost).items() if k not in row})
    return row


def _hours(h: float | None) -> str:
    if h is None:
        return "-"
    return f"{h * 60:,.1f} min" if h < 1 else f"{h:,.1f} h" if h < 48 else f"{h / 24:,.1f} d"


def _gpu_hours(h: float | None) -> str:
    return "-" if h is None else f"{h:,.0f}" if h >= 10 else f"{h:,.2f}"


def _usd(c: RunCost) -> str:
    if c.cost_usd is None:
        return "-"
    mark = "*" if c.price is not None and c.price.source == "example" else ""
    return f"${c.cost_usd:,.0f}{mark}" if c.cost_usd >= 10 else f"${c.cost_usd:,.2f}{mark}"


def _efficiency(c: RunCost) -> str:
    e = c.efficiency
    where = f"; measured by trainlab: {e.measured_on}" if e.measured_on else ""
    return f"MFU {e.value:.3g} {e.source} ({e.family}{where})"


def render_time_and_cost(result: Plan, config_flags: str) -> str:
    """The time-and-cost lines (and the `--gpu all` table): predictions, labelled as such."""
    lines = [""]
    f = result.flops
    if f is not None:
        samples = result.breakdown.micro_batch * result.breakdown.grad_accumulation
        lines.append(
            f"FLOPs per optimizer step and GPU (traced, {samples} samples): {f.total:.3e} = forward {f.forward:.3e} + "
            f"backward {f.backward:.3e} + optimizer {f.optimizer:.3e}; {f.per_sample:.3e} per sample; "
            f"{f.bytes_moved / 1e9:,.1f} GB moved by the counted ops"
        )
    if result.dataset_size is None:
        lines.append("run time: the data size is unknown here; pass --dataset-size N (training samples)")
    c = result.cost
    if c is not None:
        lines.append(
            f"predicted on {c.gpus} x {c.gpu} ({result.compute}, {_efficiency(c)}): {c.step_seconds:,.3f} s per "
            f"optimizer step (micro-batch {c.micro_batch} x {c.grad_accumulation}), {c.samples_per_second:,.0f} "
            "samples/s"
        )
        if c.steps is not None:
            lines.append(
                f"  run: {c.steps:,} steps ({result.epochs} epochs of {result.dataset_size:,} samples) = "
                f"{_hours(c.run_hours)}, {_gpu_hours(c.gpu_hours)} GPU-hours, cost {_usd(c)}"
                + (f" at ${c.price.usd_per_hour:.2f}/GPU-hour" if c.price else "")
            )
    elif result.gpu is not None and result.flops is not None:
        lines.append(f"no {result.compute} peak is known for {result.gpu.name}: no time estimate (name a GPU)")
    if result.candidates:
        lines += _table(result)
    if c is not None or result.candidates:
        if result.data_rate is not None:
            rate = result.data_rate.samples_per_second_per_core
            if c is not None and c.data_cores is not None:
                lines.append(
                    f"data pipeline: {c.data_cores:,.1f} CPU cores to feed {c.samples_per_second:,.0f} samples/s "
                    f"({rate:,.1f} samples/s per core measured, {result.data_rate.path})"
                )
            else:
                lines.append(f"data pipeline: {rate:,.1f} samples/s per core measured ({result.data_rate.path})")
        else:
            lines.append(
                f"data pipeline: no measurement of {result.recipe}'s pipeline is stored; measure it with "
                f"`{measure_data_command(result.recipe, config_flags)}`"
            )
        assumed = ", ".join(f"{k} {v:.2f}" for k, v in ASSUMED.items())
        shipped = ", ".join(f"{gpu} {family} {v:.3f}" for (gpu, family), (v, _) in SHIPPED.items())
        lines.append(
            f"predictions: step time = traced FLOPs / (the data-sheet dense peak x MFU), at least the bytes / the "
            f"bandwidth; MFU assumed per family ({assumed}; {EFFICIENCY_SOURCE}) except where measured (yours with "
            f"--measure; trainlab's: {shipped}, efficiency.py SHIPPED); * = an example price, not a "
            "quote (--price NAME=USD_PER_HOUR)"
        )
    return "\n".join(lines)


def _table(result: Plan) -> list[str]:
    header = f"{'':2}{'GPU':<14}{'n':>3}{'micro x acc':>13}{'margin':>11}{'s/step':>9}{'run':>10}{'cost':>10}  MFU"
    lines = ["", f"every GPU x count that fits (predictions; sorted by cost): {len(result.candidates)}", header]
    for r in result.candidates:
        mark = ("$" if r.cheapest else " ") + ("F" if r.fastest else " ")
        c = r.cost
        timing = (
            f"{c.step_seconds:>9.3f}{_hours(c.run_hours):>10}{_usd(c):>10}  "
            f"{c.efficiency.value:.3g} {c.efficiency.source}"
            if c is not None
            else f"{'-':>9}{'-':>10}{'-':>10}  (no {result.compute} peak known)"
        )
        lines.append(
            f"{mark}{r.gpu.name:<14}{r.gpus:>3}{f'{r.micro_batch} x {r.grad_accumulation}':>13}"
            f"{r.margin_bytes / 2**30:>7.1f} GiB{timing}"
        )
    lines.append("$ cheapest, F fastest")
    return lines
