"""`trainlab eval knn` / `trainlab eval linear-probe` through `trainlab.cli.main` on debug-size digits: the metric
printed equals the one computed in process; bad input is one line with exit code 2; the linear probe leaves every
backbone weight and BatchNorm statistic untouched, and its first-epoch check catches a change."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from trainlab.cli import main
from trainlab.data.config import DataConfig
from trainlab.data.sources import eval_images
from trainlab.engine.loop import Trainer
from trainlab.models.moco import MoCo, official_checkpoint
from trainlab.recipes.linear_probe import LinearProbeConfig, LinearProbeRecipe, load_backbone
from trainlab.recipes.moco import MocoConfig, MocoRecipe, knn_of_features

SUBSET = 200


@pytest.fixture
def official_ckpt(tmp_path: Path) -> Path:
    """A main_moco.py-format checkpoint of a debug ResNet with non-default BN statistics (a few train-mode passes)."""
    torch.manual_seed(3)
    model = MoCo("tv_resnet_debug", dim=16, mlp_dim=32, temperature=0.2, image_size=16)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, 16, 16), torch.randn(8, 3, 16, 16))
    path = tmp_path / "checkpoint_0001.pth.tar"
    torch.save(official_checkpoint(model, epoch=1), path)
    return path


def _json_line(out: str) -> dict[str, object]:
    lines = [line for line in out.strip().splitlines() if line.startswith("{")]
    assert len(lines) == 1, out
    return dict(json.loads(lines[0]))


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_eval_knn_prints_the_in_process_accuracy(official_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["eval", "knn", "--moco-weights", str(official_ckpt), "--data.eval-limit", str(SUBSET), "--k", "20"]
    assert main([*args, "--image-size", "16"]) == 0
    printed = _json_line(capsys.readouterr().out)
    model, _ = load_backbone(str(official_ckpt), "tv_resnet_debug", 16)
    model.eval()
    images = eval_images(DataConfig(kind="digits", eval_limit=SUBSET), 16)
    expected = knn_of_features(
        model.features, images, device=torch.device("cpu"), batch_size=256, k=20, temperature=0.1
    )
    assert printed["knn_accuracy"] == expected
    assert printed["bank"] == SUBSET and printed["queries"] == SUBSET and printed["k"] == 20
    assert 0.1 < float(printed["knn_accuracy"]) <= 1.0  # type: ignore[arg-type]


def test_eval_knn_baselines_and_a_trainlab_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Raw pixels, the random-init encoder and a trainlab ckpt/last.pt: three different feature maps, three runs."""
    cfg = MocoRecipe(MocoConfig()).debug_config()
    cfg = dataclasses.replace(cfg, run_dir=tmp_path / "run", epochs=1, tensorboard=False, progress=False)
    Trainer(MocoRecipe(cfg)).fit()
    common = ["eval", "knn", "--data.eval-limit", str(SUBSET), "--k", "20"]
    results = {}
    for name, extra in {
        "pixels": ["--features", "pixels"],
        "random": ["--moco-weights", "", "--model", "tv_resnet_debug"],
        "trainlab": ["--moco-weights", str(tmp_path / "run" / "ckpt" / "last.pt")],
    }.items():
        assert main([*common, *extra]) == 0
        results[name] = _json_line(capsys.readouterr().out)
    assert results["pixels"]["features"] == "raw pixels"
    assert results["random"]["features"] == "random-init tv_resnet_debug"
    assert str(results["trainlab"]["features"]).startswith("tv_resnet_debug from ")
    pixels = eval_images(DataConfig(kind="digits", eval_limit=SUBSET), 16)
    expected = knn_of_features(
        lambda x: x.flatten(1), pixels, device=torch.device("cpu"), batch_size=256, k=20, temperature=0.1
    )
    assert results["pixels"]["knn_accuracy"] == expected


@pytest.mark.parametrize("command", ["knn", "linear-probe"])
def test_missing_checkpoint_is_one_line(tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.pth.tar"
    extra = ["--run-dir", str(tmp_path / "lp")] if command == "linear-probe" else []
    assert main(["eval", command, "--moco-weights", str(missing), *extra]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"checkpoint {missing} not found" in line


def test_k_larger_than_the_bank_is_one_line(official_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "knn", "--moco-weights", str(official_ckpt), "--data.eval-limit", "50", "--k", "51"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "k=51 must be between 1 and the bank size 50" in line


@pytest.mark.parametrize("command", ["knn", "linear-probe"])
def test_linear_probe_checkpoint_is_refused(
    tmp_path: Path, official_ckpt: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A main_lincls.py checkpoint (backbone + trained 10-way fc, best_acc1) where a pretraining one is expected."""
    state = torch.load(official_ckpt, weights_only=True)["state_dict"]
    prefix = "module.base_encoder."
    backbone = {"module." + k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix) and ".fc." not in k}
    backbone.update({"module.fc.weight": torch.zeros(10, 64), "module.fc.bias": torch.zeros(10)})
    lincls = tmp_path / "model_best.pth.tar"
    torch.save({"epoch": 90, "arch": "resnet18", "state_dict": backbone, "best_acc1": torch.tensor(55.0)}, lincls)
    extra = ["--run-dir", str(tmp_path / "lp")] if command == "linear-probe" else []
    assert main(["eval", command, "--moco-weights", str(lincls), *extra]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "linear-classification checkpoint (main_lincls.py format" in line and "best_acc1=55.00" in line


def test_eval_linear_probe_prints_final_accuracy(
    tmp_path: Path, official_ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "lp"
    args = ["eval", "linear-probe", "--moco-weights", str(official_ckpt), "--run-dir", str(run)]
    args += ["--data.train-limit", "256", "--data.eval-limit", "256"]
    args += ["--epochs", "2", "--batch-size", "64", "--tensorboard", "false", "--progress", "false"]
    args += ["--eval-every-epochs", "1"]
    assert main(args) == 0
    printed = _json_line(capsys.readouterr().out)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    accs = [r["test_accuracy"] for r in rows if r["kind"] == "eval"]
    assert len(accs) == 2
    assert printed["final_test_accuracy"] == accs[-1]
    assert printed["best_epoch_test_accuracy (chosen on the test set)"] == max(accs)
    assert str(printed["backbone"]).startswith("tv_resnet_debug from ")
    assert all(0.0 <= a <= 1.0 for a in accs)


def test_linear_probe_changes_no_backbone_weight_or_statistic(tmp_path: Path, official_ckpt: Path) -> None:
    """After the probe, every backbone tensor (weights, BN running mean / var, batch counters) equals the
    checkpoint's, although the classifier trained; and the recipe's first-epoch check fires on a changed statistic."""
    cfg = LinearProbeRecipe(LinearProbeConfig()).debug_config()
    cfg = dataclasses.replace(
        cfg, moco_weights=str(official_ckpt), run_dir=tmp_path / "lp", tensorboard=False, progress=False
    )
    recipe = LinearProbeRecipe(cfg)
    trainer = Trainer(recipe)
    classifier_before = trainer.parts.models["classifier"].weight.detach().clone()
    trainer.fit()
    saved = torch.load(official_ckpt, weights_only=True)["state_dict"]
    prefix = "module.base_encoder."
    expected = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
    backbone = trainer.parts.frozen["backbone"]
    after = {k[len("encoder.") :]: v for k, v in backbone.state_dict().items()}
    assert after.keys() == expected.keys()
    assert any(k.endswith("running_mean") and bool(v.abs().sum() > 0) for k, v in after.items())  # real statistics
    for key, value in after.items():
        assert torch.equal(value, expected[key]), key
    assert not backbone.training
    assert not torch.equal(trainer.parts.models["classifier"].weight, classifier_before)  # the probe did train

    # the check after the first epoch (the engine passes epochs completed): a moved BN statistic is caught
    with torch.no_grad():
        backbone.encoder.bn1.running_mean.add_(1e-3)  # type: ignore[union-attr, operator]
    with pytest.raises(AssertionError, match=r"backbone encoder\.bn1\.running_mean changed"):
        recipe.evaluate({**trainer.parts.models, **trainer.parts.frozen}, torch.device("cpu"), epoch=1)
