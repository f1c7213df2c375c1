"""`trainlab bench precision` end to end on a debug model and a tiny CIFAR-format set: table, CSV, plots."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from trainlab.cli import main


def test_bench_two_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "precision", "--model", "cifar_vgg_debug", "--epochs", "2", "--data.kind", "fake",
            "--data.fake-size", "64", "--batch-size", "32", "--modes", "fp32", "bf16-amp", "--run-dir", str(out),
            "--num-workers", "0", "--log-every", "1",
            "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["precision"] for r in rows] == ["fp32", "bf16-amp"]
    for row in rows:
        assert 0 <= float(row["final_test_accuracy_pct_mean"]) <= 100
        assert float(row["peak_memory_mib_mean"]) > 0  # measured RSS, never typed in
        assert float(row["seconds_per_epoch_mean"]) > 0
    for name in ["loss_vs_step", "accuracy_vs_epoch", "memory", "time_per_epoch", "accuracy_vs_time"]:
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000
    assert "| fp32 |" in capsys.readouterr().out
    assert "first epoch excluded" in (out / "results.md").read_text()  # 2 epochs: the first is left out
    table = (out / "results.md").read_text()
    assert main(["report", str(out)]) == 0  # report after bench: the bench's report, updated in place
    assert not (out / "report").exists() and (out / "results.md").read_text() == table


def test_bench_refuses_invalid_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "precision", "--modes", "fp32-scale"]) == 2  # --modes takes a Literal: refused at parse time
    assert "argument --modes: invalid choice: 'fp32-scale'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--modes", "fp32", "fp32"], "--modes lists fp32 more than once"),
        (["--modes", "fp32", "--", "--precision", "fp16"], "change precision (fp32 -> fp16), which the bench sets"),
        (["--modes", "fp32", "--", "--seed", "3"], "change seed (0 -> 3)"),
        (["--modes", "fp32", "--", "--data-root", "elsewhere"], "change data ("),  # a former spelling too
    ],
)
def test_bench_refuses_what_would_mislabel_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    """A run labelled fp32 that trained in fp16, or one run counted as two seeds: refused before anything runs."""
    argv = ["bench", "precision", "--model", "cifar_vgg_debug", "--data.kind", "fake", "--device", "cpu"]
    assert main([*argv, "--run-dir", str(tmp_path / "b"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
