"""One all-reduce across `world` fresh processes, with a deadline: does the collective backend really work here?

`probe_all_reduce(world, "nccl")` starts one process per GPU (the way torchrun would), each joins a process group
through a file store, sums a tensor of its rank + 1 and checks the total; a rank that has not answered by the
deadline is named as hung (what a broken NCCL set-up does: no error, just no progress). Tests run it with gloo on the
CPU.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as torch_dist

from trainlab.errors import first_line


def _rank_main(rank: int, world: int, backend: str, store: str, timeout_s: float, results: mp.Queue) -> None:
    """One rank of the probe (runs in a spawned process)."""
    try:
        device = torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        torch_dist.init_process_group(
            backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        values = torch.full((1024,), float(rank + 1), device=device)
        torch_dist.all_reduce(values)
        expected = world * (world + 1) / 2
        got = float(values[0])
        torch_dist.destroy_process_group()
        results.put((rank, "" if got == expected and bool((values == expected).all()) else f"sum {got} != {expected}"))
    except Exception as err:
        results.put((rank, first_line(err, 160)))


def probe_all_reduce(world: int, backend: str = "nccl", timeout_s: float = 60.0) -> tuple[bool, str]:
    """Run one all-reduce over `world` new processes.

    Args:
        world: processes (one per GPU for NCCL).
        backend: "nccl" (GPUs) or "gloo" (CPU).
        timeout_s: the deadline for the whole probe, start-up included; also the process group's timeout.

    Returns:
        (ok, one line: what happened, naming the ranks that failed or hung).
    """
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trainlab-doctor-") as folder:
        store = str(Path(folder) / "store")
        processes = [
            context.Process(target=_rank_main, args=(r, world, backend, store, timeout_s, results), daemon=True)
            for r in range(world)
        ]
        for p in processes:
            p.start()
        answers: dict[int, str] = {}
        deadline = start + timeout_s
        while len(answers) < world and time.monotonic() < deadline:
            try:
                rank, error = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                answers[rank] = error
            except queue.Empty:
                if all(not p.is_alive() for p in processes) and results.empty():
                    break
        for p in processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    elapsed = time.monotonic() - start
    silent = [r for r in range(world) if r not in answers]
    failed = {r: e for r, e in answers.items() if e}
    if not silent and not failed:
        return True, f"{backend} all-reduce over {world} processes: correct sum in {elapsed:.1f} s"
    parts = []
    if failed:
        first = min(failed)
        parts.append(f"rank(s) {', '.join(map(str, sorted(failed)))} failed (rank {first}: {failed[first]})")
    if silent:
        parts.append(f"rank(s) {', '.join(map(str, silent))} did not finish within {timeout_s:g} s (hung or died)")
    return False, f"{backend} all-reduce over {world} processes: " + "; ".join(parts)
