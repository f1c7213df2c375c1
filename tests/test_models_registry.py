"""One model registry with unique names: every network a recipe or command builds by name is registered once, the
config vocabularies list exactly the registered families, former names still parse (with a warning) but name no
network, every model builds, and the activation-checkpointing switch is one method the engine calls."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from trainlab.config import parse
from trainlab.engine.recipe import TrainParts, apply_activation_checkpointing
from trainlab.errors import UsageError
from trainlab.models.grad_checkpoint import set_grad_checkpointing, supports_grad_checkpointing
from trainlab.models.moco import MoCo
from trainlab.models.names import (
    CIFAR_MODELS,
    FORMER_CIFAR_NAMES,
    FORMER_MOCO_BACKBONES,
    FORMER_VQVAE_NAMES,
    MOCO_BACKBONES,
    VQVAE_NAMES,
)
from trainlab.models.registry import create_model, list_models
from trainlab.models.var.transformer import VAR, VARConfig
from trainlab.recipes.cifar import CifarConfig
from trainlab.recipes.linear_probe import LinearProbeConfig
from trainlab.recipes.moco import MocoConfig
from trainlab.recipes.tokenizer import TokenizerConfig
from trainlab.recipes.toy import ToyConfig, ToyRecipe
from trainlab.recipes.var import VARTrainConfig

# Shape legend: B batch, K classes.

FAMILIES = {"cifar_": CIFAR_MODELS, "tv_resnet": (), "moco_vit_": (), "vqvae_": VQVAE_NAMES, "digit_judge": ()}
SMALL_KWARGS = {  # debug-size models that run a forward pass on the CPU in milliseconds, with their input side
    "cifar_resnet_debug": ({}, 32),
    "cifar_vgg_debug": ({}, 32),
    "tv_resnet_debug": ({"num_classes": 10}, 16),
    "moco_vit_debug": ({"num_classes": 10, "image_size": 16}, 16),
    "digit_judge": ({}, 16),
}


def test_the_config_vocabularies_list_exactly_the_registered_families() -> None:
    assert set(list_models("cifar_")) == set(CIFAR_MODELS)
    assert set(list_models("tv_resnet")) | set(list_models("moco_vit_")) == set(MOCO_BACKBONES)
    assert set(list_models("vqvae_")) == set(VQVAE_NAMES)
    every = list_models()
    assert every == sorted(set(every))
    assert all(sum(name.startswith(prefix) for prefix in FAMILIES) == 1 for name in every), every


def test_former_names_map_to_registered_ones_and_name_no_network_themselves() -> None:
    for former in (FORMER_CIFAR_NAMES, FORMER_MOCO_BACKBONES, FORMER_VQVAE_NAMES):
        assert set(former.values()) <= set(list_models())
        assert not set(former) & set(list_models())  # `resnet_debug` names nothing: no name means two networks


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_builds(name: str) -> None:
    with torch.device("meta"):  # the real sizes (ViT-Base, ResNet-50, the official VQVAE) without their memory
        model = create_model(name)
    assert isinstance(model, nn.Module) and sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("name", sorted(SMALL_KWARGS))
def test_debug_models_run_a_forward_pass_on_the_cpu(name: str) -> None:
    kwargs, side = SMALL_KWARGS[name]
    torch.manual_seed(0)
    model = create_model(name, **kwargs).eval()
    logits_BK = model(torch.rand(2, 3, side, side) * 2 - 1)
    assert logits_BK.shape == (2, 10) and bool(logits_BK.isfinite().all())


def test_unknown_names_are_usage_errors() -> None:
    with pytest.raises(UsageError, match=r"unknown model 'resnet_debug'; choose one of: .*cifar_resnet_debug"):
        create_model("resnet_debug")


def test_tv_resnet50_is_torchvisions_network() -> None:
    """Same seed, same init, same outputs: the registry's `tv_resnet50` is torchvision's ResNet-50 (MoCo v3 builds
    it with zero-initialised residual BNs), with timm's backbone interface added."""
    torch.manual_seed(0)
    ours = create_model("tv_resnet50", num_classes=7, zero_init_residual=True).eval()
    torch.manual_seed(0)
    theirs = torchvision.models.resnet50(num_classes=7, zero_init_residual=True).eval()
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    x_B3HW = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(ours(x_B3HW), theirs(x_B3HW))
        pooled_BF = ours.forward_head(ours.forward_features(x_B3HW), pre_logits=True)  # type: ignore[operator]
    assert pooled_BF.shape == (2, 2048)


def test_the_two_cifar_stem_resnet18s_are_two_named_networks() -> None:
    """kuangliu's `cifar_resnet18` (PyTorch's default init) and `tv_resnet18_cifar` (torchvision's): the same stem
    and layout, different classes and initialisation, so two names."""
    torch.manual_seed(0)
    kuangliu = create_model("cifar_resnet18")
    torch.manual_seed(0)
    tv = create_model("tv_resnet18_cifar", num_classes=10)
    assert type(kuangliu) is not type(tv)
    assert kuangliu.conv1.weight.shape == tv.conv1.weight.shape == (64, 3, 3, 3)
    assert not torch.equal(kuangliu.conv1.weight, tv.conv1.weight)  # Kaiming fan-out vs PyTorch's default


# ------------------------------------------------------------------------------------- activation checkpointing
@pytest.mark.parametrize("name", [*CIFAR_MODELS, *MOCO_BACKBONES])
def test_backbones_and_cifar_models_switch_activation_checkpointing(name: str) -> None:
    with torch.device("meta"):
        model = create_model(name)
    assert supports_grad_checkpointing(model)
    assert set_grad_checkpointing(model, True) and model.grad_checkpointing
    assert set_grad_checkpointing(model, False) and not model.grad_checkpointing


def test_var_and_moco_switch_it_and_other_models_say_they_cannot() -> None:
    var = VAR(VARConfig.debug())
    moco = MoCo("tv_resnet_debug", dim=16, mlp_dim=32, image_size=16)
    assert set_grad_checkpointing(var, True) and var.grad_checkpointing
    assert set_grad_checkpointing(moco, True)
    assert moco.base_encoder.grad_checkpointing and moco.momentum_encoder.grad_checkpointing
    for name in ("vqvae_debug", "digit_judge"):
        assert not set_grad_checkpointing(create_model(name), True)
    assert not set_grad_checkpointing(nn.Linear(2, 2), True)


def test_the_engine_switches_it_and_refuses_it_for_models_without(tmp_path: Path) -> None:
    recipe = ToyRecipe(ToyConfig(run_dir=tmp_path, activation_checkpointing=True))
    parts = TrainParts(models={"model": create_model("cifar_vgg_debug")}, phases=[])
    assert apply_activation_checkpointing(recipe, parts) == ["model"]
    assert parts.models["model"].grad_checkpointing
    with pytest.raises(UsageError, match=r"--activation-checkpointing is not implemented by recipe 'toy'"):
        apply_activation_checkpointing(recipe, recipe.build(torch.device("cpu")))
    off = ToyRecipe(dataclasses.replace(recipe.config, activation_checkpointing=False))
    assert apply_activation_checkpointing(off, off.build(torch.device("cpu"))) == []  # off: nothing to refuse


# ------------------------------------------------------------------------------------------- former spellings
@pytest.mark.parametrize(
    ("cls", "argv", "field", "expected", "former"),
    [
        (CifarConfig, ["--model", "vgg_debug"], "model", "cifar_vgg_debug", "'vgg_debug' is the former spelling"),
        (MocoConfig, ["--arch", "vit_small"], "model", "moco_vit_small", "--arch is the former spelling of --model"),
        (LinearProbeConfig, ["--arch", "resnet50"], "model", "tv_resnet50", "--arch is the former spelling"),
        (VARTrainConfig, ["--tokenizer-config", "official"], "tokenizer_model", "vqvae_official", "--tokenizer-config"),
        (
            TokenizerConfig,
            ["--vqvae-preset", "digits", "--discriminator-layers", "2"],
            "model",
            "vqvae_digits",
            "--vqvae-preset",
        ),
    ],
)
def test_former_architecture_flags_and_values_parse_with_a_warning(
    cls: type,
    argv: list[str],
    field: str,
    expected: str,
    former: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        config = parse(cls, [*argv, "--run-dir", str(tmp_path)], prog="t")
    assert getattr(config, field) == expected
    assert former in caplog.text


def test_former_architecture_yaml_keys_and_values_load_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("arch: resnet_debug\ndata: digits\nimage_size: 16\n")
    with caplog.at_level(logging.WARNING):
        config = parse(MocoConfig, ["--config", str(path)], prog="t")
    assert config.model == "tv_resnet_debug"
    assert "'arch' is the former name of 'model'" in caplog.text
    assert "'resnet_debug' is the former spelling of 'tv_resnet_debug'" in caplog.text
