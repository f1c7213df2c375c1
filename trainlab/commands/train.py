"""`trainlab train RECIPE [--config file.yaml] [flags]`: flags are generated from the recipe's typed config.

`--grad-accumulation auto` (or `grad_accumulation: auto` in YAML) is resolved here, before the engine is built: the
memory planner traces the recipe on fake tensors and picks the smallest accumulation whose micro-batch fits the
device's free memory and divides the global batch; the integer is what the run uses and records in its config.
"Free memory" is `torch.cuda.mem_get_info` on CUDA (what is free after the CUDA context; the planner adds the
cuBLAS/cuDNN workspaces), and on CPU the RAM the OS reports available
(`psutil.virtual_memory().available`) against the planned peak of live tensor bytes (the Python process itself,
DataLoader workers and the allocator's slack are not counted on CPU). Under torchrun with more than one process
`auto` is refused: the processes would each read their own GPU and could disagree.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainlab import launcher
from trainlab.config import Auto, parse
from trainlab.engine.host_allocator import REUSE_HEADROOM, reuses_freed_memory
from trainlab.errors import UsageError
from trainlab.recipes import get_recipe, list_recipes

if TYPE_CHECKING:
    import torch

    from trainlab.engine.loop import FitResult
    from trainlab.engine.recipe import Recipe, TrainConfig

log = logging.getLogger(__name__)

AUTO_HELP = "the smallest accumulation whose micro-batch fits the device's free memory (planned by `trainlab plan`)"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def free_memory(device: torch.device) -> tuple[int, str]:
    """Bytes free for this run's tensors on `device`, and a description of what was measured."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device} per torch.cuda.mem_get_info"
    import psutil

    available = int(psutil.virtual_memory().available)
    if reuses_freed_memory():
        return int(available * REUSE_HEADROOM), (
            f"{REUSE_HEADROOM:.0%} of the RAM available per psutil (a CPU run; the rest is left to the host "
            "allocator's reuse heap, trainlab/engine/host_allocator.py)"
        )
    return available, "RAM available on this machine per psutil (a CPU run)"


def resolve_auto_accumulation(recipe_cls: type[Recipe[Any]], config: TrainConfig) -> int:
    """`--grad-accumulation auto`: the smallest accumulation whose micro-batch fits the device's free memory.

    Raises:
        UsageError: the device is neither CPU nor CUDA, or even micro-batch 1 does not fit (names the levers).
    """
    import torch

    from trainlab.engine.device import resolve_device
    from trainlab.memory.gpus import GpuProfile
    from trainlab.memory.planner import auto_accumulation
    from trainlab.memory.trace import PlanDevice

    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", launcher.local_rank())
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--grad-accumulation auto plans CPU or CUDA runs, not {device}; pass a number")
    processes = int(os.environ["WORLD_SIZE"]) if launcher.launched_by_torchrun() else 1
    if processes > 1:  # each process would read its own GPU's free memory and could pick a different number
        raise UsageError(
            f"--grad-accumulation auto runs in a single process only (this is one of {processes}); plan it with "
            f"`trainlab plan RECIPE ... --gpus {processes} --gpu NAME|GiB` and pass the --grad-accumulation it prints"
        )
    free, meaning = free_memory(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    capacity = GpuProfile(meaning, free, capability, context_bytes=0)  # free memory is counted after the context
    device_type: PlanDevice = "cuda" if device.type == "cuda" else "cpu"
    answer = auto_accumulation(recipe_cls(config), device_type, capacity, processes)
    log.info(
        "--grad-accumulation auto: micro-batch %d x accumulation %d x %d process(es) = global batch %d; predicted "
        "peak %s of %s (%s); largest micro-batch that fits: %d (%d traces)",
        answer.micro_batch,
        answer.grad_accumulation,
        processes,
        config.batch_size,
        _size(answer.predicted_bytes),
        _size(free),
        meaning,
        answer.largest_micro_batch,
        answer.traces,
    )
    return answer.grad_accumulation


def main(argv: list[str]) -> int:
    if not argv:
        raise UsageError(f"name a recipe: {', '.join(list_recipes())}; `trainlab train RECIPE --help` lists its flags")
    if argv[0] in ("-h", "--help"):
        print("usage: trainlab train RECIPE [--config file.yaml] [--field value ...]")
        print(f"recipes: {', '.join(list_recipes())}")
        print("`trainlab train RECIPE --help` lists every field of that recipe's config.")
        return 0
    return train(argv[0], argv[1:], prog=f"trainlab train {argv[0]}")


def train(
    name: str,
    argv: list[str],
    *,
    prog: str,
    report: Callable[[Recipe[Any], FitResult], None] | None = None,
    interrupted_code: int = 0,
) -> int:
    """Parse `argv` as recipe `name`'s config, then `--debug`'s check or a run; the one entry point of training
    (`trainlab train NAME` and its aliases, e.g. `trainlab eval linear-probe`). Returns the exit code.

    Args:
        name: the recipe.
        argv: its flags.
        prog: the command as the user typed it (usage and error lines).
        report: prints the result of a run that was not interrupted, on rank 0 (default: one line, `done: ...`).
        interrupted_code: the exit code after a stop signal (the run saved; the same command resumes it).
    """
    recipe_cls = get_recipe(name)
    auto: dict[str, Auto[Any]] = {
        "grad_accumulation": Auto(AUTO_HELP, lambda cfg: resolve_auto_accumulation(recipe_cls, cfg))
    }
    config = parse(recipe_cls.config_class, argv, prog=prog, auto=auto)
    recipe = recipe_cls(config)
    if config.debug:
        from trainlab.engine.debug import run_debug_check

        check = run_debug_check(recipe_cls, recipe, config.run_dir / "debug")
        print(check.line())
        return 0 if check.passed else 1

    from trainlab import dist
    from trainlab.engine.loop import Trainer

    is_main = True
    try:
        trainer = Trainer(recipe)
        result = trainer.fit()
        is_main = dist.is_main()  # read before cleanup(): afterwards every rank looks like rank 0
        del trainer  # its DDP wrappers hold the process group: drop them before it is destroyed
        dist.cleanup(synchronize=True)
    except (UsageError, OSError) as err:
        launcher.expect_launcher_stop(getattr(err, "exit_code", 2))  # under torchrun: every rank exits with this code
        raise
    except Exception:
        log.error("training failed; the last good checkpoint (if any) in %s/ckpt is untouched", config.run_dir)
        raise
    finally:
        dist.cleanup()
    if not is_main:
        return 0
    if result.status == "interrupted":
        print(
            f"{prog}: interrupted at step {result.step}; saved {config.run_dir}/ckpt/last.pt; run the same command "
            "again to resume",
            file=sys.stderr,
        )
        return interrupted_code
    (report or _report_done)(recipe, result)
    return 0


def _report_done(recipe: Recipe[Any], result: FitResult) -> None:
    summary = ", ".join(f"{k}={v:.4g}" for k, v in result.last_eval.items())
    print(
        f"done: {result.step} steps, {result.epoch} epochs{'; ' + summary if summary else ''}; run dir "
        f"{recipe.config.run_dir}"
    )
