"""The CIFAR recipe on the real loading code (a small CIFAR-format set the test writes): resume, workers, errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from trainlab.cli import main
from trainlab.config import load_yaml, parse
from trainlab.engine.debug import run_debug_check
from trainlab.engine.loop import Trainer
from trainlab.recipes.cifar import CifarConfig, CifarData, CifarRecipe

REPO = Path(__file__).resolve().parents[1]


def _cfg(run_dir: Path, **kw: object) -> CifarConfig:
    base = CifarConfig(
        run_dir=run_dir,
        model="cifar_resnet_debug",
        data=CifarData(kind="fake", fake_size=96),
        batch_size=16,
        epochs=2,
        log_every=1,
        eval_batch_size=64,
        optim=dataclasses.replace(CifarConfig().optim, learning_rate=0.05),
        tensorboard=False,
        progress=False,
        seed=1,
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_debug_mode_passes_with_batchnorm_and_augmentation(tmp_path: Path) -> None:
    report = run_debug_check(CifarRecipe, CifarRecipe(_cfg(tmp_path)), tmp_path / "debug")
    assert report.passed, report.line()


def test_resume_with_workers_matches_straight_run(tmp_path: Path) -> None:
    straight = Trainer(CifarRecipe(_cfg(tmp_path / "a", num_workers=0)))
    losses = straight.fit().losses
    first = Trainer(CifarRecipe(_cfg(tmp_path / "b", num_workers=2)))
    part1 = first.fit(stop_at_step=7).losses
    second = Trainer(CifarRecipe(_cfg(tmp_path / "b", num_workers=2, resume="auto")))
    part2 = second.fit().losses
    assert part1 + part2 == losses  # same augmentation whatever the worker count or resume point
    for k, v in straight.parts.models["model"].state_dict().items():
        assert torch.equal(v, second.parts.models["model"].state_dict()[k]), k


def test_accuracy_rises_above_chance(tmp_path: Path) -> None:
    data = CifarData(kind="fake", fake_size=256)
    result = Trainer(CifarRecipe(_cfg(tmp_path, data=data, epochs=3, batch_size=32))).fit()
    assert result.last_eval["test_accuracy"] > 0.3  # 10 classes: chance is 0.1


def test_missing_data_root_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "cifar", "--data.root", str(tmp_path / "nowhere"), "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert "CIFAR-10 not found" in err[-1] and "--data.download" in err[-1]


def test_unknown_model_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "cifar", "--model", "resnet9000", "--run-dir", str(tmp_path)]) == 2
    assert "argument --model: invalid choice: 'resnet9000'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["cifar_vgg19.yaml", "cifar_resnet18.yaml"])
def test_shipped_configs_parse(name: str) -> None:
    path = REPO / "trainlab" / "configs" / name
    cfg = parse(CifarConfig, ["--config", str(path)], prog="t")
    assert cfg.epochs == 200 and cfg.model == load_yaml(path)["model"]
