"""`trainlab doctor`: check this machine before a long run (one line per check: PASS / WARN / FAIL / SKIP).

    trainlab doctor [--device cuda|cpu|auto] [--run-dir DIR] [--data.root DIR] [--num-workers N]
                    [--nproc-per-node N] [--data-sample N] [--json]
    trainlab doctor RECIPE [flags of trainlab train RECIPE] [--nproc-per-node N] [--data-sample N] [--json]

The second form checks the run `trainlab train RECIPE ...` would start with the same flags: its device, run
directory, loader workers, precision and data folder (`--data.root` of an image-folder or cifar10 run) come from the
recipe's config, the checkpoint size from the memory planner
(parameters, buffers and optimizer states traced on fake tensors) and the shared memory the loader needs from the
recipe's example batch at the micro-batch size. Every WARN and FAIL names its fix on the same line; the command exits
1 when a check failed, 0 otherwise. `--json` prints every check as an object instead. The checks are in
`trainlab/doctor/` (one module per group; each judges plain inputs, so tests simulate a small /dev/shm or a full disk).
Torch and the GPU probes are imported when the checks run: `--help` and a bad flag answer without them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainlab.config import option, parse
from trainlab.doctor import host
from trainlab.doctor.report import Check, exit_code, render_json, render_text
from trainlab.errors import UsageError, first_line
from trainlab.json_out import dumps_json

if TYPE_CHECKING:  # the version and GPU checks import torch: imported where the checks run
    from trainlab.doctor.versions import CudaIntent, DriverInfo

log = logging.getLogger(__name__)

NCCL_PROBE_TIMEOUT_S = 120.0


@dataclass(kw_only=True)
class DoctorConfig:
    """Check this machine before a long run: versions, GPUs, host limits, disk and data, one line per check."""

    device: Literal["auto", "cuda", "cpu"] = option(
        "auto", "cuda: the GPU checks must pass; cpu: skip them; auto: check CUDA where the driver lists a GPU"
    )
    run_dir: Path = option(
        Path("runs/default"), "the run's folder, where it will write: writable, free disk", metavar="DIR"
    )
    data_root: Path | None = option(
        None,
        "training data to check (train/<class>/*, val/<class>/*, or cifar-10-batches-py/); default: none",
        metavar="DIR",
        flag="--data.root",
        deprecated=("--data-root",),
    )
    num_workers: int = option(0, "DataLoader workers per training process the run will use", ge=0)
    nproc_per_node: int = option(1, "training processes on this machine (torchrun --nproc-per-node)", ge=1)
    data_sample: int = option(2000, "images per split decoded to count unreadable files (0: every image)", ge=0)
    json: bool = option(False, "print every check as a JSON object (and the counts) instead of lines")


# Flags the doctor keeps for itself when a recipe's flags follow it (name -> takes a value); the recipe's own
# `--data.root` stays the recipe's (the data group says which folder its kind reads).
_DOCTOR_FLAGS = {"--nproc-per-node": True, "--data-sample": True, "--json": False}


@dataclass
class PlannedRun:
    """What the checks need to know about the run to come (from DoctorConfig, or from a recipe's config)."""

    device: str
    run_dir: Path
    num_workers: int
    processes: int
    keep_checkpoints: int = 2
    precision: str | None = None
    batch_bytes: int | None = None
    checkpoint_bytes: int | None = None
    data_root: Path | None = None
    size_unknown: str = "no recipe given: `trainlab doctor RECIPE [train flags]` sizes them"
    notes: list[Check] = dataclasses.field(default_factory=list)


def split_doctor_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the doctor's own flags, the rest) of a recipe-mode command line (`--flag value`, `--flag=value`)."""
    mine: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in _DOCTOR_FLAGS:
            mine.append(arg)
            takes_value = _DOCTOR_FLAGS[name]
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if "=" not in arg and nxt is not None and (takes_value or nxt.lower() in ("true", "false")):
                mine.append(nxt)
                i += 1
        else:
            rest.append(arg)
        i += 1
    return mine, rest


def _recipe_data_root(config: Any) -> Path | None:
    """The folder a recipe config reads images from, when it reads any: `data.root` of an image-folder or cifar10
    data group (the digits and fake images read no folder; the toy has no data group)."""
    data = getattr(config, "data", None)
    root, kind = getattr(data, "root", None), getattr(data, "kind", None)
    if not isinstance(root, Path) or kind not in ("image-folder", "cifar10"):
        return None
    return root


def checkpoint_bytes(recipe: Any) -> int:
    """One checkpoint's size from the memory planner: trained parameters, their buffers and optimizer states."""
    from trainlab.engine.run_length import run_length
    from trainlab.memory.breakdown import breakdown
    from trainlab.memory.trace import trace_training

    two_steps = run_length(2, epochs=1, max_steps=-1)  # the first step creates the optimizer states
    # micro-batch 2: the checkpoint's size does not depend on it, and BatchNorm in training refuses one value per
    # channel (MoCo's projector on a micro-batch of 1)
    traced = breakdown(trace_training(recipe, device="cpu", micro_batch=2, grad_accumulation=1, length=two_steps))
    return traced.parameters_bytes + traced.optimizer_states_bytes + traced.at_peak.get("buffer", 0)


def plan_from_recipe(name: str, argv: list[str], processes: int) -> PlannedRun:
    """The run `trainlab train NAME ARGV` would start, sized by the recipe's example batch and the planner."""
    from trainlab.engine.sampler import micro_batch_size
    from trainlab.recipes import get_recipe

    recipe_cls = get_recipe(name)
    config = parse(recipe_cls.config_class, argv, prog=f"trainlab doctor {name}")
    recipe = recipe_cls(config)
    run = PlannedRun(
        device=config.device,
        run_dir=config.run_dir,
        num_workers=config.num_workers,
        processes=processes,
        keep_checkpoints=config.keep_checkpoints,
        precision=config.precision,
        data_root=_recipe_data_root(config),
    )
    try:
        micro = micro_batch_size(config.batch_size, config.grad_accumulation, processes)
    except UsageError as err:
        run.notes.append(
            Check("planned-run", "FAIL", f"recipe {name}: {err}", "change --batch-size or --nproc-per-node")
        )
        return run
    batch = recipe.example_batch(micro)
    run.batch_bytes = sum(t.numel() * t.element_size() for t in batch.values())
    detail = (
        f"recipe {name}: micro-batch {micro} x accumulation {config.grad_accumulation} x {processes} process(es) = "
        f"batch {config.batch_size}, {host.size(run.batch_bytes)} per micro-batch, precision {config.precision}"
    )
    try:
        run.checkpoint_bytes = checkpoint_bytes(recipe)
    except Exception as err:  # the planner builds the models: a missing weights file, an unsupported setting...
        run.size_unknown = "see planned-run"
        run.notes.append(
            Check(
                "planned-run",
                "WARN",
                detail + f"; the checkpoint size could not be planned ({first_line(err, 160)})",
                "pass what `trainlab train` would need (the error names it), so that the disk check can size the "
                "checkpoints",
            )
        )
        return run
    run.notes.append(
        Check(
            "planned-run",
            "PASS",
            detail + f"; one checkpoint about {host.size(run.checkpoint_bytes)} (planner)",
            values={"micro_batch": micro, "batch_bytes": run.batch_bytes, "checkpoint_bytes": run.checkpoint_bytes},
        )
    )
    return run


def cuda_intent(device: str, driver: DriverInfo, torch_count: int) -> CudaIntent:
    """'required' for --device cuda, and for auto where the driver lists GPUs; 'off' for cpu; else 'optional'."""
    if device == "cpu":
        return "off"
    if device.startswith("cuda"):
        return "required"
    return "required" if (driver.gpus or torch_count > 0) else "optional"


def gpu_section(intent: CudaIntent, driver: DriverInfo, run: PlannedRun) -> list[Check]:
    """`cuda`, CUDA_VISIBLE_DEVICES, and the per-GPU and multi-GPU checks (each skipped with the reason)."""
    import torch

    from trainlab.doctor import gpu as gpu_checks
    from trainlab.doctor.collective import probe_all_reduce

    torch_count = torch.cuda.device_count() if torch.version.cuda else 0
    usable, cuda = gpu_checks.cuda_usable(intent, torch.version.cuda, driver, torch_count)
    checks = [cuda]
    if not usable:
        skipped = gpu_checks.skipped_gpu_checks(
            "no usable GPU (see `cuda` above)" if intent != "off" else "--device cpu: GPU checks skipped"
        )
        if intent != "off" and driver.cuda is not None:
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            count = len(driver.gpus) if driver.gpus is not None else None
            skipped = [c for c in skipped if c.name != "cuda-visible-devices"]
            checks.append(gpu_checks.check_visible_devices(env, torch_count, count))
        return checks + skipped
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    checks.append(gpu_checks.check_visible_devices(env, torch_count, len(driver.gpus) if driver.gpus else None))
    arch_list = torch.cuda.get_arch_list()
    for facts in gpu_checks.gather_gpus():
        dtype = torch.bfloat16 if facts.capability >= (8, 0) else torch.float16
        checks += [
            gpu_checks.check_arch(facts, arch_list, torch.version.cuda),
            gpu_checks.check_precision(facts, run.precision),
            gpu_checks.check_sdpa(facts, gpu_checks.probe_sdpa(facts.index, dtype)),
            gpu_checks.check_cudnn_conv(facts, gpu_checks.probe_cudnn_conv(facts.index)),
            gpu_checks.check_memory(facts),
        ]
    checks.append(gpu_checks.check_processes(run.processes, torch_count))
    outcome = probe_all_reduce(torch_count, "nccl", NCCL_PROBE_TIMEOUT_S) if torch_count > 1 else None
    checks.append(gpu_checks.check_all_reduce(torch_count, outcome))
    return checks


def host_section(run: PlannedRun, device_type: str) -> list[Check]:
    demand = host.LoaderDemand(run.num_workers, run.processes, run.batch_bytes)
    cores, how = host.gather_cpus()
    soft, hard = host.gather_open_files()
    free, problem = host.gather_disk(run.run_dir)
    return [
        host.check_cpu_cores(cores, how, demand, device_type),
        host.check_shm(host.gather_shm(), demand),
        host.check_open_files(soft, hard, demand),
        host.check_disk(run.run_dir, free, problem, run.checkpoint_bytes, run.keep_checkpoints, run.size_unknown),
    ]


def run_checks(run: PlannedRun, data_root: Path | None, data_sample: int) -> list[Check]:
    """Every check, in the order they are printed."""
    import torch

    from trainlab.doctor.data import check_data
    from trainlab.doctor.versions import gather_driver, version_checks

    driver = gather_driver()
    torch_count = torch.cuda.device_count() if torch.version.cuda else 0
    intent = cuda_intent(run.device, driver, torch_count)
    checks = version_checks(driver, intent, run.processes)
    checks += gpu_section(intent, driver, run)
    checks += run.notes
    checks += host_section(run, "cuda" if intent == "required" else "cpu")
    if data_root is not None:
        cores, _ = host.gather_cpus()
        checks += check_data(data_root, data_sample, threads=min(8, cores))
    else:
        checks.append(Check("data-root", "SKIP", "no --data.root given"))
    return checks


def main(argv: list[str]) -> int:
    """Runs the doctor; `argv` excludes the program and subcommand names. Returns the exit code."""
    if argv and not argv[0].startswith("-"):
        name, rest = argv[0], argv[1:]
        if any(a in ("-h", "--help") for a in rest):
            print(__doc__)
            print(f"`trainlab train {name} --help` lists the recipe's flags.")
            return 0
        mine, rest = split_doctor_flags(rest)
        config = parse(DoctorConfig, mine, prog=f"trainlab doctor {name}", epilog=__doc__ or "")
        run = plan_from_recipe(name, rest, config.nproc_per_node)
    else:
        config = parse(DoctorConfig, argv, prog="trainlab doctor", epilog=__doc__ or "")
        run = PlannedRun(config.device, config.run_dir, config.num_workers, config.nproc_per_node)
    checks = run_checks(run, config.data_root or run.data_root, config.data_sample)
    if config.json:
        print(dumps_json(render_json(checks), indent=1, default=str))
    else:
        print(render_text(checks))
    return exit_code(checks)
