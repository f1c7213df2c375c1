"""ResNet-18/34/50 for 32x32 inputs (the CIFAR variant popularised by kuangliu/pytorch-cifar).

Registered as `cifar_resnet18`, `cifar_resnet34`, `cifar_resnet50` and `cifar_resnet_debug`. Not the same network as
`tv_resnet18_cifar` (`models/backbones/resnet.py`), which has the same stem but torchvision's initialisation.

Deviations from torchvision's ImageNet ResNet (He et al., 2015, https://arxiv.org/abs/1512.03385):
- stem is a single 3x3 conv, stride 1, with no max-pool, so stage 1 runs at 32x32 (torchvision: 7x7 stride 2 +
  max-pool, i.e. 8x8 at stage 1 for CIFAR, which costs several points of accuracy);
- residual blocks are torchvision's own `BasicBlock` / `Bottleneck` (stride on the 3x3 conv, "v1.5"), with a
  1x1-conv + BN projection shortcut wherever the shape changes, as in kuangliu's code;
- PyTorch's default initialisation (kuangliu's recipe) rather than torchvision's kaiming fan-out init.

ResNet-18 with 10 classes has 11,173,962 parameters.
"""

# Shape legend: B batch, C channels, H/W height/width (pixels or feature-map cells), K classes.

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from trainlab.models.grad_checkpoint import checkpoint_stage
from trainlab.models.registry import register_model

Block = type[BasicBlock] | type[Bottleneck]


class CifarResNet(nn.Module):
    """ResNet with a CIFAR stem: conv3x3 -> 4 stages -> global average pool -> linear.

    Args:
        block: `BasicBlock` (ResNet-18/34) or `Bottleneck` (ResNet-50 and deeper).
        num_blocks: blocks per stage, e.g. (2, 2, 2, 2) for ResNet-18.
        widths: base width of each stage (a `Bottleneck` stage outputs 4x that many channels).
        num_classes: size of the classifier; 0 replaces the classifier with `nn.Identity` (backbone only).
        in_channels: channels of the input image.
    """

    def __init__(
        self,
        block: Block,
        num_blocks: Sequence[int],
        *,
        widths: Sequence[int] = (64, 128, 256, 512),
        num_classes: int = 10,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        assert len(num_blocks) == len(widths), "one block count per stage"
        self.conv1 = nn.Conv2d(in_channels, widths[0], kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self._channels = widths[0]
        stages = [
            self._make_stage(block, width, count, stride=1 if i == 0 else 2)
            for i, (width, count) in enumerate(zip(widths, num_blocks, strict=True))
        ]
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.num_features = self._channels
        self.fc: nn.Module = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.grad_checkpointing = False  # see `set_grad_checkpointing`

    def shard_units(self) -> list[nn.Module]:
        """The blocks `--fsdp` shards one by one (`TrainParts.shard_units`): the four stages."""
        return [self.layer1, self.layer2, self.layer3, self.layer4]

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each stage in backward instead of keeping its activations (training with gradients only;
        BatchNorm statistics are updated once, as without)."""
        self.grad_checkpointing = enabled

    def _make_stage(self, block: Block, width: int, count: int, *, stride: int) -> nn.Sequential:
        out_channels = width * block.expansion
        downsample = None
        if stride != 1 or self._channels != out_channels:
            downsample = nn.Sequential(
                nn.Conv2d(self._channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        blocks: list[nn.Module] = [block(self._channels, width, stride, downsample)]
        blocks += [block(out_channels, width) for _ in range(count - 1)]
        self._channels = out_channels
        return nn.Sequential(*blocks)

    def forward_features(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """Returns the last stage's feature map, (B, num_features, H/8, W/8)."""
        x_BCHW = self.relu(self.bn1(self.conv1(img_B3HW)))
        recompute = self.grad_checkpointing and self.training and torch.is_grad_enabled()
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            x_BCHW = checkpoint_stage(stage, x_BCHW) if recompute else stage(x_BCHW)
        return x_BCHW

    def forward_head(self, x_BCHW: torch.Tensor, *, pre_logits: bool = False) -> torch.Tensor:
        """Pools a feature map to (B, num_features), then (unless `pre_logits`) applies the classifier."""
        x_BC = torch.flatten(self.avgpool(x_BCHW), 1)
        return x_BC if pre_logits else self.fc(x_BC)

    def forward(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """Maps images (B, 3, H, W) to logits (B, K), or to pooled features when `num_classes == 0`."""
        return self.forward_head(self.forward_features(img_B3HW))


@register_model("cifar_resnet18")
def cifar_resnet18(num_classes: int = 10) -> CifarResNet:
    """ResNet-18, CIFAR stem (11.17 M parameters at 10 classes)."""
    return CifarResNet(BasicBlock, (2, 2, 2, 2), num_classes=num_classes)


@register_model("cifar_resnet34")
def cifar_resnet34(num_classes: int = 10) -> CifarResNet:
    """ResNet-34, CIFAR stem."""
    return CifarResNet(BasicBlock, (3, 4, 6, 3), num_classes=num_classes)


@register_model("cifar_resnet50")
def cifar_resnet50(num_classes: int = 10) -> CifarResNet:
    """ResNet-50 (bottleneck blocks), CIFAR stem."""
    return CifarResNet(Bottleneck, (3, 4, 6, 3), num_classes=num_classes)


@register_model("cifar_resnet_debug")
def cifar_resnet_debug(num_classes: int = 10) -> CifarResNet:
    """Tiny ResNet for tests and `--debug` runs: one basic block per stage, widths 8/16/32/64."""
    return CifarResNet(BasicBlock, (1, 1, 1, 1), widths=(8, 16, 32, 64), num_classes=num_classes)
