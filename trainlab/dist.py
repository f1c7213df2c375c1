"""Distributed helpers. In a single process (no torchrun env) nothing here creates a process group.

`init()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); everything else works with or without a
process group: `world_size()` is 1 and collectives are identities when none exists.

Errors under torchrun: a user error found by some ranks only (the run-dir lock and the checkpoint writes are rank
0's) would leave the other ranks waiting in their next collective. `raise_together` runs such a check on every rank
and raises the same one-line error on all of them, so every rank exits with the same code; the CLI prints the line
on rank 0 only and records it in torchrun's error file (`trainlab.launcher`, which reads torchrun's environment
without importing torch, and runs `trainlab launch`).

Named failures instead of silent hangs and cryptic errors:
- Timeouts. The training collectives (DDP's gradient all-reduce, the metric and stop-flag reductions) run in the
  main process group with the run's `--dist-timeout` (default 300 s, below NCCL's own 10 minutes). Waits on work that
  rank 0 does alone (an evaluation, a checkpoint write, a cache build) go through a gloo side group with the long
  timeout `LONG_WAIT_S`: `barrier(what)` and the object collectives (`raise_together` included). A barrier that times
  out names the ranks that did not arrive (`monitored_barrier`), and a training collective that times out asks every
  rank to answer once more and names those that do not (`raise_named`): `StuckRanks`, one line. (Under NCCL a
  timed-out collective is ended by NCCL's watchdog, which reports the collective and the rank that timed out.)
- Parameters without a gradient. With `find_unused_parameters=False` DDP fails one step later with "Expected to have
  finished reduction in the prior iteration ..." and does not say which parameters. `unused_parameters` names them
  after the first backward (the engine calls it at each phase's first step), and `raise_named` translates the
  PyTorch error, should it still happen, into the same line: `unused_parameters_line`.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainlab.errors import TrainingStopped, UsageError
from trainlab.launcher import (
    expect_launcher_stop,
    launched_by_torchrun,
    local_rank,
    stray_launch_variables,
    torchrun_variable,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
LONG_WAIT_S = 1800.0  # waits on rank 0's own work (evaluation, checkpoint writes, caches): the former group timeout
STUCK_PROBE_S = 60.0  # after a timed-out collective: how long the ranks that are still alive wait for the others
UNUSED_SHOWN = 8  # parameter names quoted in the one-line message
_monitor: torch_dist.ProcessGroup | None = None  # the gloo side group (long timeout, monitored barriers)
_background: torch_dist.ProcessGroup | None = None  # background checkpoint writes' own gloo group (made on first use)
_timeout_s = LONG_WAIT_S


class StuckRanks(TrainingStopped):
    """Some ranks did not reach a collective in time (stuck, or dead): one line naming them."""


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


def init(device_type: str, timeout_s: float = LONG_WAIT_S) -> None:
    """Create the process group when launched by torchrun with WORLD_SIZE > 1; otherwise do nothing.

    The backend is chosen explicitly and logged: NCCL for CUDA, gloo for CPU. Collectives of the main group give up
    after `timeout_s`; a gloo side group with the long timeout serves barriers and object collectives (see the module
    docstring).
    """
    global _monitor, _timeout_s
    if is_initialized():
        return
    if not launched_by_torchrun():
        stray = stray_launch_variables()
        if os.environ.get("WORLD_SIZE", "1").strip() != "1" and stray:  # one process would train as if it were many
            raise UsageError(
                f"{' and '.join(stray)} are set, but not MASTER_ADDR / MASTER_PORT: no launcher started this process; "
                "unset them to train in one process, or start it with `trainlab launch` (torchrun)"
            )
        return
    world, rank_here = torchrun_variable("WORLD_SIZE"), torchrun_variable("RANK")
    if world == 1:
        return
    if not rank_here < world:
        raise UsageError(f"the environment says RANK={rank_here} of WORLD_SIZE={world}; launch with torchrun")
    exit_with_parent()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank())
    torch_dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    _timeout_s = timeout_s
    side = torch_dist.new_group(backend="gloo", timeout=timedelta(seconds=max(LONG_WAIT_S, timeout_s)))
    _monitor = side if isinstance(side, torch_dist.ProcessGroup) else None
    log.info(
        "distributed: backend=%s rank=%d world_size=%d (collectives time out after %g s)",
        backend,
        rank(),
        world_size(),
        timeout_s,
    )


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
    global _monitor, _background
    if not is_initialized():
        return
    if synchronize:
        barrier("the end of the run")
    gc.collect()  # release process-group references held by dropped DDP wrappers and pending work first
    torch_dist.destroy_process_group()
    _monitor = _background = None


def side_group() -> torch_dist.ProcessGroup | None:
    """The gloo side group (long timeout) for work that waits on files, e.g. a checkpoint's collectives; None in a
    single process."""
    return _monitor if is_initialized() else None


def background_group() -> torch_dist.ProcessGroup | None:
    """A gloo group of its own for collectives run by a background thread (a checkpoint written while training goes
    on: they must not interleave with the main thread's on another group). Made on the first call, which must be
    collective (every rank at the same point); None in a single process."""
    global _background
    if not is_initialized():
        return None
    if _background is None:
        group = torch_dist.new_group(backend="gloo", timeout=timedelta(seconds=max(LONG_WAIT_S, _timeout_s)))
        _background = group if isinstance(group, torch_dist.ProcessGroup) else None
    return _background


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


def barrier(what: str = "a barrier", timeout_s: float | None = None) -> None:
    """Wait for every rank (nothing in a single process); after `timeout_s` (default `LONG_WAIT_S`) stop with a
    `StuckRanks` line naming the ranks that did not arrive at `what`."""
    if not is_initialized():
        return
    if _monitor is None:
        torch_dist.barrier()
        return
    wait = LONG_WAIT_S if timeout_s is None else timeout_s
    try:
        torch_dist.monitored_barrier(group=_monitor, timeout=timedelta(seconds=wait), wait_all_ranks=True)
    except RuntimeError as err:
        raise StuckRanks(_stuck_line(str(err), what, wait)) from None


def _stuck_line(message: str, what: str, waited_s: float) -> str:
    """One line from a failed monitored barrier: rank 0 learns which ranks are missing, the others that rank 0
    gave up (or is itself the one missing)."""
    found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    if found:
        ranks = [int(r) for r in re.findall(r"\d+", found.group(1))]
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world_size()}"
        return (
            f"{who} did not reach {what} within {waited_s:g} s (stuck in a collective or a data loader, or dead): "
            "their log lines ([rank N]) say where; every rank stops, the last checkpoint is kept; resume with the "
            "same command (raise --dist-timeout if that rank was only slow)"
        )
    return (
        f"rank {rank()} stopped waiting at {what} after {waited_s:g} s: rank 0 did not answer (see rank 0's log); "
        "the last checkpoint is kept; resume with the same command"
    )


def raise_named(err: RuntimeError, wrapped: Mapping[str, nn.Module], step: int) -> None:
    """Raise a one-line error for a failure the engine can explain (else return, and the caller re-raises `err`):
    DDP's "Expected to have finished reduction" (naming the parameters), or a collective that timed out (naming
    the ranks that no longer answer)."""
    message = str(err)
    if "Expected to have finished reduction" in message:
        names = _parameters_from_ddp_error(message, wrapped)
        raise UsageError(unused_parameters_line(names, step=step, ddp=True)) from None
    if is_initialized() and world_size() > 1 and ("Timed out" in message or "timed out" in message):
        log.error("a collective timed out at step %d after %g s: asking every rank to answer", step, _timeout_s)
        barrier(
            f"optimizer step {step} (a collective timed out after {_timeout_s:g} s)", min(STUCK_PROBE_S, _timeout_s)
        )
        raise StuckRanks(
            f"a collective of optimizer step {step} timed out after {_timeout_s:g} s, yet every rank answered "
            "afterwards: one rank was slower than --dist-timeout (a long first compile, a slow disk); raise "
            "--dist-timeout and resume with the same command"
        ) from None


def ddp_parameter_names(module: DistributedDataParallel) -> list[str]:
    """The names of a DDP module's parameters in the order of DDP's reducer (the indices its errors quote):
    module by module (`named_modules`), each module's own parameters that require gradients, shared ones once."""
    ignored = set(getattr(module, "parameters_to_ignore", ()))
    names, seen = [], set()
    for module_name, sub in module.module.named_modules():
        for param_name, p in sub.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if p.requires_grad and full not in ignored and id(p) not in seen:
                seen.add(id(p))
                names.append(full)
    return names


def _parameters_from_ddp_error(message: str, wrapped: Mapping[str, nn.Module]) -> list[str]:
    """The parameter names DDP's error quotes (by name under TORCH_DISTRIBUTED_DEBUG, else by index)."""
    by_name = re.search(r"Parameters which did not receive grad for rank \d+: ([^\n]+)", message)
    if by_name:
        return [n.strip() for n in by_name.group(1).split(",") if n.strip()]
    by_index = re.search(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)", message)
    ddp: list[tuple[str, DistributedDataParallel]] = []
    for model_name, module in wrapped.items():
        inner = getattr(module, "_orig_mod", module)  # under torch.compile
        if isinstance(inner, DistributedDataParallel):
            ddp.append((model_name, inner))
    if not by_index or len(ddp) != 1:
        return []
    model_name, ddp_module = ddp[0]
    order = ddp_parameter_names(ddp_module)
    indices = [int(i) for i in by_index.group(1).split()]
    return [f"{model_name}.{order[i]}" for i in indices if i < len(order)]


def unused_parameters(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the parameters whose gradient is None after a backward on any rank (collective when a process
    group exists: every rank calls it at the same step with the same parameters)."""
    if not named:
        return []
    missing = [p.grad is None for _, p in named]
    if is_initialized() and world_size() > 1:
        flags = torch.tensor(missing, dtype=torch.float32, device=named[0][1].device)
        torch_dist.all_reduce(flags, op=torch_dist.ReduceOp.MAX)
        missing = [bool(f) for f in flags.tolist()]
    return [name for (name, _), m in zip(named, missing) if m]


def unused_parameters_line(names: Sequence[str], *, step: int, ddp: bool) -> str:
    """The one line that names parameters without a gradient and the two fixes."""
    shown = ", ".join(names[:UNUSED_SHOWN]) + (
        f" and {len(names) - UNUSED_SHOWN} more" if len(names) > UNUSED_SHOWN else ""
    )
    what = f"parameters that received no gradient at step {step + 1}: {shown or 'not named by PyTorch'}"
    if ddp:
        consequence = "DDP cannot finish its gradient reduction ('Expected to have finished reduction')"
    else:
        consequence = "under torchrun DDP would stop at the next step ('Expected to have finished reduction')"
    return (
        f"{what}; {consequence}: remove them from the model (or make the loss use them), or pass "
        "--ddp-find-unused-parameters (slower: DDP then searches the graph every step)"
    )


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
    """Send a picklable object from rank 0 to every rank (on the side group: the others may wait for rank 0's
    evaluation as long as `LONG_WAIT_S`)."""
    if not is_initialized():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=0, group=_monitor)
    return box[0]


def all_gather_object(obj: object) -> list[object]:
    """Every rank's picklable `obj`, in rank order (`[obj]` in a single process; on the side group)."""
    if not is_initialized():
        return [obj]
    gathered: list[object] = [None] * world_size()
    torch_dist.all_gather_object(gathered, obj, group=_monitor)
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
