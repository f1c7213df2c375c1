"""`trainlab plan RECIPE [--gpu NAME|GiB] [--gpus N] [--json] [flags of trainlab train RECIPE]`: will it fit?

Traces the recipe's real training step on fake tensors (no data, no real memory) and prints where the memory goes,
the allocator's reserved peak, the total against the GPU, the largest micro-batch that fits, the accumulation that
keeps the global batch, the GPUs the batch needs, levers, and the seed's hand estimate beside it.
`trainlab plan RECIPE --help` shows the plan's own flags first, then the recipe's (those of `trainlab train RECIPE`).
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from typing import TYPE_CHECKING, Any, TypeVar

from trainlab.config import Auto, flags_help, from_dict, option, parse
from trainlab.errors import UsageError
from trainlab.json_out import dumps_json
from trainlab.memory.gpus import GPU_PROFILES, GpuProfile, gpu_profile
from trainlab.recipes import check_recipe, get_recipe, list_recipes

if TYPE_CHECKING:
    from trainlab.memory.fsdp_memory import FsdpMemory, FsdpSettings
    from trainlab.memory.hand_formula import HandEstimate
    from trainlab.memory.planner import Plan

T = TypeVar("T")

# --trace-processes 0: workers from a fork server (~3 s to start) pay where a trace takes seconds (forked: always)
AUTO_WORKERS_FROM_SECONDS = 1.0

USAGE = (
    "usage: trainlab plan RECIPE [--gpu NAME|GiB|all|A,B] [--gpus N] [--price NAME=USD_PER_HOUR ...] "
    "[--dataset-size N] [--json] [flags of `trainlab train RECIPE`]"
)

WHAT_IT_PRINTS = """\
Will RECIPE fit? Traces the recipe's real training step on fake tensors (no data is read, no GPU is needed) for the
run `trainlab train RECIPE` with the same flags would start, and prints:
  - where the memory goes at the peak: parameters, gradients, optimizer states, activations, frozen models, ...;
  - the allocator's reserved peak and, with --gpu, the CUDA context and workspaces, the total and FITS / DOES NOT FIT;
  - the largest micro-batch that fits, the --grad-accumulation that keeps the global batch, the GPUs it needs;
  - levers (16-bit precision, activation checkpointing, --fsdp, ...) with their predicted totals, and the hand
    formula; with --fsdp --gpus N, one rank's sharded states and gathered working set;
  - the FLOPs of one optimizer step (traced), the predicted step time, run time, GPU-hours and cost (with --gpu:
    at an assumed or measured efficiency; example prices unless --price NAME=USD_PER_HOUR, repeatable, is given),
    and the CPU cores the data pipeline needs (from a stored `trainlab bench data RECIPE --json`).
With --gpu all (or a comma list of GPUs): one table of every GPU x 1, 2, 4, 8 GPUs that fits, sorted by cost.
The training flag --device picks what is planned: cuda (auto plans for CUDA) or cpu."""


@dataclasses.dataclass(kw_only=True)
class PlanOptions:
    """The plan's own flags (the others are the recipe's, as `trainlab train RECIPE` takes them)."""

    gpu: str | None = option(
        None,
        f"the GPU to plan for: {', '.join(GPU_PROFILES)}, or a size such as 48GiB (none: the traced peak only); "
        "`all` or a comma list: a table of every GPU x 1, 2, 4, 8 GPUs that fits, sorted by cost",
        metavar="NAME|GiB|all|A,B",
    )
    gpus: int = option(1, "GPUs (processes) sharing the global batch, as under `trainlab launch`", metavar="N", ge=1)
    json: bool = option(False, "print the plan as JSON instead of the table")
    dataset_size: int = option(
        0,
        "training samples, for the run time when the data is not on this machine (0: the recipe's data where it "
        "can be counted without reading it)",
        metavar="N",
        ge=0,
    )
    trace_processes: int = option(
        0,
        "processes tracing at once the configurations a plan with --gpu needs (0: one per core, at most 4, forked "
        "from this process; from a fork server where a fork cannot run autograd, and there only where a trace is "
        "slow enough to gain: the first forward took over a second; 1: all in this process)",
        metavar="N",
        ge=0,
    )
    measure: bool = option(False, "also run the real step on the device present and time it (plan_measure.py)")
    steps: int = option(20, "--measure: timed optimizer steps after 3 warm-up ones (median s/step)", metavar="N", ge=1)


def plan_help(recipe: str) -> str:
    """The top of `trainlab plan RECIPE --help`: the plan's usage, what it prints and its own flags."""
    return "\n\n".join(
        [
            WHAT_IT_PRINTS.replace("RECIPE", recipe),
            f"plan flags:\n{flags_help(PlanOptions)}",
            f"flags of `trainlab train {recipe}` (the run that is planned):",
        ]
    )


_BOOL_WORDS = ("true", "false", "1", "0", "yes", "no", "on", "off")


def _take_flag(argv: list[str], flag: str, is_switch: bool) -> tuple[list[str], str | None]:
    """Remove `flag` (and its value) from argv; returns the rest and the value (None: not given). A switch may
    stand alone (`--json`: true) or take a true/false word (`--json false`)."""
    rest: list[str] = []
    value: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        following = argv[i + 1] if i + 1 < len(argv) else None
        if arg == flag and is_switch:
            value = "true"
            if following is not None and following.lower() in _BOOL_WORDS:
                value, i = following, i + 1
        elif arg == flag:
            if following is None:
                raise UsageError(f"{flag} needs a value; see `trainlab plan RECIPE --help`")
            value, i = following, i + 1
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
        else:
            rest.append(arg)
        i += 1
    return rest, value


def take_plan_options(argv: list[str]) -> tuple[PlanOptions, list[str]]:
    """The plan's flags (typed and range-checked like any config) and the rest of `argv` (the recipe's flags).

    Raises:
        UsageError: a plan flag without its value, or a value of the wrong type or out of range.
    """
    return take_options(PlanOptions, argv)


def take_options(cls: type[T], argv: list[str]) -> tuple[T, list[str]]:
    """A command's own flags, the fields of `cls` (typed and range-checked like any config), taken out of `argv`
    before the recipe's flags are parsed; returns them and the rest of `argv`."""
    values: dict[str, Any] = {}
    rest = list(argv)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        rest, value = _take_flag(rest, "--" + f.name.replace("_", "-"), is_switch=f.type in (bool, "bool"))
        if value is not None:
            values[f.name] = value
    return from_dict(cls, values), rest


def take_prices(argv: list[str]) -> tuple[list[str], list[str]]:
    """`--price NAME=USD_PER_HOUR` (repeatable) taken out of argv: the rest and the specs."""
    rest: list[str] = []
    specs: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--price":
            if i + 1 >= len(argv):
                raise UsageError("--price needs NAME=USD_PER_HOUR, e.g. --price H100-80GB=2.49")
            specs.append(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith("--price="):
            specs.append(argv[i].removeprefix("--price="))
        else:
            rest.append(argv[i])
        i += 1
    return rest, specs


def gpus_of(spec: str | None) -> tuple[GpuProfile | None, tuple[GpuProfile, ...]]:
    """`--gpu`: one GPU (name or size), or `all` / a comma list for the table (then no single GPU)."""
    if spec is None:
        return None, ()
    if spec.strip().lower() == "all":
        return None, tuple(GPU_PROFILES.values())
    if "," in spec:
        names = [name.strip() for name in spec.split(",") if name.strip()]
        if not names:
            raise UsageError(f"--gpu {spec!r}: name GPUs separated by commas, e.g. --gpu H100-80GB,A100-80GB")
        profiles = {profile.name: profile for profile in (gpu_profile(name) for name in names)}
        return None, tuple(profiles.values())
    return gpu_profile(spec), ()


def checked_prices(specs: list[str], planned: tuple[GpuProfile, ...]) -> dict[str, float]:
    """`--price` specs of the planned GPUs (one that prices another GPU is a mistake: refused)."""
    from trainlab.memory.run_cost import parse_prices

    prices = parse_prices(specs)
    names = {gpu.name for gpu in planned}
    for name in prices:
        if name not in names:
            raise UsageError(f"--price {name}=...: {name} is not planned; add it to --gpu (or use --gpu all)")
    return prices


def config_flags(argv: list[str]) -> str:
    """The recipe flags as the user gave them (for the printed `trainlab bench data` command)."""
    return " ".join(argv)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:,.2f} GiB"


AUTO_IN_PLAN = "refused here: `trainlab train` resolves it on the device it runs on; this plan prints the number"


def _auto_is_trains(config: Any) -> int:
    raise UsageError(
        "--grad-accumulation auto is resolved by `trainlab train` from the free memory of the device it runs on; "
        "plan with --gpu NAME (or a size) and pass the accumulation the plan suggests, or plan a number"
    )


def main(argv: list[str]) -> int:
    if not argv:
        raise UsageError(f"name a recipe: {', '.join(list_recipes())}; `trainlab plan --help` for the flags")
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        print()
        print(WHAT_IT_PRINTS)
        print(f"\nplan flags:\n{flags_help(PlanOptions)}")
        print(f"\nrecipes: {', '.join(list_recipes())}; `trainlab plan RECIPE --help` adds the recipe's flags")
        return 0
    name, rest = argv[0], argv[1:]
    check_recipe(name)
    rest, prices = take_prices(rest)
    options, rest = take_plan_options(rest)  # checked before the recipe (and torch) is imported
    if prices and options.gpu is None:
        raise UsageError("--price prices a planned GPU: add --gpu NAME (or --gpu all)")
    recipe_cls = get_recipe(name)
    config = parse(
        recipe_cls.config_class,
        rest,
        prog=f"trainlab plan {name}",
        description=plan_help(name),
        usage=USAGE.removeprefix("usage: ").replace("RECIPE", name),
        auto={"grad_accumulation": Auto(AUTO_IN_PLAN, _auto_is_trains)},
    )
    if options.measure:  # the real step on the device present, beside the plan
        from trainlab.commands.plan_measure import measure_main

        return measure_main(recipe_cls(config), options, rest, prices)

    from trainlab.engine.device import parse_device
    from trainlab.memory.planner import PlanRequest, plan
    from trainlab.memory.trace_workers import auto_workers

    device_type = parse_device(config.device).type if config.device != "auto" else "cuda"
    if device_type not in ("cpu", "cuda"):
        raise UsageError(f"--device {config.device!r}: plan for cuda or cpu")
    gpu, candidates = gpus_of(options.gpu)
    if options.gpu is not None and device_type != "cuda":
        raise UsageError("--gpu plans for a CUDA device; drop --device cpu (or drop --gpu)")
    fsdp = fsdp_settings(config, options.gpus)
    # the trace is one process's step (as under DDP); the sharding is modelled from it (`memory.fsdp_memory`)
    config = dataclasses.replace(config, fsdp=False, fsdp_reshard_after_forward=True, fsdp_cpu_offload=False)
    recipe = recipe_cls(config)
    request = PlanRequest(
        device="cuda" if device_type == "cuda" else "cpu",
        gpu=gpu,
        gpus=options.gpus,
        fsdp=fsdp,
        candidates=candidates,
        prices=checked_prices(prices, (gpu,) if gpu is not None else candidates),
        dataset_size=options.dataset_size or None,
        workers=options.trace_processes or auto_workers(),
        workers_from_seconds=AUTO_WORKERS_FROM_SECONDS if options.trace_processes == 0 else 0.0,
    )
    # what is alive now (torch, the recipe's modules) outlives the plan: the collector's full passes skip it while
    # the plan runs (they were a tenth of a trace's time), in this process and the trace workers forked from it
    gc.freeze()
    try:
        result = plan(recipe, request)
    finally:
        gc.unfreeze()
    hand = _hand(recipe, result)
    if options.json:
        print(dumps_json(to_json(result, hand), indent=2))
    else:
        print(render(result, hand))
        from trainlab.commands.plan_cost import render_time_and_cost

        print(render_time_and_cost(result, config_flags(rest)))
    if gpu is not None and result.max_micro_batch == 0:
        print(
            f"does not fit even at micro-batch {result.min_micro_batch}: model states alone exceed the GPU; levers: "
            "bf16 weights, more GPUs with sharded states (--fsdp --gpus N), a larger GPU",
            file=sys.stderr,
        )
    return 0


def fsdp_settings(config: Any, gpus: int) -> FsdpSettings | None:
    """The run's `--fsdp` and its options over `gpus` as planned (None: no --fsdp, or one GPU, where `--fsdp` is a
    no-op: said on stderr). Options without --fsdp are refused by the config's own checks."""
    from trainlab.memory.fsdp_memory import FsdpSettings

    if not config.fsdp:
        return None
    if gpus == 1:
        print(
            "--fsdp with --gpus 1 is a no-op (one process trains the whole model): planned without it", file=sys.stderr
        )
        return None
    return FsdpSettings(gpus, config.fsdp_reshard_after_forward, config.fsdp_cpu_offload)


def _hand(recipe: Any, result: Plan) -> HandEstimate:
    from trainlab.memory.hand_formula import hand_estimate

    b = result.breakdown
    cfg = recipe.config
    example = recipe.example_batch(1)
    elements = sum(t.numel() for t in example.values() if t.is_floating_point())
    optimizer = b.optimizers[0] if b.optimizers else "adamw"
    estimate = hand_estimate(
        parameters=b.parameters,
        sixteen_bit=cfg.precision != "fp32",
        optimizer=optimizer,
        batch_size=b.micro_batch,
        input_elements=elements,
        depth=recipe.hand_formula_depth(),
    )
    errors = []
    if estimate.parameters != b.parameters:
        errors.append(
            f"parameter count: N(d) = 73728 d^2 gives {estimate.parameters / 1e6:,.1f} M; the model has "
            f"{b.parameters / 1e6:,.1f} M (18 d w^2 with w = 64 d is 73728 d^3, plus embeddings and head)"
        )
    if cfg.precision.endswith(("-amp", "-amp-scale")) and cfg.precision != "fp32":
        errors.append("AMP keeps fp32 weights and gradients (4 B/parameter each), not 2 B; autocast adds 16-bit copies")
    if b.optimizer_states_bytes:
        per = b.optimizer_states_bytes / max(b.parameters, 1)
        errors.append(f"{optimizer} states: {per:.1f} B/parameter traced (the seed counts AdamW as 2)")
    ratio = b.activations_bytes / max(b.parameters_bytes, 1)
    errors.append(f"activations: {ratio:.1f} x the parameter memory at micro-batch {b.micro_batch} (the seed: 1-3 x)")
    if b.micro_batch != 0:
        errors.append("framework overhead and fragmentation are flat guesses; the plan replays the caching allocator")
    estimate.errors = errors
    return estimate


def to_json(result: Plan, hand: HandEstimate) -> dict[str, Any]:
    b = result.breakdown
    out: dict[str, Any] = {
        "recipe": result.recipe,
        "device": b.device,
        "precision": result.precision,
        "global_batch": result.global_batch,
        "gpus": result.gpus,
        "micro_batch": b.micro_batch,
        "grad_accumulation": b.grad_accumulation,
        "activation_checkpointing": result.activation_checkpointing,
        "compile_planned_as_eager": result.compiled,
        "parameters": b.parameters,
        "parameters_bytes": b.parameters_bytes,
        "gradients_bytes": b.gradients_bytes,
        "optimizer_states_bytes": b.optimizer_states_bytes,
        "activations_bytes": b.activations_bytes,
        "frozen_bytes": b.frozen_bytes,
        "peak_allocated_bytes": b.peak_allocated_bytes,
        "peak_reserved_bytes": b.peak_reserved_bytes,
        "at_peak_bytes": b.at_peak,
        "overhead_bytes": result.overheads.total,
        "total_bytes": result.total_bytes,
        "hand_estimate_bytes": [hand.low_bytes, hand.high_bytes],
        "notes": result.notes,
    }
    if result.fsdp is not None:
        out["fsdp"] = dataclasses.asdict(result.fsdp)
    from trainlab.commands.plan_cost import time_and_cost_json

    out.update(time_and_cost_json(result))
    if result.gpu is not None:
        out.update(
            gpu=result.gpu.name,
            gpu_bytes=result.gpu.total_bytes,
            fits=bool(result.fits),
            margin_bytes=result.margin_bytes,
            max_micro_batch=int(result.max_micro_batch or 0),
            suggested_grad_accumulation=result.suggested_grad_accumulation,
            gpus_needed=result.gpus_needed,
            levers=[
                {"name": lv.name, "description": lv.description, "total_bytes": lv.total_bytes} for lv in result.levers
            ],
        )
    return out


def _fsdp_rows(m: FsdpMemory) -> list[str]:
    from trainlab.memory.fsdp_memory import breakdown_rows

    lines = [f"{f'FSDP2 rank of {m.world} ({m.units} shard units)':<40}{'bytes':>16}"]
    lines += [f"  {label:<38}{_gib(value):>16}" for label, value in breakdown_rows(m)]
    lines.append(f"{'peak of live tensors on one rank':<40}{_gib(m.peak_bytes):>16}")
    if m.host_bytes:
        lines.append(f"  (--fsdp-cpu-offload: {_gib(m.host_bytes)} of shards on the host, not on the GPU)")
    return lines


def render(result: Plan, hand: HandEstimate) -> str:
    b = result.breakdown
    p = b.at_peak
    cuda = b.device == "cuda"
    lines = [
        f"trainlab plan {result.recipe}: {b.parameters / 1e6:,.2f} M parameters, {result.precision}, global batch "
        f"{result.global_batch} = {result.gpus} GPU(s) x {b.grad_accumulation} accumulation x micro-batch "
        f"{b.micro_batch}{', activation checkpointing' if result.activation_checkpointing else ''} "
        f"({'CUDA' if cuda else 'this CPU'}; traced on fake tensors)",
        "",
        f"{'at the peak of live tensors':<40}{'bytes':>16}",
    ]
    rows = [
        ("parameters", p["parameter"]),
        ("buffers", p["buffer"]),
        ("gradients", p["gradient"]),
        ("optimizer states", p["optimizer_state"]),
        ("frozen models", p["frozen"]),
        ("momentum / EMA copies, loss scale", p["recipe_state"]),
        ("activations (saved for backward)", p["activations"]),
        ("batch", p["batch"]),
        ("temporaries", p["temporaries"]),
        ("autocast weight copies", p["autocast_copies"]),
    ]
    lines += [f"  {label:<38}{_gib(value):>16}" for label, value in rows]
    if result.fsdp is not None:
        lines += _fsdp_rows(result.fsdp)
    lines.append(
        f"{'peak of live tensors' + (' (512 B blocks)' if cuda else ''):<40}{_gib(b.peak_allocated_bytes):>16}"
    )
    lines.append(f"  {'activation peak (end of forward)':<38}{_gib(b.activations_bytes):>16}")
    if cuda:
        lines.append(f"{'allocator reserved peak':<40}{_gib(b.peak_reserved_bytes):>16}  ({b.segments} segments)")
        o = result.overheads
        if result.gpu is not None:
            lines.append(f"  {'CUDA context (estimate)':<38}{_gib(o.context_bytes):>16}")
            lines.append(f"  {'cuBLAS workspaces (estimate)':<38}{_gib(o.cublas_workspace_bytes):>16}")
            if o.cudnn_workspace_bytes:
                lines.append(f"  {'cuDNN workspace (estimate)':<38}{_gib(o.cudnn_workspace_bytes):>16}")
            if o.nccl_bytes:
                lines.append(f"  {'NCCL buffers (estimate)':<38}{_gib(o.nccl_bytes):>16}")
                lines.append(f"  {'DDP gradient buckets':<38}{_gib(o.ddp_buckets_bytes):>16}")
        else:
            lines.append("  (context and workspaces: pass --gpu NAME|GiB)")
    lines.append(f"{'total':<40}{_gib(result.total_bytes):>16}")
    if result.compiled:
        lines.append(
            "--compile: planned as the eager step (inductor's fused kernels usually keep fewer intermediates; "
            "not modelled)"
        )
    if result.gpu is not None:
        verdict = "FITS" if result.fits else "DOES NOT FIT"
        lines.append(
            f"{result.gpu.name} ({_gib(result.gpu.total_bytes)}): {verdict}, margin {_gib(result.margin_bytes)}"
            f"{'' if result.gpu.measured else ' (GPU constants are estimates, not measured)'}"
        )
        lines.append("")
        if result.max_micro_batch:
            lines.append(
                f"largest micro-batch that fits: {result.max_micro_batch} "
                f"(total {_gib(result.max_micro_batch_total_bytes)})"
            )
            lines.append(
                f"keep the global batch {result.global_batch}: --grad-accumulation {result.suggested_grad_accumulation}"
                f" on {result.gpus} GPU(s)"
            )
            if result.gpus_needed:
                lines.append(f"GPUs the global batch needs without accumulation: {result.gpus_needed}")
        else:
            lines.append(
                f"even micro-batch {result.min_micro_batch} does not fit: the model states alone exceed this GPU"
            )
        if result.levers:
            lines.append("levers:")
            for lever in result.levers:
                predicted = "" if lever.total_bytes is None else f" -> {_gib(lever.total_bytes)}"
                ok = "" if lever.fits is None else (" fits" if lever.fits else " does not fit")
                lines.append(f"  {lever.name}: {lever.description}{predicted}{ok}")
    lines += result.notes
    lines.append("")
    lines.append(
        f"the seed's hand formula for this run: {_gib(hand.low_bytes)} - {_gib(hand.high_bytes)} "
        f"(N = {hand.parameters / 1e6:,.1f} M); traced: {_gib(result.total_bytes)}. Where it is wrong:"
    )
    lines += [f"  - {e}" for e in hand.errors]
    lines.append(f"({result.traces} traced configuration(s))")
    return "\n".join(lines)
