"""`--activation-checkpointing` for the CNN recipes: per-stage recomputation gives the same loss, gradients and
BatchNorm statistics (running mean/var and num_batches_tracked updated exactly once)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainlab.cli import main
from trainlab.engine.recipe import StepInfo, TrainParts, apply_activation_checkpointing
from trainlab.engine.seeding import seed_everything
from trainlab.models.grad_checkpoint import checkpoint_stage
from trainlab.models.moco import MoCo
from trainlab.recipes.cifar import CifarConfig, CifarData, CifarRecipe
from trainlab.recipes.moco import MocoConfig, MocoRecipe

INFO = StepInfo(step=0, total_steps=10, steps_per_epoch=10, epoch=0, log_now=True)


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys() and expected
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


def _stage(momentum: float | None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8, momentum=momentum),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8, momentum=momentum),
    )


def _run_stage(momentum: float | None, how: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    stage = _stage(momentum).train()
    norms = [m for m in stage.modules() if isinstance(m, nn.BatchNorm2d)]
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    for _ in range(2):  # two steps: the second starts from updated statistics and a counter of 1
        if how == "plain":
            out = stage(x)
        elif how == "helper":
            out = checkpoint_stage(stage, x)
        else:
            out = checkpoint(stage, x, use_reentrant=False)
        out.square().mean().backward()
        x = x.detach().mul(1.5).add(0.25).requires_grad_()  # another batch: other statistics
    assert [m.momentum for m in norms] == [momentum, momentum]  # restored after the recompute
    return _buffers(stage), _grads(stage)


@pytest.mark.parametrize("momentum", [0.1, None])  # None: cumulative average, which reads num_batches_tracked
def test_checkpoint_stage_updates_batchnorm_statistics_once(momentum: float | None) -> None:
    buffers, grads = _run_stage(momentum, "plain")
    buffers_ckpt, grads_ckpt = _run_stage(momentum, "helper")
    _assert_same(buffers, buffers_ckpt)
    _assert_same(grads, grads_ckpt)
    assert int(buffers_ckpt["1.num_batches_tracked"]) == 2
    # the plain torch checkpoint counts the recompute as a second batch: what the helper is there to prevent
    buffers_naive, _ = _run_stage(momentum, "naive")
    assert int(buffers_naive["1.num_batches_tracked"]) == 4
    assert not torch.equal(buffers_naive["1.running_mean"], buffers["1.running_mean"])


def _build(recipe: CifarRecipe | MocoRecipe) -> TrainParts:
    """What the engine does: build, then switch activation checkpointing through `set_grad_checkpointing`."""
    parts = recipe.build(torch.device("cpu"))
    assert apply_activation_checkpointing(recipe, parts) == list(parts.models)
    return parts


def _cifar(tmp_path: Path, model: str, checkpointing: bool) -> CifarRecipe:
    data = CifarData(kind="fake", fake_size=64)
    config = CifarConfig(run_dir=tmp_path, model=model, data=data, activation_checkpointing=checkpointing)
    return CifarRecipe(config)


def _cifar_step(recipe: CifarRecipe) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    seed_everything(recipe.config.seed)
    parts = _build(recipe)
    model = parts.models["model"].train()
    assert model.grad_checkpointing == recipe.config.activation_checkpointing
    gen = torch.Generator().manual_seed(2)
    batch = {"image": torch.randn(8, 3, 32, 32, generator=gen), "label": torch.randint(0, 10, (8,), generator=gen)}
    loss = recipe.train_step(parts.models, batch, "main", INFO)["loss"]
    loss.backward()
    return loss.detach(), _grads(model), _buffers(model)


@pytest.mark.parametrize("model", ["cifar_resnet_debug", "cifar_vgg_debug"])
def test_cifar_checkpointing_gives_the_same_loss_gradients_and_statistics(tmp_path: Path, model: str) -> None:
    loss, grads, buffers = _cifar_step(_cifar(tmp_path, model, False))
    loss_ckpt, grads_ckpt, buffers_ckpt = _cifar_step(_cifar(tmp_path, model, True))
    assert torch.equal(loss, loss_ckpt)
    _assert_same(grads, grads_ckpt)
    _assert_same(buffers, buffers_ckpt)
    assert any(n.endswith("num_batches_tracked") and int(b) == 1 for n, b in buffers_ckpt.items())


@pytest.mark.parametrize("model", ["cifar_resnet_debug", "cifar_vgg_debug"])
def test_cifar_checkpointing_recomputes_in_training_only(tmp_path: Path, model: str) -> None:
    recipe = _cifar(tmp_path, model, True)
    net = _build(recipe).models["model"].train()
    x = torch.randn(2, 3, 32, 32)
    calls: list[int] = []
    first_bn = next(m for m in net.modules() if isinstance(m, nn.BatchNorm2d) and m is not getattr(net, "bn1", None))
    handle = first_bn.register_forward_hook(lambda *_: calls.append(1))
    net(x).sum().backward()
    assert len(calls) == 2  # forward, then the recompute in backward
    calls.clear()
    net.eval()
    net(x).sum().backward()
    assert len(calls) == 1
    handle.remove()


def _moco_step(
    tmp_path: Path, arch: str, checkpointing: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    base = MocoRecipe(MocoConfig()).debug_config()
    recipe = MocoRecipe(dataclasses.replace(base, run_dir=tmp_path, model=arch, activation_checkpointing=checkpointing))
    seed_everything(recipe.config.seed)
    moco = _build(recipe).models["moco"].train()
    assert isinstance(moco, MoCo)
    assert moco.base_encoder.grad_checkpointing == moco.momentum_encoder.grad_checkpointing == checkpointing
    first = moco.base_encoder.blocks[0] if moco.is_vit else moco.base_encoder.layer1[0].bn1
    calls: list[int] = []
    first.register_forward_pre_hook(lambda *_: calls.append(1))  # a forward hook misses early-stopped recomputes
    s = recipe.config.image_size
    gen = torch.Generator().manual_seed(3)
    batch = {"view1": torch.randn(8, 3, s, s, generator=gen), "view2": torch.randn(8, 3, s, s, generator=gen)}
    torch.manual_seed(1)
    loss = recipe.train_step({"moco": moco}, batch, "main", INFO)["loss"]
    loss.backward()
    return loss.detach(), _grads(moco), _buffers(moco), len(calls)


@pytest.mark.parametrize("arch", ["tv_resnet_debug", "moco_vit_debug"])
def test_moco_checkpointing_gives_the_same_loss_gradients_and_statistics(tmp_path: Path, arch: str) -> None:
    loss, grads, buffers, calls = _moco_step(tmp_path, arch, False)
    loss_ckpt, grads_ckpt, buffers_ckpt, calls_ckpt = _moco_step(tmp_path, arch, True)
    assert (calls, calls_ckpt) == (2, 4)  # two views; with checkpointing each is recomputed in backward
    assert torch.equal(loss, loss_ckpt)
    _assert_same(grads, grads_ckpt)
    _assert_same(buffers, buffers_ckpt)  # ViT: the projector's and predictor's BN (outside the blocks)


@pytest.mark.parametrize("model", ["cifar_resnet_debug", "cifar_vgg_debug"])
def test_the_planner_predicts_a_lower_peak_with_checkpointing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: str
) -> None:
    args = ["plan", "cifar", "--model", model, "--batch-size", "64", "--device", "cpu", "--run-dir", str(tmp_path)]
    assert main([*args, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--json", "--activation-checkpointing"]) == 0
    ckpt = json.loads(capsys.readouterr().out)
    assert ckpt["activations_bytes"] < plain["activations_bytes"] / 2
    assert ckpt["peak_allocated_bytes"] < plain["peak_allocated_bytes"]
    assert ckpt["parameters_bytes"] == plain["parameters_bytes"]
    assert ckpt["optimizer_states_bytes"] == plain["optimizer_states_bytes"]
    gpu = [a if a != "cpu" else "cuda" for a in args] + ["--gpu", "48GiB"]
    assert main(gpu) == 0  # the lever is offered, with its prediction, instead of refused
    text = capsys.readouterr().out
    assert "--activation-checkpointing (micro-batch" in text and "is not implemented" not in text
