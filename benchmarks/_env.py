"""What every benchmark result records about where it ran, where results are written by default, and how a
`trainlab` run's own metrics are read back.

    from _env import environment, result_path, run_metrics, settings, write_result     # in benchmarks/bench_*.py

`environment()` goes into each JSON result under the key "environment": git SHA, date, Python / torch versions,
torch threads, CPU model and a machine description without the host name, plus the 1-minute load average (other
processes on the machine slow CPU timings). Call it after `torch.set_num_threads`, so that the thread count is the
one the benchmark used. The bench scripts import this module by its bare name: they are run as
`python benchmarks/bench_x.py`, which puts this folder first on `sys.path`.
"""

# Legend: none (no tensors are named here).

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from trainlab.engine.runinfo import git_sha

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_LOCATION_ARGS = ("json", "work_dir", "initial_weights")
_CPU_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def _cpuinfo() -> dict[str, str]:
    """First-processor fields of /proc/cpuinfo (Linux); empty elsewhere."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break  # end of the first processor's block
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def environment() -> dict[str, Any]:
    """The record of where and with what a benchmark ran (JSON-serialisable; no host name)."""
    os.environ.setdefault("GIT_OPTIONAL_LOCKS", "0")  # `git status` must not touch the index of a checkout in use
    cpu = _cpuinfo()
    flags = cpu.get("flags", "").split()
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_model": cpu.get("model name") or platform.processor() or platform.machine(),
        "cpu_mhz": cpu.get("cpu MHz", ""),
        "cpu_flags_of_note": [f for f in _CPU_FLAGS_OF_NOTE if f in flags],
        "machine": f"{platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} logical CPUs, "
        f"{_memory_gib()} GiB RAM",
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        env["cuda"] = str(torch.version.cuda)
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark's settings for its result: every argument except where outputs go (no machine paths)."""
    return {k: v for k, v in vars(args).items() if k not in _LOCATION_ARGS}


def result_path(json_arg: str, *parts: str) -> Path | None:
    """Where a benchmark writes its JSON result: `json_arg` itself, nothing for '', and for 'auto' the default
    `results/<parts joined by _>_<UTC date-time>.json`, named by what was measured.

    The time stamp keeps repeated runs apart; put what differed between runs (e.g. `--label idlemachine`) in
    `parts`, not a run number.
    """
    if json_arg != "auto":
        return Path(json_arg) if json_arg else None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = "_".join(p for p in parts if p)
    return RESULTS_DIR / f"{name}_{stamp}.json"


def write_result(path: Path | None, result: dict[str, Any]) -> None:
    """Write `result` (which holds an "environment" entry) as indented JSON, creating the folder."""
    if path is None:
        return
    assert "environment" in result, "every benchmark result records its environment"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


def run_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of a finished `trainlab train` run's metrics.jsonl, and its last `summary` row (the engine's timing of
    the training epochs after the first, images/s and peak memory)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, [row for row in rows if row["kind"] == "summary"][-1]
