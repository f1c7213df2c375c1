"""LPIPS-style perceptual distance on VGG16 features, loaded only from a local file (never downloaded).

    d(x, y) = sum_l mean_hw( sum_c w_lc * (n(f_l(x)) - n(f_l(y)))_c^2 )

f_l are torchvision VGG16 activations relu1_2, relu2_2, relu3_3, relu4_3, relu5_3 (indices 3, 8, 15, 22, 29 of
`vgg16().features`) of the inputs after LPIPS's fixed input scaling; n() divides each feature vector by its L2 norm
over channels; w_l are LPIPS's learned non-negative linear weights when the file holds them (`lin{l}.model.1.weight`
or `lin{l}.weight`, shape (1, C_l, 1, 1)), else all ones (LPIPS's uncalibrated "baseline" variant). This is the
distance taming-transformers adds to the L1 loss when it trains VQGAN.

The weights file is a `torch.save`d dict: a torchvision `vgg16` state_dict (`features.*` keys; `classifier.*` keys
are ignored), optionally with the LPIPS linear weights merged in. The network is frozen and in eval mode.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainlab.errors import UsageError

# Shape legend: B batch, H/W image side, C feature channels, h/w feature-map side.

log = logging.getLogger(__name__)

VGG16_TAPS: tuple[int, ...] = (3, 8, 15, 22, 29)  # relu1_2, relu2_2, relu3_3, relu4_3, relu5_3
_LPIPS_SHIFT = (-0.030, -0.088, -0.188)  # LPIPS ScalingLayer: inputs in [-1, 1] -> ImageNet-normalised
_LPIPS_SCALE = (0.458, 0.448, 0.450)


class PerceptualLoss(nn.Module):
    """Frozen feature extractor + per-layer channel weights -> a per-image distance.

    Args:
        features: a sequential feature extractor (VGG16 `features[:30]` for the real loss; anything smaller in tests).
        taps: indices of `features` whose outputs are compared (ascending; the last one is the last layer run).
        lin_weights: one (1, C_l, 1, 1) non-negative weight per tap, or None for all ones.
    """

    def __init__(
        self, features: nn.Sequential, taps: Sequence[int], lin_weights: Sequence[torch.Tensor] | None = None
    ) -> None:
        super().__init__()
        if list(taps) != sorted(taps) or not taps or taps[-1] >= len(features):
            raise ValueError(f"taps must be ascending indices into the {len(features)} feature layers, got {taps}")
        self.features = features
        self.taps = tuple(int(t) for t in taps)
        self.shift_13hw: torch.Tensor
        self.scale_13hw: torch.Tensor
        self.register_buffer("shift_13hw", torch.tensor(_LPIPS_SHIFT).view(1, 3, 1, 1))
        self.register_buffer("scale_13hw", torch.tensor(_LPIPS_SCALE).view(1, 3, 1, 1))
        self.lin_weights = nn.ParameterList()
        if lin_weights is not None:
            if len(lin_weights) != len(self.taps):
                raise ValueError(f"expected {len(self.taps)} linear weights, got {len(lin_weights)}")
            for w in lin_weights:
                self.lin_weights.append(nn.Parameter(w.detach().float().reshape(1, -1, 1, 1).clone()))
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> PerceptualLoss:
        """Always stays in eval mode (a frozen metric network)."""
        return super().train(False)

    def _tapped(self, img_B3HW: torch.Tensor) -> list[torch.Tensor]:
        x_BChw = (img_B3HW - self.shift_13hw) / self.scale_13hw
        outs: list[torch.Tensor] = []
        for i, layer in enumerate(self.features):
            if i > self.taps[-1]:
                break
            x_BChw = layer(x_BChw)
            if i in self.taps:
                outs.append(x_BChw)
        return outs

    def forward(self, x_B3HW: torch.Tensor, y_B3HW: torch.Tensor) -> torch.Tensor:
        """Distance per image (B,) between images in [-1, 1]; differentiable in both inputs."""
        dist_B = x_B3HW.new_zeros(x_B3HW.shape[0], dtype=torch.float32)
        for layer_index, (fx_BChw, fy_BChw) in enumerate(zip(self._tapped(x_B3HW), self._tapped(y_B3HW))):
            fx_BChw, fy_BChw = _unit_norm(fx_BChw.float()), _unit_norm(fy_BChw.float())
            diff_BChw = (fx_BChw - fy_BChw).square()
            if len(self.lin_weights):
                per_pixel_Bhw = (diff_BChw * self.lin_weights[layer_index].float()).sum(dim=1)
            else:
                per_pixel_Bhw = diff_BChw.sum(dim=1)
            dist_B = dist_B + per_pixel_Bhw.mean(dim=(1, 2))
        return dist_B


def _unit_norm(f_BChw: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    return f_BChw / (f_BChw.square().sum(dim=1, keepdim=True).sqrt() + eps)


def vgg16_features() -> nn.Sequential:
    """torchvision's VGG16 `features[:30]` (conv1_1 ... relu5_3), built on the meta device: no weights allocated.

    Call `.to_empty(device=...)` and load a state_dict before use.
    """
    from torchvision.models import vgg16

    with torch.device("meta"):
        full = vgg16(weights=None)
    features = full.features[: VGG16_TAPS[-1] + 1]
    assert isinstance(features, nn.Sequential)
    return features


def _lin_weights(state: Mapping[str, Any], num_taps: int) -> list[torch.Tensor] | None:
    found: list[torch.Tensor] = []
    for k in range(num_taps):
        w = state.get(f"lin{k}.model.1.weight", state.get(f"lin{k}.weight"))
        if w is None:
            break
        found.append(w)
    if not found:
        return None
    if len(found) != num_taps:
        raise UsageError(f"perceptual weights file has LPIPS weights lin0..lin{len(found) - 1} only; need lin0..lin4")
    return found


def load_perceptual_loss(path: Path) -> PerceptualLoss:
    """Build the VGG16 LPIPS-style loss from a local weights file (see the module docstring for the format).

    Raises:
        UsageError: the file is missing, unreadable, or is not a VGG16 state_dict.
    """
    if not path.is_file():
        raise UsageError(
            f"--perceptual-weights {path} not found: pass a local torchvision vgg16 state_dict (.pth), "
            "or leave the flag out to train without the perceptual loss"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unpickling problem is the user's file
        first = (str(err).splitlines() or ["unreadable"])[0][:160]
        raise UsageError(f"--perceptual-weights {path} could not be read ({first}); save a plain state_dict") from None
    if not isinstance(state, dict):
        raise UsageError(f"--perceptual-weights {path} holds a {type(state).__name__}, not a vgg16 state_dict")
    features = vgg16_features()
    wanted = features.state_dict().keys()
    feature_state = {k: state[f"features.{k}"] for k in wanted if f"features.{k}" in state}
    missing = [f"features.{k}" for k in wanted if k not in feature_state]
    if missing:
        raise UsageError(
            f"--perceptual-weights {path} is not a torchvision vgg16 state_dict (missing {missing[0]} and "
            f"{len(missing) - 1} more); save torchvision.models.vgg16(...).state_dict()"
        )
    features = features.to_empty(device="cpu")
    try:
        features.load_state_dict(feature_state, strict=True)
    except RuntimeError as err:
        first = str(err).splitlines()[-1].strip()[:160]
        raise UsageError(f"--perceptual-weights {path} does not fit VGG16 ({first})") from None
    lin = _lin_weights(state, len(VGG16_TAPS))
    log.info(
        "perceptual loss on: VGG16 from %s, %s channel weights",
        path,
        "LPIPS linear" if lin is not None else "uniform (no lin0..lin4 in the file)",
    )
    return PerceptualLoss(features, VGG16_TAPS, lin)
