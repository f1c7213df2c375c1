"""MoCo v3's Vision Transformer: timm's `VisionTransformer` with the official changes (moco-v3 vits.py).

Registered as `moco_vit_small`, `moco_vit_base`, `moco_vit_conv_small`, `moco_vit_conv_base` and `moco_vit_debug`
(the `moco_` prefix: these are MoCo v3's variants, e.g. its ViT-Small has 12 heads where DeiT's has 6).

Deviations from timm's defaults, all from the official file:
- fixed 2-D sin-cos position embedding (a parameter with `requires_grad=False`; the cls slot is zero);
- Xavier-uniform init of every Linear, with Q, K and V treated as three matrices; cls token N(0, 1e-6);
  the patch projection Xavier-uniform over its fan-in 3 * p * p;
- `stop_grad_conv1`: the patch projection stays at its random init (MoCo v3's "random patch projection");
- ViT-Small has 12 heads (DeiT's has 6); the conv-stem variants use a 4-layer 3x3 conv stem and one block fewer.

Key names are timm's (`patch_embed.proj.weight`, `blocks.0.attn.qkv.weight`, ...), the names of the official
checkpoints. Shape legend: B batch, C channels, H/W pixels, N patches, D embedding width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from timm.layers import PatchEmbed
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from trainlab.errors import UsageError
from trainlab.models.registry import register_model


@dataclass(frozen=True)
class ViTSize:
    """One ViT variant of MoCo v3."""

    embed_dim: int
    depth: int
    num_heads: int
    patch_size: int = 16
    conv_stem: bool = False


VIT_SIZES: dict[str, ViTSize] = {
    "moco_vit_small": ViTSize(embed_dim=384, depth=12, num_heads=12),
    "moco_vit_base": ViTSize(embed_dim=768, depth=12, num_heads=12),
    "moco_vit_conv_small": ViTSize(embed_dim=384, depth=11, num_heads=12, conv_stem=True),
    "moco_vit_conv_base": ViTSize(embed_dim=768, depth=11, num_heads=12, conv_stem=True),
    "moco_vit_debug": ViTSize(embed_dim=32, depth=2, num_heads=2, patch_size=4),
}
"""The registered MoCo v3 ViTs (registry name -> size)."""


def sincos_position_embedding(grid_h: int, grid_w: int, embed_dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """The official fixed 2-D sin-cos table, (1, 1 + grid_h * grid_w, D), with a zero row for the cls token.

    Computed in float64 and returned in the default dtype: the official code computes it in float32, whose sin / cos
    take CPU-specific vector paths; rounding the float64 table gives every CPU the same (more accurate) values.
    """
    if embed_dim % 4:
        raise UsageError(f"the 2-D sin-cos position embedding needs an embedding width divisible by 4, got {embed_dim}")
    grid_w_HW, grid_h_HW = torch.meshgrid(
        torch.arange(grid_w, dtype=torch.float64), torch.arange(grid_h, dtype=torch.float64), indexing="ij"
    )
    pos_dim = embed_dim // 4
    omega = 1.0 / (temperature ** (torch.arange(pos_dim, dtype=torch.float64) / pos_dim))
    out_w = torch.einsum("m,d->md", grid_w_HW.flatten(), omega)
    out_h = torch.einsum("m,d->md", grid_h_HW.flatten(), omega)
    pos_ND = torch.cat([torch.sin(out_w), torch.cos(out_w), torch.sin(out_h), torch.cos(out_h)], dim=1)
    return torch.cat([torch.zeros(1, embed_dim, dtype=torch.float64), pos_ND], dim=0)[None].to(
        torch.get_default_dtype()
    )


class ConvStem(nn.Module):
    """The conv stem of "Early Convolutions Help Transformers See Better" (official `vits.ConvStem`): four 3x3
    stride-2 convolutions (BN, ReLU), widths D/8 .. D/1, then a 1x1 projection; replaces the 16x16 patch projection."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768, **_: object):
        super().__init__()
        if patch_size != 16:
            raise UsageError(f"the conv stem only supports patch size 16, got {patch_size}")
        if embed_dim % 8:
            raise UsageError(f"the conv stem needs an embedding width divisible by 8, got {embed_dim}")
        self.img_size = (img_size, img_size)
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        layers: list[nn.Module] = []
        in_dim, out_dim = in_chans, embed_dim // 8
        for _layer in range(4):
            layers += [nn.Conv2d(in_dim, out_dim, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(out_dim)]
            layers.append(nn.ReLU(inplace=True))
            in_dim, out_dim = out_dim, out_dim * 2
        layers.append(nn.Conv2d(in_dim, embed_dim, kernel_size=1))
        self.proj = nn.Sequential(*layers)
        self.norm = nn.Identity()

    def feat_ratio(self, as_scalar: bool = True) -> int:
        return self.patch_size[0]

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        x_BDhw = self.proj(x_BCHW)
        return self.norm(x_BDhw.flatten(2).transpose(1, 2))


class VisionTransformerMoCo(VisionTransformer):
    """timm's ViT with MoCo v3's position embedding, initialisation and optional stop-gradient patch projection."""

    def __init__(self, *, stop_grad_conv1: bool = False, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        h, w = self.patch_embed.grid_size
        self.pos_embed = nn.Parameter(sincos_position_embedding(h, w, self.embed_dim), requires_grad=False)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if "qkv" in name:  # Q, K and V as three separate matrices
                    val = math.sqrt(6.0 / float(module.weight.shape[0] // 3 + module.weight.shape[1]))
                    nn.init.uniform_(module.weight, -val, val)
                else:
                    nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        assert self.cls_token is not None
        nn.init.normal_(self.cls_token, std=1e-6)
        if isinstance(self.patch_embed, PatchEmbed):
            patch_h, patch_w = self.patch_embed.patch_size
            val = math.sqrt(6.0 / float(3 * patch_h * patch_w + self.embed_dim))
            proj: nn.Conv2d = self.patch_embed.proj
            assert proj.bias is not None
            nn.init.uniform_(proj.weight, -val, val)
            nn.init.zeros_(proj.bias)
            if stop_grad_conv1:
                proj.weight.requires_grad = False
                proj.bias.requires_grad = False


def check_vit_image_size(model: str, image_size: int) -> None:
    """Refuse an image side the ViT `model` cannot cut into its patches (another backbone: nothing to check).

    Raises:
        UsageError: one line naming --image-size and the sides that work.
    """
    size = VIT_SIZES.get(model)
    if size is not None and (image_size % size.patch_size or image_size < size.patch_size):
        raise UsageError(
            f"--model {model} cuts images into {size.patch_size}-px patches: --image-size must be a multiple of "
            f"{size.patch_size}, got {image_size}"
        )


def make_vit(
    name: str, *, num_classes: int = 1000, image_size: int = 224, stop_grad_conv1: bool = False
) -> VisionTransformerMoCo:
    """Build MoCo v3's ViT `name` (a key of `VIT_SIZES`) for square `image_size` inputs.

    Raises:
        UsageError: `image_size` does not divide by the patch size.
    """
    size = VIT_SIZES[name]
    if image_size % size.patch_size or image_size < size.patch_size:
        raise UsageError(
            f"{name}: image size {image_size} does not divide by the patch size {size.patch_size}; "
            f"use a multiple of {size.patch_size} (--image-size)"
        )
    return VisionTransformerMoCo(
        stop_grad_conv1=stop_grad_conv1,
        img_size=image_size,
        patch_size=size.patch_size,
        num_classes=num_classes,
        embed_dim=size.embed_dim,
        depth=size.depth,
        num_heads=size.num_heads,
        mlp_ratio=4.0,
        qkv_bias=True,
        norm_layer=partial(nn.LayerNorm, eps=1e-6),
        embed_layer=ConvStem if size.conv_stem else PatchEmbed,
    )


def _register(name: str) -> None:
    def build(num_classes: int = 1000, image_size: int = 224, stop_grad_conv1: bool = False) -> VisionTransformerMoCo:
        return make_vit(name, num_classes=num_classes, image_size=image_size, stop_grad_conv1=stop_grad_conv1)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"MoCo v3's {name.removeprefix('moco_')} ({VIT_SIZES[name]})."
    register_model(name)(build)


for _name in VIT_SIZES:
    _register(_name)
