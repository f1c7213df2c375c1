"""Host checks: CPU cores vs loader workers, shared memory, the open-file limit, free disk for the checkpoints.

Each `check_*` judges plain numbers (so a test can hand it a 64 MiB `/dev/shm` or a full disk); `gather_*` read
them from this machine.

- **CPU cores.** The cores this process may use: its CPU affinity, capped by a container's CPU quota (cgroup v2
  `cpu.max`, v1 `cpu.cfs_quota_us`), which `os.cpu_count()` does not see. Each training process needs a core for
  its own loop and each loader worker one more: more than the usable cores makes them take turns.
- **Shared memory.** Loader workers hand batches to the training process through `/dev/shm`. At most
  `prefetch_factor` (2, PyTorch's default, which the engine keeps) batches per worker are in flight, plus the one
  being consumed, per process: processes x (workers x 2 + 1) x the bytes of one micro-batch. Containers default to a
  64 MiB `/dev/shm`, where the loader dies with a bus error mid-epoch.
- **Open files.** Each batch a worker shares holds file descriptors until it is consumed; many workers on a low
  soft limit end in "Too many open files" / "received 0 items of ancdata". Below 4096 with workers is a warning.
- **Disk.** A run keeps `--keep-checkpoints` saves (`ckpt/step_*.pt`; the newest is `last.pt` itself, a hard link),
  `best.pt`, and while saving one more file being written: (keep + 2) x the checkpoint, whose size is the planner's
  parameter, buffer and optimizer-state bytes (`trainlab.memory`).
"""

from __future__ import annotations

import math
import os
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

from trainlab.doctor.report import Check, Status
from trainlab.errors import UsageError, check_output_path

MIB, GIB = 2**20, 2**30
LOADER_PREFETCH = 2  # torch DataLoader's default prefetch_factor with workers; the engine's loader keeps it
OPEN_FILES_WANTED = 4096
OPEN_FILES_MINIMUM = 256
SMALL_DISK = 5 * GIB  # without a recipe to size the checkpoints: less free than this is worth a warning


def size(n: int | float) -> str:
    """Bytes as `1.50 GiB`, `64.0 MiB`, `512 B`."""
    if n >= GIB:
        return f"{n / GIB:,.2f} GiB"
    if n >= MIB:
        return f"{n / MIB:,.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:,.1f} KiB"
    return f"{int(n)} B"


@dataclass(frozen=True)
class LoaderDemand:
    """What the planned run asks of the host's loading resources.

    Attributes:
        num_workers: DataLoader workers per training process.
        processes: training processes on this machine (torchrun's --nproc-per-node).
        batch_bytes: one micro-batch as the loader yields it (the recipe's example batch at the micro-batch size);
            None without a recipe.
        prefetch_factor: batches in flight per worker.
    """

    num_workers: int
    processes: int = 1
    batch_bytes: int | None = None
    prefetch_factor: int = LOADER_PREFETCH

    @property
    def total_workers(self) -> int:
        return self.num_workers * self.processes

    def batches_in_shm(self) -> int:
        """Micro-batches that can sit in shared memory at once on this machine (0 without workers)."""
        if self.num_workers == 0:
            return 0
        return self.processes * (self.num_workers * self.prefetch_factor + 1)

    def shm_bytes(self) -> int | None:
        """Shared memory the loaders need at their fullest (None: the batch size is unknown)."""
        if self.num_workers == 0:
            return 0
        return None if self.batch_bytes is None else self.batches_in_shm() * self.batch_bytes


# ------------------------------------------------------------------------------------------------ CPU cores
def usable_cpus(affinity: int, cgroup_cpu_max: str | None) -> tuple[int, str]:
    """The cores this process can keep busy: its affinity, capped by a cgroup CPU quota.

    Args:
        affinity: CPUs in this process's affinity mask (`len(os.sched_getaffinity(0))`).
        cgroup_cpu_max: the cgroup v2 `cpu.max` text (`"200000 100000"`: 2 CPUs; `"max 100000"`: no quota), or None.

    Returns:
        (cores, how they were counted).
    """
    if cgroup_cpu_max:
        quota, _, period = cgroup_cpu_max.strip().partition(" ")
        if quota != "max":
            try:
                limit = max(1, math.ceil(int(quota) / int(period or "100000")))
            except ValueError:
                limit = 0
            if 0 < limit < affinity:
                return limit, f"container CPU quota {quota}/{period or '100000'} us (affinity: {affinity})"
    return affinity, "CPU affinity of this process"


def gather_cpus() -> tuple[int, str]:
    """`usable_cpus` of this process (cgroup v2, else v1 quota files)."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    text = None
    v2, v1 = Path("/sys/fs/cgroup/cpu.max"), Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    try:
        if v2.is_file():
            text = v2.read_text()
        elif v1.is_file():
            quota = int(v1.read_text())
            period = int((v1.parent / "cpu.cfs_period_us").read_text())
            text = f"{quota if quota > 0 else 'max'} {period}"
    except (OSError, ValueError):
        text = None
    return usable_cpus(affinity, text)


def check_cpu_cores(cores: int, how: str, demand: LoaderDemand, device_type: str) -> Check:
    """Training processes plus their loader workers against the usable cores."""
    wanted = demand.processes * (demand.num_workers + 1)
    detail = (
        f"{cores} usable ({how}); the run asks for {demand.processes} process(es) x ({demand.num_workers} loader "
        f"worker(s) + 1) = {wanted}"
    )
    values = {"cores": cores, "wanted": wanted, "num_workers": demand.num_workers, "processes": demand.processes}
    if wanted > cores:
        fit = max(0, cores // demand.processes - 1)
        if fit < demand.num_workers:
            fix = f"--num-workers {fit} (the processes take turns on the cores)"
        else:  # no workers to take away: the processes alone are more than the cores
            fix = f"--nproc-per-node {max(1, cores)} or fewer (one process per usable core at most)"
        return Check("cpu-cores", "WARN", detail, fix, values=values)
    if demand.num_workers == 0 and device_type == "cuda" and cores >= 2 * demand.processes:
        suggest = min(8, cores // demand.processes - 1)
        return Check(
            "cpu-cores",
            "WARN",
            detail + "; with 0 workers the training process loads and augments every batch while the GPU waits",
            f"--num-workers {suggest}",
            values=values,
        )
    return Check("cpu-cores", "PASS", detail, values=values)


# ------------------------------------------------------------------------------------------------ shared memory
def gather_shm(path: str = "/dev/shm") -> tuple[int, int] | None:
    """(total, free) bytes of the shared-memory file system, None where there is none."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.total, usage.free


def check_shm(space: tuple[int, int] | None, demand: LoaderDemand, path: str = "/dev/shm") -> Check:
    """Free shared memory against the loaders' batches in flight (see the module docstring)."""
    fix_size = "raise it: `docker run --shm-size=16g` (or `--ipc=host`), or `mount -o remount,size=16G /dev/shm`"
    if demand.num_workers == 0:
        found = "not present" if space is None else f"{size(space[1])} free of {size(space[0])}"
        return Check("shm", "PASS", f"{path} {found}; not used: the run has no loader workers")
    if space is None:
        return Check("shm", "FAIL", f"{path} is missing: loader workers cannot share batches", fix_size)
    total, free = space
    need = demand.shm_bytes()
    values = {"shm_total_bytes": total, "shm_free_bytes": free, "shm_needed_bytes": need}
    if need is None:
        detail = f"{path} {size(free)} free of {size(total)}; the batch size is unknown without a recipe"
        if free < GIB:
            return Check(
                "shm",
                "WARN",
                detail + " (under 1 GiB: a container's default is 64 MiB, where loader workers die with a bus error)",
                fix_size + "; or `trainlab doctor RECIPE ...` for the exact need",
                values=values,
            )
        return Check(
            "shm", "PASS", detail + ": `trainlab doctor RECIPE ...` compares it with the loader's need", values=values
        )
    assert demand.batch_bytes is not None
    detail = (
        f"{path} {size(free)} free of {size(total)}; the loaders need up to {demand.batches_in_shm()} micro-batches "
        f"of {size(demand.batch_bytes)} = {size(need)} ({demand.processes} process(es) x ({demand.num_workers} "
        f"workers x {demand.prefetch_factor} prefetched + 1))"
    )
    if need > free:
        per_worker = demand.processes * demand.prefetch_factor * demand.batch_bytes
        workers = max(0, (free - demand.processes * demand.batch_bytes) // max(per_worker, 1))
        return Check("shm", "FAIL", detail, f"{fix_size}; or --num-workers {workers}", values=values)
    if need > free // 2:
        return Check("shm", "WARN", detail + ": more than half of it", fix_size, values=values)
    return Check("shm", "PASS", detail, values=values)


# ------------------------------------------------------------------------------------------------ open files
def gather_open_files() -> tuple[int, int]:
    """(soft, hard) limit on open files of this process (`ulimit -n`, `ulimit -Hn`)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def check_open_files(soft: int, hard: int, demand: LoaderDemand) -> Check:
    """The soft open-file limit against what loader workers use (see the module docstring)."""
    unlimited = resource.RLIM_INFINITY
    shown = "unlimited" if soft == unlimited else str(soft)
    detail = f"soft limit {shown}, hard {'unlimited' if hard == unlimited else hard}"
    values = {"soft": soft, "hard": hard}
    if demand.num_workers == 0 or soft == unlimited or soft >= OPEN_FILES_WANTED:
        return Check("open-files", "PASS", detail, values=values)
    target = OPEN_FILES_WANTED * 16 if hard == unlimited else min(hard, OPEN_FILES_WANTED * 16)
    if target >= OPEN_FILES_WANTED:
        fix = f"`ulimit -n {target}` in the shell that starts the run"
    else:
        fix = "raise the hard limit: `docker run --ulimit nofile=65536:65536`, or nofile in /etc/security/limits.conf"
    status: Status = "FAIL" if soft < OPEN_FILES_MINIMUM else "WARN"
    detail += f": {demand.total_workers} loader workers share batches through file descriptors"
    return Check("open-files", status, detail + f" (wanted: {OPEN_FILES_WANTED})", fix, values=values)


# ------------------------------------------------------------------------------------------------ disk
def existing_ancestor(path: Path) -> Path:
    """`path` itself or its nearest existing parent (a run directory need not exist before the run)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def gather_disk(run_dir: Path) -> tuple[int, str]:
    """(free bytes, why it cannot be written or '') for the file system that will hold `run_dir`."""
    try:
        check_output_path("--run-dir", run_dir, is_dir=True)
        problem = ""
    except UsageError as err:
        problem = str(err)
    try:
        free = shutil.disk_usage(existing_ancestor(run_dir)).free
    except OSError:
        free = 0
    return free, problem


def checkpoint_disk_need(checkpoint_bytes: int, keep: int) -> int:
    """Disk a run's `ckpt/` takes at its fullest: `keep` saves, `best.pt` and a save being written."""
    return checkpoint_bytes * (keep + 2)


def check_disk(
    run_dir: Path, free: int, problem: str, checkpoint_bytes: int | None, keep: int, unknown: str = "no recipe given"
) -> Check:
    """Free disk under the run directory against the checkpoints the run keeps (see the module docstring).

    Args:
        run_dir: the run directory (need not exist).
        free: free bytes on its file system.
        problem: why it cannot be written ('' when it can).
        checkpoint_bytes: one checkpoint's size (None: unknown).
        keep: --keep-checkpoints.
        unknown: why the checkpoint size is unknown, when it is.
    """
    fix_place = "pass a --run-dir on a disk with room (`df -h`: rented servers often mount a larger data disk)"
    if problem:
        return Check("disk", "FAIL", problem, fix_place)
    values: dict[str, int | None] = {"free_bytes": free, "checkpoint_bytes": checkpoint_bytes}
    if checkpoint_bytes is None:
        detail = f"{size(free)} free under {run_dir}; checkpoint size unknown without a recipe"
        if free < SMALL_DISK:
            return Check(
                "disk", "WARN", detail, fix_place + "; or `trainlab doctor RECIPE ...` for the need", values=values
            )
        return Check("disk", "PASS", detail + " (`trainlab doctor RECIPE ...` compares them)", values=values)
    need = checkpoint_disk_need(checkpoint_bytes, keep)
    values["needed_bytes"] = need
    detail = (
        f"{size(free)} free under {run_dir}; the run's checkpoints take up to {size(need)} ((keep {keep} + best + "
        f"one being written) x {size(checkpoint_bytes)})"
    )
    if free < need:
        fewer = max(1, free // checkpoint_bytes - 2)
        fix = fix_place + (f", or --keep-checkpoints {fewer}" if fewer < keep and free >= 3 * checkpoint_bytes else "")
        return Check("disk", "FAIL", detail, fix, values=values)
    if free < 2 * need:
        return Check(
            "disk",
            "WARN",
            detail + ": less than twice that (logs, caches and other runs share it)",
            fix_place,
            values=values,
        )
    return Check("disk", "PASS", detail, values=values)
