"""VGG-11/13/16/19 for 32x32 inputs (Simonyan & Zisserman, 2014, https://arxiv.org/abs/1409.1556).

The CIFAR variant popularised by kuangliu/pytorch-cifar, which differs from the ImageNet VGG:
- every 3x3 conv is followed by BatchNorm, then ReLU;
- five 2x2 max-pools take 32x32 down to 1x1, so the classifier is a single `Linear(512, num_classes)` (no
  4096-wide fully connected layers, no dropout); kuangliu's trailing 1x1 average pool is a no-op and is omitted.

VGG-19 with 10 classes has 20,040,522 parameters. Registered as `cifar_vgg11` ... `cifar_vgg19` and `cifar_vgg_debug`.
"""

# Shape legend: B batch, C channels, H/W height/width, K classes.

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainlab.models.grad_checkpoint import checkpoint_stage
from trainlab.models.registry import register_model

# An int is a conv3x3-BN-ReLU with that many output channels; "M" is a 2x2 max-pool.
LayerSpec = Sequence[int | str]

VGG_LAYERS: dict[str, LayerSpec] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
    "vgg19": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"),
    "vgg_debug": (8, "M", 16, "M", 32, "M", 32, "M", 64, "M"),
}


class CifarVGG(nn.Module):
    """VGG feature stack (conv-BN-ReLU and max-pools) followed by one linear classifier.

    Args:
        layers: the layer spec, e.g. `VGG_LAYERS["vgg19"]`; must contain five "M" for 32x32 inputs.
        num_classes: size of the classifier; 0 replaces the classifier with `nn.Identity` (backbone only).
        in_channels: channels of the input image.
    """

    def __init__(self, layers: LayerSpec, *, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        modules: list[nn.Module] = []
        channels = in_channels
        for spec in layers:
            if spec == "M":
                modules.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                assert isinstance(spec, int), f"bad VGG layer spec {spec!r}"
                modules += [
                    nn.Conv2d(channels, spec, kernel_size=3, padding=1),
                    nn.BatchNorm2d(spec),
                    nn.ReLU(inplace=True),
                ]
                channels = spec
        self.features = nn.Sequential(*modules)
        self.num_features = channels
        self.classifier: nn.Module = nn.Linear(channels, num_classes) if num_classes > 0 else nn.Identity()
        # the blocks `features` is cut into for activation checkpointing: each ends with a max-pool
        ends = [i + 1 for i, m in enumerate(modules) if isinstance(m, nn.MaxPool2d)]
        starts = [0, *ends]
        self._block_bounds = [(a, b) for a, b in zip(starts, [*ends, len(modules)], strict=True) if b > a]
        self.grad_checkpointing = False  # see `set_grad_checkpointing`

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block of `features` (up to and including a max-pool) in backward instead of keeping its
        activations (training with gradients only; BatchNorm statistics are updated once, as without)."""
        self.grad_checkpointing = enabled

    def forward_features(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """Returns the feature map after the last max-pool, (B, num_features, H/32, W/32)."""
        if not (self.grad_checkpointing and self.training and torch.is_grad_enabled()):
            return self.features(img_B3HW)
        x_BCHW = img_B3HW
        for start, end in self._block_bounds:
            x_BCHW = checkpoint_stage(self.features[start:end], x_BCHW)
        return x_BCHW

    def forward_head(self, x_BCHW: torch.Tensor, *, pre_logits: bool = False) -> torch.Tensor:
        """Flattens the (1x1 for 32x32 inputs) feature map to (B, C), then (unless `pre_logits`) classifies."""
        x_BC = torch.flatten(x_BCHW, 1)
        return x_BC if pre_logits else self.classifier(x_BC)

    def forward(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """Maps images (B, 3, 32, 32) to logits (B, K), or to features when `num_classes == 0`."""
        return self.forward_head(self.forward_features(img_B3HW))


@register_model("cifar_vgg11")
def cifar_vgg11(num_classes: int = 10) -> CifarVGG:
    """VGG-11 with BatchNorm, CIFAR head."""
    return CifarVGG(VGG_LAYERS["vgg11"], num_classes=num_classes)


@register_model("cifar_vgg13")
def cifar_vgg13(num_classes: int = 10) -> CifarVGG:
    """VGG-13 with BatchNorm, CIFAR head."""
    return CifarVGG(VGG_LAYERS["vgg13"], num_classes=num_classes)


@register_model("cifar_vgg16")
def cifar_vgg16(num_classes: int = 10) -> CifarVGG:
    """VGG-16 with BatchNorm, CIFAR head."""
    return CifarVGG(VGG_LAYERS["vgg16"], num_classes=num_classes)


@register_model("cifar_vgg19")
def cifar_vgg19(num_classes: int = 10) -> CifarVGG:
    """VGG-19 with BatchNorm, CIFAR head (20.04 M parameters at 10 classes)."""
    return CifarVGG(VGG_LAYERS["vgg19"], num_classes=num_classes)


@register_model("cifar_vgg_debug")
def cifar_vgg_debug(num_classes: int = 10) -> CifarVGG:
    """Tiny VGG for tests and `--debug` runs: five narrow conv layers (8..64 channels), five max-pools."""
    return CifarVGG(VGG_LAYERS["vgg_debug"], num_classes=num_classes)
