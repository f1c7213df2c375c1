"""VAR's multi-scale VQVAE tokenizer: encoder -> quant_conv -> multi-scale quantizer -> post_quant_conv -> decoder.

Loads the official `vae_ch160v4096z32.pth` state_dict with strict key matching (`VQVAEConfig.official()`), and
builds tiny variants for tests (`VQVAEConfig.debug()`). The named architectures are registered models:
`vqvae_official`, `vqvae_digits`, `vqvae_debug` (`create_model("vqvae_digits", patch_nums=(1, 2, 3, 4))`).
Numerics follow the official model (parity-tested against `../shared/fixtures/var_official_d4.pt`). Every
image-producing decode path except `forward` clamps to [-1, 1]. Images are float tensors in [-1, 1]:
`x = img_u8.float() / 255; img = x + x - 1`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
from torch import nn

from trainlab.errors import UsageError
from trainlab.models.registry import register_model
from trainlab.models.var.quantizer import MultiScaleQuantizer
from trainlab.models.var.vqvae_blocks import AttnBlock, Decoder, Encoder, Upsample

# Shape legend: B batch, H/W image side, C = z_channels (Cvae), h/w latent side = H / downsample, pn scale side.

log = logging.getLogger(__name__)

PATCH_NUMS_256: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
PATCH_NUMS_512: tuple[int, ...] = (1, 2, 3, 4, 6, 9, 13, 18, 24, 32)
_EMA_KEY = "quantize.ema_vocab_hit_SV"


@dataclass(frozen=True, kw_only=True)
class VQVAEConfig:
    """Architecture of the VQVAE. The defaults are the official `vae_ch160v4096z32` (256 px) model.

    Attributes:
        vocab_size: codebook size V.
        z_channels: latent / code channels (Cvae).
        ch: base width; level i has ch * ch_mult[i] channels (each a multiple of 32, for GroupNorm).
        ch_mult: width multipliers; the downsample factor is 2 ** (len(ch_mult) - 1).
        num_res_blocks: ResnetBlocks per encoder level (the decoder has one more).
        dropout: dropout in the ResnetBlocks.
        share_quant_resi: number of phi convs (0 = one per scale, 1 = a single one).
        quant_resi: phi mixing ratio r in phi(x) = (1-r) x + r conv(x).
        beta: commitment weight of the VQ loss.
        patch_nums: token-map sides, coarse to fine; the last is the latent side (image side / downsample).
    """

    vocab_size: int = 4096
    z_channels: int = 32
    ch: int = 160
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    dropout: float = 0.0
    share_quant_resi: int = 4
    quant_resi: float = 0.5
    beta: float = 0.25
    patch_nums: tuple[int, ...] = PATCH_NUMS_256

    def __post_init__(self) -> None:
        bad = [self.ch * m for m in self.ch_mult if (self.ch * m) % 32 != 0]
        if bad:
            raise UsageError(f"every VQVAE width ch*ch_mult[i] must be a multiple of 32 (GroupNorm), got {bad}")
        if self.vocab_size < 1 or self.z_channels < 1 or self.num_res_blocks < 1 or not self.ch_mult:
            raise UsageError("vocab_size, z_channels, num_res_blocks must be >= 1 and ch_mult non-empty")

    @property
    def downsample(self) -> int:
        """Image side / latent side."""
        return 2 ** (len(self.ch_mult) - 1)

    @property
    def image_size(self) -> int:
        """Image side the quantizer's patch_nums are made for."""
        return self.patch_nums[-1] * self.downsample

    @classmethod
    def official(cls, patch_nums: tuple[int, ...] = PATCH_NUMS_256) -> VQVAEConfig:
        """The released `vae_ch160v4096z32.pth` model (108.95 M parameters); 512 px VAR uses `PATCH_NUMS_512`."""
        return cls(patch_nums=patch_nums)

    @classmethod
    def debug(cls) -> VQVAEConfig:
        """A tiny model for tests: 16 px images, 4x4 latent, 4 scales, runs in milliseconds on a CPU."""
        return cls(vocab_size=64, z_channels=8, ch=32, ch_mult=(1, 1, 2), num_res_blocks=1, patch_nums=(1, 2, 3, 4))

    @classmethod
    def digits(cls) -> VQVAEConfig:
        """The demo's tokenizer for 16 px digits: the debug width with 256 codes (0.8 M parameters)."""
        return dataclasses.replace(cls.debug(), vocab_size=256)


_VQVAE_CONFIGS: dict[str, Callable[[], VQVAEConfig]] = {
    "vqvae_official": VQVAEConfig.official,
    "vqvae_digits": VQVAEConfig.digits,
    "vqvae_debug": VQVAEConfig.debug,
}


def vqvae_config(name: str, patch_nums: Sequence[int] | None = None) -> VQVAEConfig:
    """The architecture of the named VQVAE (one of `trainlab.models.names.VQVAE_NAMES`), optionally on other
    token-map sides.

    Raises:
        UsageError: an unknown name.
    """
    if name not in _VQVAE_CONFIGS:
        raise UsageError(f"unknown VQVAE {name!r}; choose one of: {', '.join(_VQVAE_CONFIGS)}")
    cfg = _VQVAE_CONFIGS[name]()
    return cfg if patch_nums is None else dataclasses.replace(cfg, patch_nums=tuple(int(pn) for pn in patch_nums))


class VQVAE(nn.Module):
    """Multi-scale VQVAE with the official state_dict layout (`encoder.*`, `decoder.*`, `quantize.*`, `quant_conv.*`,
    `post_quant_conv.*`).

    Args:
        cfg: architecture; `VQVAEConfig.official()` when omitted.
    """

    def __init__(self, cfg: VQVAEConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg if cfg is not None else VQVAEConfig.official()
        arch: dict[str, Any] = dict(
            ch=cfg.ch, ch_mult=cfg.ch_mult, num_res_blocks=cfg.num_res_blocks, z_channels=cfg.z_channels
        )
        self.encoder = Encoder(**arch, dropout=cfg.dropout)
        self.decoder = Decoder(**arch, dropout=cfg.dropout)
        self.quantize = MultiScaleQuantizer(
            cfg.vocab_size,
            cfg.z_channels,
            cfg.patch_nums,
            beta=cfg.beta,
            quant_resi=cfg.quant_resi,
            share_quant_resi=cfg.share_quant_resi,
        )
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.z_channels, kernel_size=3, stride=1, padding=1)
        self.post_quant_conv = nn.Conv2d(cfg.z_channels, cfg.z_channels, kernel_size=3, stride=1, padding=1)
        self.channels_last = False  # set by `optimize_for_inference`

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor], patch_nums: Sequence[int] | None = None) -> VQVAE:
        """Build a model whose architecture is inferred from `state_dict` (see `infer_vqvae_config`) and load it."""
        model = cls(infer_vqvae_config(state_dict, patch_nums))
        model.load_state_dict(state_dict)
        return model

    def shard_units(self) -> list[nn.Module]:
        """The blocks `--fsdp` shards one by one (`TrainParts.shard_units`): the encoder's resolution levels, then
        the decoder's."""
        return [*self.encoder.down, *self.decoder.up]

    def freeze(self) -> VQVAE:
        """Eval mode and `requires_grad=False` everywhere (how VAR uses its tokenizer). Returns self."""
        self.eval()
        self.requires_grad_(False)
        return self

    def optimize_for_inference(self, channels_last: bool = True, subpixel_upsample: bool = True) -> VQVAE:
        """Frozen fast-inference setup (CPU decode of the official model ~1.3x faster; see
        benchmarks/bench_vqvae_decode.py). Same function up to float rounding (~1e-6 relative on features).

        Args:
            channels_last: keep weights and activations in NHWC (faster oneDNN convolutions).
            subpixel_upsample: nearest-x2 + conv3x3 as four 2x2 convs on the low-resolution input.

        Run the model under `torch.inference_mode()` to also get in-place elementwise ops. Returns self.
        """
        self.freeze()
        for module in self.modules():
            if isinstance(module, Upsample):
                module.subpixel = subpixel_upsample
            elif isinstance(module, AttnBlock):
                module.use_sdpa = True
        self.channels_last = channels_last
        return self.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)

    def _in_layout(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return x_BCHW.contiguous(memory_format=torch.channels_last) if self.channels_last else x_BCHW

    # ----------------------------------------------------------------------------------------------- encode
    def encode(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """Image in [-1, 1] (B, 3, H, W) -> continuous features f = quant_conv(encoder(img)), (B, C, h, w)."""
        return self.quant_conv(self.encoder(self._in_layout(img_B3HW))).contiguous()

    @torch.no_grad()
    def img_to_idx(self, img_B3HW: torch.Tensor) -> list[torch.Tensor]:
        """Image in [-1, 1] -> per-scale codes, int64 (B, pn*pn) each, row-major."""
        return self.quantize.f_to_idx(self.encode(img_B3HW))

    # ----------------------------------------------------------------------------------------------- decode
    def decode(self, f_hat_BChw: torch.Tensor) -> torch.Tensor:
        """f_hat (B, C, h, w) -> image (B, 3, H, W), NOT clamped."""
        f_hat_BChw = self._in_layout(f_hat_BChw.to(self.post_quant_conv.weight.dtype))  # f_hat is float32
        return self.decoder(self.post_quant_conv(f_hat_BChw)).contiguous()

    def fhat_to_img(self, f_hat_BChw: torch.Tensor) -> torch.Tensor:
        """f_hat (B, C, h, w) -> image clamped to [-1, 1]."""
        return self.decode(f_hat_BChw).clamp_(-1.0, 1.0)

    def idx_to_img(self, idx_list: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-scale codes -> image clamped to [-1, 1] (all scales summed at the full latent side)."""
        return self.fhat_to_img(self.quantize.idx_to_fhat(idx_list))

    # ----------------------------------------------------------------------------------------------- train
    @overload
    def forward(
        self, img_B3HW: torch.Tensor, return_features: Literal[False] = False
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]: ...

    @overload
    def forward(
        self, img_B3HW: torch.Tensor, return_features: Literal[True]
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]: ...

    def forward(self, img_B3HW: torch.Tensor, return_features: bool = False) -> tuple[Any, ...]:
        """Tokenizer-training pass: (reconstruction (B, 3, H, W), unclamped; VQ loss scalar; per-scale codes), and
        with `return_features` also the encoder features f (B, Cv, h, w) the quantizer matched (EMA codebooks)."""
        f_BChw = self.encode(img_B3HW)
        f_hat_BChw, vq_loss, idx_list = self.quantize(f_BChw)
        if return_features:
            return self.decode(f_hat_BChw), vq_loss, idx_list, f_BChw
        return self.decode(f_hat_BChw), vq_loss, idx_list

    # ------------------------------------------------------------------------------------------ checkpoints
    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> nn.modules.module._IncompatibleKeys:
        """Strict loading, except that `quantize.ema_vocab_hit_SV` may have a different number of scales (rows):
        then this model keeps its own buffer (the official behaviour; the buffer is unused at inference)."""
        ema = state_dict.get(_EMA_KEY)
        own = self.quantize.ema_vocab_hit_SV
        if (
            isinstance(ema, torch.Tensor)
            and ema.ndim == 2
            and ema.shape[1:] == own.shape[1:]
            and ema.shape != own.shape
        ):
            log.info("keeping own %s %s (checkpoint has %s)", _EMA_KEY, tuple(own.shape), tuple(ema.shape))
            state_dict = {**state_dict, _EMA_KEY: own.detach().clone()}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


@register_model("vqvae_official")
def vqvae_official(patch_nums: Sequence[int] | None = None) -> VQVAE:
    """The released `vae_ch160v4096z32` architecture (256 px; 512 px VAR passes `PATCH_NUMS_512`), random init."""
    return VQVAE(vqvae_config("vqvae_official", patch_nums))


@register_model("vqvae_digits")
def vqvae_digits(patch_nums: Sequence[int] | None = None) -> VQVAE:
    """The demo's tokenizer for 16 px digits (0.8 M parameters), random init."""
    return VQVAE(vqvae_config("vqvae_digits", patch_nums))


@register_model("vqvae_debug")
def vqvae_debug(patch_nums: Sequence[int] | None = None) -> VQVAE:
    """A tiny VQVAE for tests: 16 px images, 4x4 latent, 4 scales, random init."""
    return VQVAE(vqvae_config("vqvae_debug", patch_nums))


def _indices(state_dict: Mapping[str, Any], pattern: str) -> list[int]:
    regex = re.compile(pattern)
    return sorted({int(m.group(1)) for k in state_dict if (m := regex.fullmatch(k))})


def infer_vqvae_config(state_dict: Mapping[str, Any], patch_nums: Sequence[int] | None = None) -> VQVAEConfig:
    """Infer the architecture from the key shapes of a VQVAE state_dict (official format).

    ch, ch_mult, num_res_blocks, z_channels, vocab_size and the number of phi convs come from the shapes;
    quant_resi, beta and dropout (not stored) take the official values.

    Args:
        state_dict: an official-format VQVAE state_dict (e.g. `vae_ch160v4096z32.pth`).
        patch_nums: token-map sides. Optional when `quantize.ema_vocab_hit_SV` has 10 rows (the 256 px default is
            used); required otherwise.

    Raises:
        UsageError: the dict is not a VQVAE state_dict, or patch_nums cannot be determined.
    """
    needed = ["encoder.conv_in.weight", "encoder.conv_out.weight", "quantize.embedding.weight", _EMA_KEY]
    missing = [k for k in needed if k not in state_dict]
    if missing:
        raise UsageError(f"not a VQVAE state_dict (missing {missing}); pass the file vae_ch160v4096z32.pth")
    ch = int(state_dict["encoder.conv_in.weight"].shape[0])
    levels = _indices(state_dict, r"encoder\.down\.(\d+)\.block\.0\.conv1\.weight")
    ch_mult = tuple(int(state_dict[f"encoder.down.{i}.block.0.conv1.weight"].shape[0]) // ch for i in levels)
    num_res_blocks = len(_indices(state_dict, r"encoder\.down\.0\.block\.(\d+)\.conv1\.weight"))
    vocab_size, z_channels = (int(s) for s in state_dict["quantize.embedding.weight"].shape)
    num_phis = len(_indices(state_dict, r"quantize\.quant_resi\.qresi_ls\.(\d+)\.weight"))
    ema_rows = int(state_dict[_EMA_KEY].shape[0])
    if patch_nums is None:
        if ema_rows != len(PATCH_NUMS_256):
            raise UsageError(
                f"cannot infer patch_nums: the checkpoint was built for {ema_rows} scales; pass patch_nums explicitly"
            )
        patch_nums = PATCH_NUMS_256
    if not levels or num_res_blocks == 0 or num_phis == 0:
        raise UsageError("not an official-format VQVAE state_dict (no encoder levels or phi convs found)")
    return VQVAEConfig(
        vocab_size=vocab_size,
        z_channels=z_channels,
        ch=ch,
        ch_mult=ch_mult,
        num_res_blocks=num_res_blocks,
        share_quant_resi=num_phis,
        patch_nums=tuple(int(pn) for pn in patch_nums),
    )
