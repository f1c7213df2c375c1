"""benchmarks/bench_gpu.py, the GPU measurements of the speed issue: its commands, their parsing and its result file,
run at toy sizes on the CPU (`--smoke`). The measurements themselves need a CUDA device."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from trainlab.engine.precision_names import LAB_PRECISIONS

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal is for machines without CUDA")
def test_refuses_to_report_cpu_numbers_as_gpu_ones(python: str, run_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [python, str(BENCH), "--json", ""], env=run_env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode != 0
    assert "needs CUDA" in proc.stderr and "--smoke" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_smoke_run_measures_every_section(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    out = tmp_path / "result.json"
    subprocess.run(
        [python, str(BENCH), "--smoke", "--device", "cpu", "--json", str(out)],
        env=run_env,
        check=True,
        capture_output=True,
        timeout=900,
    )
    result = json.loads(out.read_text())
    assert result["config"]["smoke"] is True and "git_sha" in result["environment"]
    train, sample, precision = (result["results"][k] for k in ("var_train", "var_sample", "precision"))
    for mode in ("bf16-amp", "fp16-amp-scale"):
        run = train[mode]
        assert f"--precision {mode}" in run["command"] and "$WORK" in run["command"]
        assert run["images_per_second"] > 0 and run["peak_memory_gib"] > 0 and run["skipped_steps"] >= 0
        assert run["seconds_per_step"] == pytest.approx(2 / run["images_per_second"])
    assert sample["steady_images_per_second"] > 0
    assert {"tokens", "decode"} <= set(sample["runs"]["2_batches"]["phases_s"])
    assert set(precision["modes"]) == set(LAB_PRECISIONS)  # all eight training modes
    assert all(m["images_per_second"] > 0 for m in precision["modes"].values())
