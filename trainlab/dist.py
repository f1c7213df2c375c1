"""Distributed helpers. In a single process (no torchrun env) nothing here creates a process group.

`init()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); everything else works with or without a
process group: `world_size()` is 1 and collectives are identities when none exists.

Errors under torchrun: a user error found by some ranks only (the run-dir lock and the checkpoint writes are rank
0's) would leave the other ranks waiting in their next collective. `raise_together` runs such a check on every rank
and raises the same one-line error on all of them, so every rank exits with the same code; the CLI prints the line
on rank 0 only and records it in torchrun's error file (`trainlab.launcher`, which reads torchrun's environment
without importing torch, and runs `trainlab launch`).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as torch_dist

from trainlab.errors import UsageError
from trainlab.launcher import expect_launcher_stop, launched_by_torchrun, local_rank

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


def is_main() -> bool:
    """Whether this process writes outputs (rank 0)."""
    return rank() == 0


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
