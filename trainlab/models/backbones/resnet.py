"""torchvision's ResNets as backbones: torchvision's layout, key names and initialisation (He et al., 2015).

- `tv_resnet50`: torchvision's ResNet-50 (ImageNet stem: 7x7 stride-2 conv + max-pool), what MoCo v3 trains.
- `tv_resnet18_cifar`: torchvision's ResNet-18 with a CIFAR stem (3x3 stride-1 first convolution, no max-pool) for
  32 px images; torchvision's init (Kaiming fan-out convolutions, BN weight 1). Not `cifar_resnet18`, which is
  kuangliu's network with PyTorch's default init.
- `tv_resnet_debug`: the `tv_resnet18_cifar` layout with one basic block per stage and widths 8-16-32-64 (CPU tests).

`zero_init_residual=True` zero-initialises the last BN of every residual branch (MoCo v3 builds its ResNets so).
Key names stay torchvision's (`conv1.weight`, `layer1.0.bn1.weight`, `fc.weight`), the names of the official MoCo v3
checkpoints. Shape legend: B batch, C channels, H/W pixels, D feature width.
"""

from __future__ import annotations

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from trainlab.models.grad_checkpoint import checkpoint_stage
from trainlab.models.registry import register_model

_DEBUG_WIDTHS = (8, 16, 32, 64)


class TorchvisionResNet(ResNet):
    """torchvision's `ResNet` (same modules, parameters and init) with timm's backbone interface and per-stage
    activation checkpointing; torchvision's `resnet50(...)` is `TorchvisionResNet(Bottleneck, [3, 4, 6, 3], ...)`."""

    grad_checkpointing = False

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each stage in backward (training with gradients only; BN statistics are updated once)."""
        self.grad_checkpointing = enabled

    def forward_features(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        """The last stage's feature map (B, D, h, w)."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x_BCHW))))
        recompute = self.grad_checkpointing and self.training and torch.is_grad_enabled()
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = checkpoint_stage(stage, x) if recompute else stage(x)
        return x

    def forward_head(self, x_BDhw: torch.Tensor, *, pre_logits: bool = False) -> torch.Tensor:
        """Global average pool to (B, D), then (unless `pre_logits`) the `fc` layer."""
        x_BD = torch.flatten(self.avgpool(x_BDhw), 1)
        return x_BD if pre_logits else self.fc(x_BD)

    def _forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _cifar_stem(model: ResNet, width: int) -> None:
    model.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()


@register_model("tv_resnet50")
def tv_resnet50(num_classes: int = 1000, zero_init_residual: bool = False) -> TorchvisionResNet:
    """torchvision's ResNet-50 (ImageNet stem), exactly as torchvision and MoCo v3's main_moco.py build it."""
    return TorchvisionResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes, zero_init_residual=zero_init_residual)


@register_model("tv_resnet18_cifar")
def tv_resnet18_cifar(num_classes: int = 1000, zero_init_residual: bool = False) -> TorchvisionResNet:
    """torchvision's ResNet-18 with a CIFAR stem (3x3 stride-1 conv, no max-pool), torchvision's init."""
    model = TorchvisionResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, zero_init_residual=zero_init_residual)
    _cifar_stem(model, 64)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model


@register_model("tv_resnet_debug")
def tv_resnet_debug(num_classes: int = 1000, zero_init_residual: bool = False) -> TorchvisionResNet:
    """Tiny `tv_resnet18_cifar`: one basic block per stage, widths 8-16-32-64 (tests and `--debug` runs)."""
    model = TorchvisionResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes, zero_init_residual=zero_init_residual)
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
    if zero_init_residual:
        for m in model.modules():
            if isinstance(m, BasicBlock) and m.bn2.weight is not None:
                nn.init.zeros_(m.bn2.weight)
    return model
