"""Distributed helpers. In a single process (no torchrun env) nothing here creates a process group.

`init()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); everything else works with or without a
process group: `world_size()` is 1 and collectives are identities when none exists.

Errors under torchrun: a user error found by some ranks only (the run-dir lock and the checkpoint writes are rank
0's) would leave the other ranks waiting in their next collective. `raise_together` runs such a check on every rank
and raises the same one-line error on all of them, so every rank exits with the same code; the CLI prints the line
on rank 0 only and records it in torchrun's error file (`record_error_for_launcher`). `launch` is `trainlab
launch`: torchrun's own launcher, in-process, that exits with the workers' exit code instead of torchrun's
`ChildFailedError` traceback and exit code 1.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as torch_dist

from trainlab.errors import UsageError

log = logging.getLogger(__name__)

T = TypeVar("T")


def is_initialized() -> bool:
    """Whether a process group exists (False in a single process)."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return torch_dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return torch_dist.get_world_size() if is_initialized() else 1


def launched_rank() -> int:
    """This process's rank from torchrun's RANK (0 in a single process): valid before the process group exists and
    after it is destroyed (the CLI prints errors on rank 0 only)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def local_rank() -> int:
    """Rank on this machine, from torchrun's LOCAL_RANK (0 in a single process): picks the CUDA device."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """Whether this process writes outputs (rank 0)."""
    return rank() == 0


def launched_by_torchrun() -> bool:
    """Whether torchrun's environment (RANK, WORLD_SIZE) is set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(device_type: str) -> None:
    """Create the process group when launched by torchrun with WORLD_SIZE > 1; otherwise do nothing.

    The backend is chosen explicitly and logged: NCCL for CUDA, gloo for CPU.
    """
    if is_initialized() or not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return
    exit_with_parent()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank())
    torch_dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
    log.info("distributed: backend=%s rank=%d world_size=%d", backend, rank(), world_size())


def exit_with_parent() -> None:
    """Ask the kernel for SIGTERM when the launcher (torchrun) dies, so workers never train on as orphans: the
    SIGTERM handler then saves and exits like any preemption (Linux `prctl(PR_SET_PDEATHSIG)`; elsewhere logged)."""
    if not sys.platform.startswith("linux"):
        log.warning("cannot tie workers to the launcher's life on %s: kill orphaned workers yourself", sys.platform)
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    parent = os.getppid()
    if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): orphaned workers will not stop", ctypes.get_errno())
    elif os.getppid() != parent:  # the launcher died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


def cleanup(synchronize: bool = False) -> None:
    """Destroy the process group if there is one.

    `synchronize=True` (after a run every rank finished) first waits for every rank, so no rank tears down its
    transport while another is still saving or in a collective; after a failure it is skipped (a barrier could hang).
    """
    if not is_initialized():
        return
    if synchronize:
        torch_dist.barrier()
    gc.collect()  # release process-group references held by dropped DDP wrappers and pending work first
    torch_dist.destroy_process_group()


def raise_together(check: Callable[[], T]) -> T:
    """Run `check` on this rank; when it raised a user error (`UsageError`, `OSError`) on any rank, raise one on every
    rank, so that all ranks stop at the same point with the same exit code instead of waiting for a rank that left.

    Collective when a process group exists: every rank must call it at the same point. In one process it is just
    `check()`. The rank that failed re-raises its own exception; the others raise a `UsageError` with its message
    (prefixed with the rank when it is not rank 0) and its exit code. Other exceptions (bugs) propagate unshared.
    """
    failure: UsageError | OSError | None = None
    result: T | None = None
    try:
        result = check()
    except (UsageError, OSError) as err:
        if not (is_initialized() and world_size() > 1):
            raise
        failure = err
    if is_initialized() and world_size() > 1:
        mine = None if failure is None else (str(failure), int(getattr(failure, "exit_code", 2)))
        reports = all_gather_object(mine)
        failed = [(r, report) for r, report in enumerate(reports) if isinstance(report, tuple)]
        if failed:
            origin, report = failed[0]
            message, exit_code = str(report[0]), int(report[1])
            expect_launcher_stop(int(getattr(failure, "exit_code", 2)) if failure is not None else exit_code)
            if failure is not None:
                raise failure
            shared = UsageError(message if origin == 0 else f"rank {origin}: {message}")
            shared.exit_code = exit_code
            raise shared
    return result  # type: ignore[return-value]


def record_error_for_launcher(line: str) -> None:
    """Write `line` to torchrun's error file of this worker (TORCHELASTIC_ERROR_FILE, set by torchrun), in the format
    of torch.distributed.elastic's `ErrorHandler`: the launcher's failure summary then shows this one line as the
    worker's error instead of a link to the documentation. Nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError as err:  # the error itself was already printed; the summary then shows torchrun's own text
        log.warning("could not write torchrun's error file %s (%s)", path, err.strerror)


WORKER_EXIT_WAIT_S = 10.0  # how long a failed rank > 0 waits for the launcher to stop it after rank 0 left


def exit_failed_worker(exit_code: int) -> None:
    """Under torchrun, end this failed worker now with `exit_code` (after its error line was printed); else return.

    Every rank of a failed run must exit with the run's code, but torchrun stops the remaining workers with SIGTERM as
    soon as the first one exits, and a normal interpreter exit with torch loaded takes seconds. So rank 0 (the one
    that printed the line) leaves at once with `os._exit`; the other ranks turn the launcher's SIGTERM into the same
    exit code and wait for it (at most `WORKER_EXIT_WAIT_S`, then leave on their own).
    """
    if not launched_by_torchrun():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if launched_rank() != 0:
        expect_launcher_stop(exit_code)
        time.sleep(WORKER_EXIT_WAIT_S)
    os._exit(exit_code)


def expect_launcher_stop(exit_code: int) -> None:
    """Under torchrun, on ranks > 0 of a failed run: the launcher's SIGTERM (sent once rank 0 exited) ends this rank
    with `exit_code`. Called as soon as a rank knows it fails, before its clean-up, so rank 0 is always first out."""
    if launched_by_torchrun() and launched_rank() != 0:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(exit_code))


_NOT_FOR_LAUNCH = ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")


def launch(launcher_args: Sequence[str], command: Sequence[str]) -> int:
    """`trainlab launch [torchrun options] COMMAND ...`: torchrun's launcher (`torch.distributed.run`) runs
    `python -m trainlab COMMAND ...` in every worker, in this process, and returns the workers' exit code.

    Plain `torchrun` turns any worker's non-zero exit into a `ChildFailedError` traceback and exit code 1; here the
    first failed worker's exit code is returned as it is (2: a user error, whose one line rank 0 printed; 1: a
    diverged run or a crash, whose message the worker printed; 128 + N: a worker killed by signal N, said in one
    line). The launcher's own log lines about the failed worker are left out (the worker said what happened).

    Raises:
        UsageError: an option torchrun does not know, or one that names another program to run.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for flag in launcher_args:
        if flag.split("=")[0] in _NOT_FOR_LAUNCH:
            raise UsageError(f"{flag} names the program to run; `trainlab launch` always runs trainlab: drop it")
    parser = torchrun.get_args_parser()
    parser.prog = "trainlab launch"

    def refuse(message: str) -> None:
        raise UsageError(f"{message}; see `torchrun --help` for the launcher's options")

    parser.error = refuse  # type: ignore[method-assign, assignment]
    args = parser.parse_args([*launcher_args, "-m", "trainlab", *command])
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.run")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        torchrun.run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode
        print(
            f"trainlab launch: error: rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}",
            file=sys.stderr,
        )
        return 128 - failure.exitcode
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return 0


def barrier() -> None:
    """Wait for every rank (nothing in a single process)."""
    if is_initialized():
        torch_dist.barrier()


def all_reduce_mean(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Average scalar metrics over ranks (identity in one process)."""
    if not is_initialized() or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
    t /= world_size()
    return dict(zip(keys, t.tolist()))


def any_rank(flag: bool, device: torch.device) -> bool:
    """True if `flag` is true on any rank: lets all ranks agree to stop together (e.g. on SIGTERM)."""
    if not is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def broadcast_object(obj: object) -> object:
    """Send a picklable object from rank 0 to every rank."""
    if not is_initialized():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: object) -> list[object]:
    """Every rank's picklable `obj`, in rank order (`[obj]` in a single process)."""
    if not is_initialized():
        return [obj]
    gathered: list[object] = [None] * world_size()
    torch_dist.all_gather_object(gathered, obj)
    return gathered


def all_reduce_sum_(*tensors: torch.Tensor) -> None:
    """Sum each tensor over ranks, in place (nothing in a single process)."""
    if is_initialized() and world_size() > 1:
        for t in tensors:
            torch_dist.all_reduce(t)


def broadcast_(tensor: torch.Tensor, src: int = 0) -> None:
    """Overwrite `tensor` on every rank with rank `src`'s values, in place (nothing in a single process)."""
    if is_initialized() and world_size() > 1:
        torch_dist.broadcast(tensor, src=src)


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = [torch.zeros_like(x) for _ in range(world_size())]
        torch_dist.all_gather(out, x.contiguous())
        return tuple(out)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor) -> torch.Tensor:
        stacked = torch.stack(grads)
        torch_dist.all_reduce(stacked)
        return stacked[rank()]


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate `x` from every rank along dim 0; the gradient flows back to each rank's own slice."""
    if not is_initialized() or world_size() == 1:
        return x
    return torch.cat(_GatherWithGrad.apply(x), dim=0)


def all_gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate `x` from every rank along dim 0, without gradient (MoCo's keys); `x` itself in one process."""
    if not is_initialized() or world_size() == 1:
        return x
    with torch.no_grad():
        out = [torch.zeros_like(x) for _ in range(world_size())]
        torch_dist.all_gather(out, x.contiguous())
    return torch.cat(out, dim=0)


def gather_keys(k: torch.Tensor) -> tuple[torch.Tensor, int]:
    """MoCo's key gather: every rank's keys (no gradient) and this rank's offset into them (rank x batch)."""
    return all_gather_no_grad(k), rank() * k.shape[0]
