"""`trainlab train --grad-accumulation auto`: the planner picks the smallest accumulation whose micro-batch fits the
free memory (monkeypatched here) and divides the global batch; the integer is what --print-config and the run's
config.yaml show."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from trainlab.cli import main
from trainlab.commands import train as train_command
from trainlab.memory.breakdown import breakdown
from trainlab.memory.planner import smallest_accumulation
from trainlab.memory.trace import trace_training
from trainlab.recipes.toy import ToyConfig, ToyRecipe

BATCH = 32
TOY = ["toy", "--num-samples", "64", "--batch-size", str(BATCH), "--hidden", "256", "--device", "cpu"]


def _planned_peak(micro: int, accumulation: int) -> int:
    recipe = ToyRecipe(ToyConfig(num_samples=64, batch_size=BATCH, hidden=256, device="cpu"))
    run = trace_training(recipe, device="cpu", micro_batch=micro, grad_accumulation=accumulation)
    return breakdown(run).peak_reserved_bytes


def _free(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    def fake(device: torch.device) -> tuple[int, str]:
        assert device.type == "cpu"
        return nbytes, "test memory"

    monkeypatch.setattr(train_command, "free_memory", fake)


def _printed_accumulation(capsys: pytest.CaptureFixture[str], *extra: str) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *TOY, *extra, "--print-config"])
    assert exit_info.value.code == 0
    value = yaml.safe_load(capsys.readouterr().out)["grad_accumulation"]
    assert isinstance(value, int)
    return value


def test_smallest_accumulation_divides_the_batch() -> None:
    assert smallest_accumulation(32, 32) == 1
    assert smallest_accumulation(32, 31) == 2
    assert smallest_accumulation(24, 10) == 3  # micro-batch 8
    assert smallest_accumulation(24, 5) == 6  # 24 / 5 does not divide: micro-batch 4
    assert smallest_accumulation(7, 6) == 7  # a prime batch: micro-batch 1
    with pytest.raises(ValueError):
        smallest_accumulation(8, 0)


def test_auto_keeps_the_whole_batch_when_it_fits(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _free(monkeypatch, _planned_peak(BATCH, 1))
    assert _printed_accumulation(capsys, "--grad-accumulation", "auto") == 1


@pytest.mark.parametrize(("micro", "expected"), [(16, 2), (8, 4)])
def test_auto_picks_the_smallest_accumulation_that_fits(
    micro: int, expected: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fits = _planned_peak(micro, 2)
    assert fits < _planned_peak(2 * micro, 2) and fits < _planned_peak(BATCH, 1)  # the premise: the next size is larger
    _free(monkeypatch, fits)
    assert _printed_accumulation(capsys, "--grad-accumulation", "auto") == expected
    _free(monkeypatch, fits - 1)  # one byte less: micro-batch `micro` no longer fits
    assert _printed_accumulation(capsys, "--grad-accumulation", "AUTO") == 2 * expected


def test_auto_in_yaml_and_recorded_in_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _free(monkeypatch, _planned_peak(8, 2))
    config = tmp_path / "auto.yaml"
    config.write_text("grad_accumulation: auto\nmax_steps: 2\ntensorboard: false\nprogress: false\n")
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO", logger="trainlab.commands.train"):
        assert main(["train", *TOY, "--config", str(config), "--run-dir", str(run_dir)]) == 0
    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert recorded["grad_accumulation"] == 4 and recorded["batch_size"] == BATCH
    line = next(r.getMessage() for r in caplog.records if "--grad-accumulation auto" in r.getMessage())
    assert "micro-batch 8 x accumulation 4" in line and "predicted peak" in line and "test memory" in line


def test_auto_that_cannot_fit_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _free(monkeypatch, 1024)
    assert main(["train", *TOY, "--grad-accumulation", "auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "even micro-batch 1 needs" in err and "--precision bf16-amp" in err


def test_other_words_are_still_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *TOY, "--grad-accumulation", "many"]) == 2
    assert "expected int, got 'many'" in capsys.readouterr().err


def test_help_documents_auto(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "toy", "--help"])
    assert "(default: 1); auto: the smallest accumulation whose micro-batch fits" in " ".join(
        capsys.readouterr().out.split()
    )


def test_auto_is_refused_with_several_processes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _free(monkeypatch, 2**40)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)  # a torchrun worker's environment
    assert main(["train", *TOY, "--grad-accumulation", "auto"]) == 2  # main() returns; only the program entry exits
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "single process only" in err and "--gpus 2" in err
