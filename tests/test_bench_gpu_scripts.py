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


@pytest.mark.slow
def test_plan_gpu_measure_runs_each_configuration_in_its_own_process(
    tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    # bench_plan_gpu.py's measuring side on the CPU (the plumbing; the figures need CUDA): two stored plans of CIFAR
    # ResNet-18 at micro-batches 2 and 3 (of the stored 2, 3, 4: --rows leaves the next size out), each run through
    # --measure's code path in a fresh process
    plan = {"precision": "fp32", "peak_allocated_bytes": 1, "peak_reserved_bytes": 1, "overhead_bytes": 0}
    plan |= {"total_bytes": 1, "gpu_bytes": 2, "fits": True, "max_micro_batch": 3}
    plans = [{**plan, "micro_batch": m} for m in (2, 3, 4)]
    predicted = tmp_path / "predicted.json"
    predicted.write_text(json.dumps({"cases": {"cifar_r18": {"recipe": "cifar", "largest": 3, "plans": plans}}}))
    out = tmp_path / "measured.json"
    proc = subprocess.run(
        [python, str(BENCHMARKS / "bench_plan_gpu.py"), "measure", "--device", "cpu", "--cases", "cifar_r18",
         "--rows", "usual,largest", "--flags", "--deterministic true", "--predicted", str(predicted),
         "--work-dir", str(tmp_path / "work"),
         "--json", str(out)],
        env=run_env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["cases"]["cifar_r18"]
    assert [row["real"]["micro_batch"] for row in rows] == [2, 3]
    for row in rows:
        assert row["real"]["status"] == "ran", row["real"]
        assert row["real"]["memory_kind"] == "cpu_peak_rss_growth" and row["real"]["step_seconds"] > 0
    assert proc.stdout.count("ROW ") == 2  # each row in the log as it finishes
