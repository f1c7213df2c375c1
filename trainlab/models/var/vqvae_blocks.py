"""Convolutional encoder / decoder of VAR's VQVAE (the LDM "vq-f16" layout with a fused-qkv attention block).

Module and attribute names reproduce the official `vae_ch160v4096z32.pth` state_dict keys exactly
(`encoder.down.{i}.block.{j}.norm1`, `decoder.up.{i}.attn.{j}.qkv`, ...; see
`../shared/specs/var-checkpoint-format.md`, section 3). Numerics follow the official model:

* GroupNorm(32 groups, eps 1e-6) and SiLU everywhere;
* ResnetBlock: norm1 -> SiLU -> conv3x3 -> norm2 -> SiLU -> dropout -> conv3x3, plus a 1x1 `nin_shortcut` when the
  width changes;
* AttnBlock: single head over the H*W tokens, one 1x1 `qkv` conv (q, k, v stacked along channels), scale C^-0.5,
  1x1 `proj_out`, residual. `F.scaled_dot_product_attention` by default; `use_sdpa=False` gives the explicit
  bmm/softmax form (the two agree to ~1e-6, tested);
* Downsample: zero-pad right/bottom by one pixel, conv3x3 stride 2 (no padding). Upsample: nearest x2, conv3x3.
* `up[i]` of the decoder is indexed by resolution level (up.0 = full resolution) and run from the last level down.

Inference speed-ups that keep the function: under `torch.inference_mode()` the blocks use in-place SiLU / residual
adds (bit-identical); `Upsample.subpixel` folds nearest-x2 + conv3x3 into four 2x2 convs (float rounding only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Shape legend: B batch, C channels, H/W height/width, N = H*W attention tokens, Z latent channels.


def group_norm(channels: int) -> nn.GroupNorm:
    """The VQVAE's normalisation: GroupNorm with 32 groups, eps 1e-6, affine."""
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """Pre-activation residual block; `nin_shortcut` (1x1 conv) exists only when the width changes."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.norm2 = group_norm(out_channels)
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 1e-6 else nn.Identity()
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.nin_shortcut: nn.Module = (
            nn.Conv2d(in_channels, out_channels, kernel_size=1) if in_channels != out_channels else nn.Identity()
        )

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        inplace = torch.is_inference_mode_enabled()  # same bits, fewer allocations
        h_BCHW = self.conv1(F.silu(self.norm1(x_BCHW), inplace=inplace))
        h_BCHW = self.conv2(self.dropout(F.silu(self.norm2(h_BCHW), inplace=inplace)))
        shortcut_BCHW = self.nin_shortcut(x_BCHW)
        return h_BCHW.add_(shortcut_BCHW) if inplace else shortcut_BCHW + h_BCHW


class AttnBlock(nn.Module):
    """Single-head self-attention over all H*W positions with a fused 1x1 `qkv` conv and a 1x1 `proj_out`.

    Attributes:
        use_sdpa: compute the attention with `F.scaled_dot_product_attention` (default) instead of the explicit
            bmm -> softmax -> bmm form of the official code. Both give the same result to float32 rounding.
    """

    def __init__(self, channels: int, use_sdpa: bool = True) -> None:
        super().__init__()
        self.channels = channels
        self.use_sdpa = use_sdpa
        self.norm = group_norm(channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, kernel_size=1)
        self.proj_out = nn.Conv2d(channels, channels, kernel_size=1)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x_BCHW.shape
        q_BCN, k_BCN, v_BCN = self.qkv(self.norm(x_BCHW)).reshape(B, 3, C, H * W).unbind(1)
        if self.use_sdpa:
            q_B1NC, k_B1NC, v_B1NC = (t.transpose(1, 2).unsqueeze(1) for t in (q_BCN, k_BCN, v_BCN))
            out_BCN = F.scaled_dot_product_attention(q_B1NC, k_B1NC, v_B1NC).squeeze(1).transpose(1, 2)
        else:
            attn_BNN = torch.bmm(q_BCN.transpose(1, 2), k_BCN).mul_(C**-0.5).softmax(dim=2)  # [query, key]
            out_BCN = torch.bmm(v_BCN, attn_BNN.transpose(1, 2))
        out_BCHW = self.proj_out(out_BCN.reshape(B, C, H, W))
        return out_BCHW.add_(x_BCHW) if torch.is_inference_mode_enabled() else x_BCHW + out_BCHW


class Downsample(nn.Module):
    """Halve H and W: zero-pad one pixel on the right and bottom, then a 3x3 conv with stride 2 and no padding."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x_BCHW, (0, 1, 0, 1), mode="constant", value=0.0))


def _fold_taps(w: torch.Tensor, dim: int, phase: int) -> torch.Tensor:
    """Fold 3 kernel taps along `dim` into the 2 low-resolution taps that one output phase of a nearest-x2
    upsample sees: phase 0 reads rows (i-1, i) with weights (w0, w1+w2); phase 1 reads (i, i+1) with (w0+w1, w2)."""
    w0, w1, w2 = w.unbind(dim)
    return torch.stack((w0, w1 + w2) if phase == 0 else (w0 + w1, w2), dim)


class Upsample(nn.Module):
    """Double H and W: nearest-neighbour x2, then a 3x3 conv (padding 1).

    Attributes:
        subpixel: compute the same function as four 2x2 convs on the low-resolution input (one per output phase,
            kernels folded from the 3x3 one) and interleave them: 4/9 of the multiply-adds and no upsampled
            intermediate. Differs from the direct form only by float rounding (~1e-6 relative); off by default.
    """

    def __init__(self, channels: int, subpixel: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1)
        self.subpixel = subpixel

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        if self.subpixel:
            return self._forward_subpixel(x_BCHW)
        return self.conv(F.interpolate(x_BCHW, scale_factor=2.0, mode="nearest"))

    def _forward_subpixel(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x_BCHW.shape
        phases = [(a, b) for a in (0, 1) for b in (0, 1)]
        weight = self.conv.weight
        kernel_4C_C22 = torch.cat([_fold_taps(_fold_taps(weight, 2, a), 3, b) for a, b in phases])
        channels_last = x_BCHW.is_contiguous(memory_format=torch.channels_last) and not x_BCHW.is_contiguous()
        if channels_last:
            kernel_4C_C22 = kernel_4C_C22.contiguous(memory_format=torch.channels_last)
        # Output (i, j) of the padded 2x2 conv reads low-res rows (i-1, i), cols (j-1, j); phase (a, b) is at (i+a, j+b)
        y_B4CHW = F.conv2d(
            x_BCHW, kernel_4C_C22, self.conv.bias.repeat(4) if self.conv.bias is not None else None, padding=1
        )
        if channels_last:  # build the output in NHWC order: (B, H, 2, W, 2, C)
            out = y_B4CHW.new_empty(B, H, 2, W, 2, C)
            for p, (a, b) in enumerate(phases):
                out[:, :, a, :, b, :] = y_B4CHW[:, p * C : (p + 1) * C, a : a + H, b : b + W].permute(0, 2, 3, 1)
            return out.view(B, 2 * H, 2 * W, C).permute(0, 3, 1, 2)
        out = y_B4CHW.new_empty(B, C, H, 2, W, 2)
        for p, (a, b) in enumerate(phases):
            out[:, :, :, a, :, b] = y_B4CHW[:, p * C : (p + 1) * C, a : a + H, b : b + W]
        return out.view(B, C, 2 * H, 2 * W)


class MidBlock(nn.Module):
    """ResnetBlock -> AttnBlock -> ResnetBlock at the lowest resolution (keys `mid.block_1`, `mid.attn_1`, ...)."""

    def __init__(self, channels: int, dropout: float) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, dropout)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels, dropout)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x_BCHW)))


class EncoderLevel(nn.Module):
    """One resolution level of the encoder: `block.{j}`, `attn.{j}` (lowest level only), `downsample`."""

    def __init__(
        self, in_channels: int, out_channels: int, num_blocks: int, dropout: float, attn: bool, downsample: bool
    ) -> None:
        super().__init__()
        widths = [in_channels] + [out_channels] * num_blocks
        self.block = nn.ModuleList(ResnetBlock(widths[j], widths[j + 1], dropout) for j in range(num_blocks))
        self.attn = nn.ModuleList(AttnBlock(out_channels) for _ in range(num_blocks if attn else 0))
        self.downsample = Downsample(out_channels) if downsample else None

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        for j, block in enumerate(self.block):
            x_BCHW = block(x_BCHW)
            if len(self.attn) > 0:
                x_BCHW = self.attn[j](x_BCHW)
        return self.downsample(x_BCHW) if self.downsample is not None else x_BCHW


class DecoderLevel(nn.Module):
    """One resolution level of the decoder: `block.{j}`, `attn.{j}` (lowest level only), `upsample`."""

    def __init__(
        self, in_channels: int, out_channels: int, num_blocks: int, dropout: float, attn: bool, upsample: bool
    ) -> None:
        super().__init__()
        widths = [in_channels] + [out_channels] * num_blocks
        self.block = nn.ModuleList(ResnetBlock(widths[j], widths[j + 1], dropout) for j in range(num_blocks))
        self.attn = nn.ModuleList(AttnBlock(out_channels) for _ in range(num_blocks if attn else 0))
        self.upsample = Upsample(out_channels) if upsample else None

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        for j, block in enumerate(self.block):
            x_BCHW = block(x_BCHW)
            if len(self.attn) > 0:
                x_BCHW = self.attn[j](x_BCHW)
        return self.upsample(x_BCHW) if self.upsample is not None else x_BCHW


class Encoder(nn.Module):
    """Image (B, 3, H, W) -> latent (B, z_channels, H/f, W/f), f = 2**(len(ch_mult)-1).

    Args:
        ch: base width; level i has width ch * ch_mult[i]. Every width must be a multiple of 32 (GroupNorm).
        ch_mult: width multipliers per resolution level.
        num_res_blocks: ResnetBlocks per level.
        z_channels: output channels.
        dropout: dropout inside the ResnetBlocks (0 in VAR).
        in_channels: image channels.
    """

    def __init__(
        self,
        *,
        ch: int,
        ch_mult: tuple[int, ...],
        num_res_blocks: int,
        z_channels: int,
        dropout: float = 0.0,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        num_levels = len(ch_mult)
        in_mult = (1, *ch_mult)
        self.conv_in = nn.Conv2d(in_channels, ch, kernel_size=3, stride=1, padding=1)
        self.down = nn.ModuleList(
            EncoderLevel(
                ch * in_mult[i],
                ch * ch_mult[i],
                num_res_blocks,
                dropout,
                attn=i == num_levels - 1,
                downsample=i != num_levels - 1,
            )
            for i in range(num_levels)
        )
        width = ch * ch_mult[-1]
        self.mid = MidBlock(width, dropout)
        self.norm_out = group_norm(width)
        self.conv_out = nn.Conv2d(width, z_channels, kernel_size=3, stride=1, padding=1)

    def forward(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        h_BCHW = self.conv_in(img_B3HW)
        for level in self.down:
            h_BCHW = level(h_BCHW)
        h_BCHW = self.mid(h_BCHW)
        return self.conv_out(F.silu(self.norm_out(h_BCHW), inplace=torch.is_inference_mode_enabled()))


class Decoder(nn.Module):
    """Latent (B, z_channels, h, w) -> image (B, 3, h*f, w*f), unclamped. Same arguments as `Encoder`."""

    def __init__(
        self,
        *,
        ch: int,
        ch_mult: tuple[int, ...],
        num_res_blocks: int,
        z_channels: int,
        dropout: float = 0.0,
        out_channels: int = 3,
    ) -> None:
        super().__init__()
        num_levels = len(ch_mult)
        width = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, width, kernel_size=3, stride=1, padding=1)
        self.mid = MidBlock(width, dropout)
        # Input width of level i is the output width of level i+1 (the deepest level gets the mid width).
        in_widths = [ch * m for m in ch_mult[1:]] + [width]
        self.up = nn.ModuleList(
            DecoderLevel(
                in_widths[i],
                ch * ch_mult[i],
                num_res_blocks + 1,
                dropout,
                attn=i == num_levels - 1,
                upsample=i != 0,
            )
            for i in range(num_levels)
        )
        self.norm_out = group_norm(ch * ch_mult[0])
        self.conv_out = nn.Conv2d(ch * ch_mult[0], out_channels, kernel_size=3, stride=1, padding=1)

    def forward(self, z_BZhw: torch.Tensor) -> torch.Tensor:
        h_BCHW = self.mid(self.conv_in(z_BZhw))
        for level in reversed(self.up):
            h_BCHW = level(h_BCHW)
        return self.conv_out(F.silu(self.norm_out(h_BCHW), inplace=torch.is_inference_mode_enabled()))
