"""PatchGAN discriminator: the pix2pix / taming-transformers `NLayerDiscriminator` design.

A stack of 4x4 convolutions. The first conv and `num_layers - 1` more halve the resolution (stride 2), then one
stride-1 conv widens once more and a last stride-1 conv maps to one channel. Every conv but the first and the last is
followed by a norm (BatchNorm as in both reference repos, or GroupNorm, which does not depend on the batch), every
conv but the last by LeakyReLU(0.2). The output is a map of real/fake logits, one per overlapping patch (a 70x70
receptive field for 3 layers). Widths: base, 2x, 4x, 8x, capped at 8x. Convs followed by a norm have no bias.
Initialisation (the DCGAN rule both repos use): conv weights N(0, 0.02), norm scales N(1, 0.02), norm biases 0.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

# Shape legend: B batch, C image channels, H/W image side, h/w side of the logits map.

NormKind = Literal["batch", "group"]

_KERNEL = 4
_PADDING = 1


def _norm(kind: NormKind, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(math.gcd(32, channels), channels)


class PatchDiscriminator(nn.Module):
    """Fully convolutional real/fake classifier over image patches.

    Args:
        in_channels: image channels C.
        base_channels: width of the first conv (64 in pix2pix and taming).
        num_layers: stride-2 convs (3 in both references: 70x70 patches, a 30x30 map for 256 px input).
        norm: "batch" (the references) or "group" (GroupNorm with gcd(32, width) groups).
    """

    def __init__(
        self, in_channels: int = 3, base_channels: int = 64, num_layers: int = 3, norm: NormKind = "batch"
    ) -> None:
        super().__init__()
        if num_layers < 1 or base_channels < 1:
            raise ValueError(f"num_layers and base_channels must be >= 1, got {num_layers}, {base_channels}")
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, base_channels, _KERNEL, stride=2, padding=_PADDING),
            nn.LeakyReLU(0.2, inplace=True),
        ]
        width = base_channels
        for n in range(1, num_layers + 1):
            next_width = base_channels * min(2**n, 8)
            stride = 2 if n < num_layers else 1
            layers += [
                nn.Conv2d(width, next_width, _KERNEL, stride=stride, padding=_PADDING, bias=False),
                _norm(norm, next_width),
                nn.LeakyReLU(0.2, inplace=True),
            ]
            width = next_width
        layers.append(nn.Conv2d(width, 1, _KERNEL, stride=1, padding=_PADDING))
        self.main = nn.Sequential(*layers)
        self.num_layers = num_layers
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """conv ~ N(0, 0.02); norm scale ~ N(1, 0.02), norm bias = 0."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.normal_(module.weight, 0.0, 0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.normal_(module.weight, 1.0, 0.02)
                nn.init.zeros_(module.bias)

    @staticmethod
    def output_side(image_side: int, num_layers: int) -> int:
        """Side of the logits map for a square input (<= 0 means the image is too small for `num_layers`)."""
        side = image_side
        for _ in range(num_layers):
            side = (side + 2 * _PADDING - _KERNEL) // 2 + 1
        for _ in range(2):  # the two stride-1 convs
            side = side + 2 * _PADDING - _KERNEL + 1
        return side

    def forward(self, img_BCHW: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> logits (B, 1, h, w); positive means "real"."""
        logits_B1hw: torch.Tensor = self.main(img_BCHW)
        return logits_B1hw
