"""benchmarks/bench_gpu_debug.py and bench_gpu_constants.py, the GPU check scripts: the debug matrix's plumbing on the
CPU (`--smoke`: toy, fp32) and the constants script's plan and its refusal without CUDA. The checks need a GPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_debug_smoke_records_a_pass(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [python, str(BENCHMARKS / "bench_gpu_debug.py"), "--smoke", "--json", str(out)],
        env=run_env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert "git_sha" in result["environment"] and result["complete"] is True
    [row] = result["runs"]
    assert row["status"] == "PASS", row
    assert row["command"].startswith("trainlab train toy --debug --device cpu --precision fp32 --run-dir $WORK/")
    assert row["debug_line"].startswith("debug PASS")
    assert "PASS 1" in proc.stdout


def test_constants_dry_run_prints_the_plan(python: str, run_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [python, str(BENCHMARKS / "bench_gpu_constants.py"), "--dry-run"],
        env=run_env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    for step in ("context", "cublas", "cudnn", "sdpa", "fused_adamw", "nccl"):
        assert step in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal is for machines without CUDA")
def test_constants_refuses_without_cuda(python: str, run_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [python, str(BENCHMARKS / "bench_gpu_constants.py"), "--json", ""],
        env=run_env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr
