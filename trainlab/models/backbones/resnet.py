"""MoCo v3's ResNet backbones: torchvision ResNets with `zero_init_residual=True` (facebookresearch/moco-v3).

- `resnet50`: torchvision's ResNet-50 (ImageNet stem), exactly as main_moco.py builds it.
- `resnet18_cifar`: ResNet-18 with the CIFAR stem (3x3 stride-1 first convolution, no max-pool) for 32 px images.
- `resnet_debug`: the CIFAR-stem ResNet-18 layout with one basic block per stage and widths 8-16-32-64 (CPU tests).

All keep torchvision's key names (`conv1.weight`, `layer1.0.bn1.weight`, `fc.weight`), the names of the official
checkpoints. Shape legend: B batch, C channels, H/W pixels, D feature width.
"""

from __future__ import annotations

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet, resnet18, resnet50

from trainlab.models.checkpointing import checkpoint_stage

RESNET_ARCHS = ("resnet50", "resnet18_cifar", "resnet_debug")
_DEBUG_WIDTHS = (8, 16, 32, 64)


def _cifar_stem(model: ResNet, width: int) -> None:
    model.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()


def make_resnet(arch: str, *, num_classes: int) -> ResNet:
    """Build `arch` (one of `RESNET_ARCHS`) with a `num_classes`-way `fc` and zero-initialised residual BNs."""
    if arch == "resnet50":
        return resnet50(num_classes=num_classes, zero_init_residual=True)
    if arch == "resnet18_cifar":
        model = resnet18(num_classes=num_classes, zero_init_residual=True)
        _cifar_stem(model, 64)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        return model
    assert arch == "resnet_debug", arch
    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes, zero_init_residual=True)
    # Rebuild the stages narrower with torchvision's own builder, so the key names stay torchvision's.
    widths = _DEBUG_WIDTHS
    model.inplanes = widths[0]
    _cifar_stem(model, widths[0])
    model.bn1 = nn.BatchNorm2d(widths[0])
    model.layer1 = model._make_layer(BasicBlock, widths[0], 1)
    model.layer2 = model._make_layer(BasicBlock, widths[1], 1, stride=2)
    model.layer3 = model._make_layer(BasicBlock, widths[2], 1, stride=2)
    model.layer4 = model._make_layer(BasicBlock, widths[3], 1, stride=2)
    model.fc = nn.Linear(widths[3], num_classes)
    for m in model.modules():  # torchvision's init, for the rebuilt modules
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    for m in model.modules():
        if isinstance(m, BasicBlock) and m.bn2.weight is not None:
            nn.init.zeros_(m.bn2.weight)
    return model


def resnet_features(encoder: ResNet, x_BCHW: torch.Tensor) -> torch.Tensor:
    """The backbone features (B, D): the globally pooled last stage, before the projector (`fc`)."""
    x = encoder.maxpool(encoder.relu(encoder.bn1(encoder.conv1(x_BCHW))))
    x = encoder.layer4(encoder.layer3(encoder.layer2(encoder.layer1(x))))
    return torch.flatten(encoder.avgpool(x), 1)


def resnet_forward_checkpointed(encoder: ResNet, x_BCHW: torch.Tensor) -> torch.Tensor:
    """torchvision's `ResNet.forward`, each stage checkpointed (recomputed in backward, BN statistics updated once)."""
    x = encoder.maxpool(encoder.relu(encoder.bn1(encoder.conv1(x_BCHW))))
    for stage in (encoder.layer1, encoder.layer2, encoder.layer3, encoder.layer4):
        x = checkpoint_stage(stage, x)
    return encoder.fc(torch.flatten(encoder.avgpool(x), 1))
