"""Throughput of training: images/s, achieved TFLOP/s and MFU in the training rows, the summary, the progress lines
and the report; FLOPs counted on each epoch's first step only."""

# Legend: B batch, I input features, O output features.

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from trainlab.cli import main
from trainlab.engine import loop, throughput
from trainlab.engine.metrics import RunProgress, flops_rate
from trainlab.engine.precision import Precision
from trainlab.engine.throughput import DevicePeak, Throughput, compute_name, count_flops, device_peak
from trainlab.report.runs import summarize_run

TOY = ["train", "toy", "--num-samples", "64", "--batch-size", "16", "--tensorboard", "false", "--progress", "false"]


def _rows(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_counter_counts_forward_and_weight_gradient_products() -> None:
    B, I, O = 8, 16, 4
    layer = torch.nn.Linear(I, O, bias=False)
    x_BI = torch.randn(B, I)

    def step() -> None:
        layer(x_BI).sum().backward()

    _, flops = count_flops(step)
    assert flops == 2 * B * I * O + 2 * B * I * O  # forward product, weight gradient (the input needs none)


def test_rates_say_only_what_is_known() -> None:
    unknown = DevicePeak(None, "", "unknown peak")
    meter = Throughput(global_batch=64, peak=unknown, count=True)
    assert meter.rates(2.0) == {"images_per_second": 128.0}  # nothing counted yet
    meter.flops_per_step = 3 * 10**12
    assert meter.rates(2.0) == {"images_per_second": 128.0, "achieved_tflops": 6.0}
    meter.peak = DevicePeak(12e12, "X", "X peak")
    assert meter.rates(2.0)["mfu"] == pytest.approx(0.5)
    assert meter.rates(0.0) == {}
    meter.start_window(10)
    assert meter.window(14, 2.0)["images_per_second"] == pytest.approx(4 * 64 / 2.0)
    assert meter.window(14, 1.0) == {}  # no step since the last window


def test_compute_names_and_the_cpu_has_no_peak() -> None:
    assert compute_name(Precision.parse("bf16-amp")) == "bf16"
    assert compute_name(Precision.parse("fp16-amp-scale")) == "fp16"
    assert compute_name(Precision.parse("fp64")) == "fp64"
    assert compute_name(Precision.parse("fp32")) == "fp32"
    peak = device_peak(torch.device("cpu"), "fp32")
    assert peak.flops is None and "unknown peak" in peak.why


def test_training_logs_images_per_second_and_achieved_tflops(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main([*TOY, "--epochs", "2", "--log-every", "1", "--run-dir", str(run_dir)]) == 0
    rows = _rows(run_dir)
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 8
    for row in train:
        assert isinstance(row["images_per_second"], float) and row["images_per_second"] > 0
        assert isinstance(row["achieved_tflops"], float) and row["achieved_tflops"] > 0
        assert "mfu" not in row  # a CPU has no known peak
    summary = next(r for r in rows if r["kind"] == "summary")
    # toy: Linear(16 -> 32), ReLU, Linear(32 -> 4) on 16 samples: forward + weight gradients + the hidden gradient
    flops = 2 * 16 * (16 * 32 + 32 * 4) * 2 + 2 * 16 * 32 * 4
    assert summary["flops_per_step"] == flops
    per_step = summary["seconds_per_epoch"] / 4  # type: ignore[operator]
    assert summary["achieved_tflops"] == pytest.approx(flops / per_step / 1e12)
    assert summarize_run(run_dir)["achieved_tflops"] == summary["achieved_tflops"]


def test_flops_are_counted_on_the_first_step_and_at_most_every_recount_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = throughput.count_flops

    def counting(run):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(run)

    monkeypatch.setattr(throughput, "count_flops", counting)
    assert main([*TOY, "--epochs", "3", "--run-dir", str(tmp_path / "a")]) == 0
    assert len(calls) == 1  # 12 steps: the first only
    monkeypatch.setattr(throughput, "RECOUNT_STEPS", 6)
    assert main([*TOY, "--epochs", "5", "--run-dir", str(tmp_path / "b")]) == 0
    assert len(calls) == 1 + 4  # 5 epochs of 4 steps: steps 0, 6, 12 and 18 (each in a later epoch)
    meter = Throughput(global_batch=1, peak=DevicePeak(None, "", ""), count=True)
    meter._counted = (0, 0)
    assert not meter.due(0, 7) and meter.due(1, 6) and not meter.due(1, 5)  # a later epoch and 6 steps on


def test_mfu_where_the_peak_is_known(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "device_peak", lambda device, compute: DevicePeak(1e9, "FAKE", "FAKE peak"))
    run_dir = tmp_path / "run"
    assert main([*TOY, "--epochs", "1", "--log-every", "1", "--run-dir", str(run_dir)]) == 0
    rows = _rows(run_dir)
    train = [r for r in rows if r["kind"] == "train"]
    for row in [*train, next(r for r in rows if r["kind"] == "summary")]:
        assert row["mfu"] == pytest.approx(row["achieved_tflops"] * 1e12 / 1e9)  # type: ignore[operator]


def test_progress_lines_show_the_flop_rate_and_mfu(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    meter = Throughput(global_batch=10, peak=DevicePeak(4e12, "X", "X"), count=True)
    meter.flops_per_step = 10**12
    bar = RunProgress(
        4, 0, 10, enabled=True, log_every=2, is_tty=False, clock=lambda: now[0], rates=meter.rates
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="trainlab.progress"):
        now[0] = 1.0
        bar.update(2, {"loss": 1.0})
    line = caplog.records[-1].getMessage()
    assert "| 20 images/s | 2 TFLOP/s | MFU 50.0% |" in line


def test_flop_rates_are_written_in_a_readable_unit() -> None:
    assert flops_rate(3.21) == "3.21 TFLOP/s"
    assert flops_rate(0.412) == "412 GFLOP/s"
    assert flops_rate(2e-6) == "2 MFLOP/s"
