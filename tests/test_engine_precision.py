"""Precision modes: parsing, refusals, every valid mode trains on CPU, BatchNorm stays fp32, overflow skips."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from trainlab.engine.loop import Trainer
from trainlab.engine.precision import PRECISION_MODES, LossScaler, Precision, grad_norm_
from trainlab.errors import UsageError
from trainlab.recipes.toy import ToyConfig, ToyRecipe


def test_parse_modes() -> None:
    assert Precision.parse("fp32").autocast_dtype is None
    p = Precision.parse("bf16-amp-scale")
    assert (p.param_dtype, p.autocast_dtype, p.scaling) == (torch.float32, torch.bfloat16, "dynamic")
    p = Precision.parse("fp16-scale")
    assert (p.param_dtype, p.autocast_dtype, p.scaling) == (torch.float16, None, "static")
    p = Precision.parse("bf16")
    assert (p.param_dtype, p.scaling) == (torch.bfloat16, "none")


@pytest.mark.parametrize(
    "bad", ["fp32-scale", "bf16-scale", "fp32-amp", "fp64-amp", "fp64-scale", "fp8", "fp16-amp-scale-x", ""]
)
def test_invalid_combinations_refused(bad: str) -> None:
    with pytest.raises(UsageError) as err:
        Precision.parse(bad)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode", PRECISION_MODES)
def test_every_mode_trains_two_steps(mode: str, tmp_path: Path) -> None:
    cfg = ToyConfig(
        run_dir=tmp_path,
        precision=mode,
        num_samples=32,
        batch_size=16,
        hidden=8,
        epochs=1,
        grad_accumulation=2,
        log_every=1,
        tensorboard=False,
        progress=False,
    )
    result = Trainer(ToyRecipe(cfg)).fit()
    assert result.step == 2
    assert all(math.isfinite(x) for x in result.losses)


def test_fp64_builds_trains_and_logs_in_float64_and_restores_the_default_dtype(tmp_path: Path) -> None:
    """The reference mode: weights, data and the logged loss in float64 (BatchNorm included), nothing left behind."""
    cfg = ToyConfig(run_dir=tmp_path, precision="fp64", num_samples=32, batch_size=16, epochs=1, tensorboard=False)
    trainer = Trainer(ToyRecipe(cfg))
    assert all(p.dtype == torch.float64 for p in trainer.parts.models["model"].parameters())
    assert trainer.train_dataset[0]["input"].dtype == torch.float64  # generated in float64, not cast from fp32
    assert torch.get_default_dtype() == torch.float32
    result = trainer.fit()
    assert torch.get_default_dtype() == torch.float32
    assert result.step == 2 and float(torch.tensor(result.losses[0], dtype=torch.float32)) != result.losses[0]
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    Precision.parse("fp64").prepare_model(model)  # keep_batchnorm_fp32 is for 16-bit modes only
    assert model[1].weight.dtype == model[1].running_var.dtype == torch.float64


def test_pure_modes_keep_batchnorm_fp32() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    Precision.parse("bf16").prepare_model(model)
    assert model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32 and model[1].running_mean.dtype == torch.float32
    out = model(torch.randn(2, 3, 8, 8, dtype=torch.bfloat16))  # mixed BN runs on CPU
    assert out.dtype == torch.bfloat16
    model2 = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    Precision.parse("fp16").prepare_model(model2, keep_batchnorm_fp32=False)
    assert model2[1].weight.dtype == torch.float16


def test_static_scale_skips_on_overflow_and_reports_it() -> None:
    layer = nn.Linear(4, 1).half()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = LossScaler(Precision.parse("fp16-scale"), "cpu", static_scale=1024.0)
    before = layer.weight.detach().clone()
    loss = layer(torch.full((2, 4), 60000.0, dtype=torch.float16)).float().sum() * 100
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    _, finite = grad_norm_(layer.parameters(), 1.0)
    assert not finite
    assert scaler.step(opt, finite) is False
    assert torch.equal(layer.weight, before)


def test_static_scale_unscales_exactly() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 1)
    x = torch.randn(3, 4)
    layer(x).sum().backward()
    reference = layer.weight.grad.clone()
    layer.zero_grad()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = LossScaler(Precision.parse("fp16-scale"), "cpu", static_scale=1024.0)
    scaler.scale(layer(x).sum()).backward()
    scaler.unscale_(opt)
    torch.testing.assert_close(layer.weight.grad, reference)


def test_grad_norm_without_grads_is_zero_float() -> None:
    layer = nn.Linear(2, 2)
    norm, finite = grad_norm_(layer.parameters(), 1.0)
    assert norm == 0.0 and finite


def test_accumulation_with_fp16_scaler_never_crashes(tmp_path: Path) -> None:
    """Regression: the VAR code's grad_norm was None with accumulation 2 + fp16 GradScaler and `.item()` crashed."""
    cfg = ToyConfig(
        run_dir=tmp_path,
        precision="fp16-amp-scale",
        num_samples=32,
        batch_size=8,
        hidden=8,
        epochs=1,
        grad_accumulation=2,
        clip_grad_norm=1.0,
        log_every=1,
        tensorboard=False,
        progress=False,
    )
    Trainer(ToyRecipe(cfg)).fit()
    import json

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 4
    for row in train:
        assert isinstance(row["grad_norm"], float)
        assert math.isfinite(row["grad_norm"]) or row["skipped"] == 1.0


def test_scheduler_advances_once_per_optimizer_step(tmp_path: Path) -> None:
    from trainlab.engine.schedule import ScheduleConfig, lr_factor

    schedule = ScheduleConfig(kind="cosine", warmup_fraction=0.25)
    cfg = ToyConfig(
        run_dir=tmp_path,
        num_samples=64,
        batch_size=16,
        grad_accumulation=4,
        epochs=2,
        log_every=1,
        schedule=schedule,
        optim=dataclasses.replace(ToyConfig().optim, learning_rate=0.2),
        tensorboard=False,
        progress=False,
    )
    Trainer(ToyRecipe(cfg)).fit()
    import json

    lrs = [
        json.loads(x)["lr"]
        for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if json.loads(x)["kind"] == "train"
    ]
    assert len(lrs) == 8
    expected = [0.2 * lr_factor(schedule, s, 8) for s in range(8)]
    assert lrs == pytest.approx(expected, rel=1e-12)


def test_cuda_request_without_cuda_is_usage_error(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    cfg = dataclasses.replace(ToyConfig(run_dir=tmp_path), device="cuda")
    with pytest.raises(UsageError, match="CUDA is not available"):
        Trainer(ToyRecipe(cfg))


def test_memory_snapshot_needs_cuda(tmp_path: Path) -> None:
    cfg = ToyConfig(run_dir=tmp_path, device="cpu", memory_snapshot=str(tmp_path / "snap.pickle"))
    with pytest.raises(UsageError, match="needs a CUDA device"):
        Trainer(ToyRecipe(cfg))
