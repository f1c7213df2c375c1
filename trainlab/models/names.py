"""The registry names a config may select, per role, as `Literal`s (no torch import: command configs use them).

Each tuple is checked against the registry by the tests (every name is registered, and every registered name of the
family is listed). The `FORMER_*` maps take the names used before the registry had unique names to the current ones
(accepted with a warning until the next release: `option(..., deprecated_values=FORMER_CIFAR_NAMES)`).
"""

from __future__ import annotations

from typing import Literal, get_args

CifarModel = Literal[
    "cifar_resnet18",
    "cifar_resnet34",
    "cifar_resnet50",
    "cifar_resnet_debug",
    "cifar_vgg11",
    "cifar_vgg13",
    "cifar_vgg16",
    "cifar_vgg19",
    "cifar_vgg_debug",
]
"""kuangliu's CIFAR ResNets / VGGs (3x3 stem, PyTorch's default init): the CIFAR recipe's `--model`."""
CIFAR_MODELS: tuple[str, ...] = get_args(CifarModel)
FORMER_CIFAR_NAMES: dict[str, str] = {name.removeprefix("cifar_"): name for name in CIFAR_MODELS}

MocoBackbone = Literal[
    "tv_resnet50",
    "tv_resnet18_cifar",
    "tv_resnet_debug",
    "moco_vit_small",
    "moco_vit_base",
    "moco_vit_conv_small",
    "moco_vit_conv_base",
    "moco_vit_debug",
]
"""The backbones of MoCo v3: torchvision's ResNets and MoCo v3's ViTs (`--model` of moco, linear-probe, eval knn)."""
MOCO_BACKBONES: tuple[str, ...] = get_args(MocoBackbone)
FORMER_MOCO_BACKBONES: dict[str, str] = {
    "resnet50": "tv_resnet50",
    "resnet18_cifar": "tv_resnet18_cifar",
    "resnet_debug": "tv_resnet_debug",
    "vit_small": "moco_vit_small",
    "vit_base": "moco_vit_base",
    "vit_conv_small": "moco_vit_conv_small",
    "vit_conv_base": "moco_vit_conv_base",
    "vit_debug": "moco_vit_debug",
}

ModelFamily = Literal["transformer", "small-transformer", "convnet", "small-convnet"]
"""How well a model fills a GPU, for the planner's assumed efficiency (`memory.efficiency.ASSUMED`): large
transformer blocks, small ones, ImageNet-size convnets, CIFAR-size (and toy / debug) convnets."""
MOCO_BACKBONE_FAMILY: dict[str, ModelFamily] = {
    "tv_resnet50": "convnet",
    "tv_resnet18_cifar": "small-convnet",
    "tv_resnet_debug": "small-convnet",
    "moco_vit_small": "small-transformer",
    "moco_vit_base": "transformer",
    "moco_vit_conv_small": "small-transformer",
    "moco_vit_conv_base": "transformer",
    "moco_vit_debug": "small-transformer",
}
"""The family of each MoCo backbone (every name of `MOCO_BACKBONES`)."""

VQVAEName = Literal["vqvae_official", "vqvae_digits", "vqvae_debug"]
"""VAR's multi-scale VQVAE architectures (the tokenizer recipe's `--model`, VAR's `--tokenizer-model`)."""
VQVAE_NAMES: tuple[str, ...] = get_args(VQVAEName)
FORMER_VQVAE_NAMES: dict[str, str] = {"official": "vqvae_official", "digits": "vqvae_digits", "debug": "vqvae_debug"}
