"""An independent digit classifier that judges generated samples (the demo's stand-in for an Inception network).

The judge is trained only on the real "train" digits (`trainlab train judge`) and shares no weights or code with the
tokenizer or VAR, so the share of samples it classifies as the class they were conditioned on, and FID on its
`features`, measure the generator, not the generator's own view of itself.

Design: conv-BN-ReLU layers (3x3; a stem at full resolution, then stride-2 convs, each but the last followed by a
stride-1 conv) down to 4x4, a linear layer to D = 64 features (after ReLU: the FID features), dropout and a linear
classifier; ~0.1 M parameters at 16x16. Registered as `digit_judge`. Weights travel as a safetensors file with the
constructor arguments in its metadata (`save_judge` / `load_judge`).
"""

# Shape legend: B batch, C channels, H/W pixels (R = H = W), D feature width, K classes.

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from trainlab.errors import UsageError, first_line, missing_file
from trainlab.models.registry import register_model
from trainlab.user_files import check_state_dict

NUM_CLASSES = 10
RESOLUTIONS = (8, 16, 32)
_FORMAT = "trainlab.digit_judge"
_FORMAT_VERSION = "1"


class DigitJudge(nn.Module):
    """Small CNN classifier for (B, 3, R, R) digits in [-1, 1].

    Args:
        resolution: side R of the input images: 8, 16 or 32.
        width: channels of the stem; the first downsampling stage has 2x, later ones 4x.
        feature_dim: width D of the penultimate features used for FID.
        num_classes: number of classes K.
    """

    def __init__(
        self, *, resolution: int = 16, width: int = 16, feature_dim: int = 64, num_classes: int = NUM_CLASSES
    ) -> None:
        super().__init__()
        if resolution not in RESOLUTIONS:
            raise UsageError(f"DigitJudge resolution {resolution} is not supported: use 8, 16 or 32")
        self.resolution = resolution
        self.width = width
        self.feature_dim = feature_dim
        self.num_classes = num_classes
        layers: list[nn.Module] = [_conv_bn_relu(3, width)]
        in_channels = width
        num_downsamples = int(math.log2(resolution // 4))
        for stage in range(num_downsamples):
            out_channels = width * 2 ** min(stage + 1, 2)
            layers.append(_conv_bn_relu(in_channels, out_channels, stride=2))
            if stage < num_downsamples - 1:
                layers.append(_conv_bn_relu(out_channels, out_channels))
            in_channels = out_channels
        self.trunk = nn.Sequential(*layers)
        self.embed = nn.Linear(in_channels * 4 * 4, feature_dim)
        self.dropout = nn.Dropout(0.2)
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """Penultimate features (B, D), non-negative (after ReLU). Inputs are clamped to [-1, 1] first."""
        x_BCHW = self.trunk(img_B3HW.clamp(-1.0, 1.0))
        return F.relu(self.embed(x_BCHW.flatten(1)))

    def forward(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """Class logits (B, K)."""
        return self.head(self.dropout(self.features(img_B3HW)))


@register_model("digit_judge")
def digit_judge(
    resolution: int = 16, width: int = 16, feature_dim: int = 64, num_classes: int = NUM_CLASSES
) -> DigitJudge:
    """The demo's digit judge (~0.1 M parameters at 16 px), random init."""
    return DigitJudge(resolution=resolution, width=width, feature_dim=feature_dim, num_classes=num_classes)


def _conv_bn_relu(in_channels: int, out_channels: int, *, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    )


# ------------------------------------------------------------------------------------------------- weights file
def save_judge(judge: DigitJudge, path: str | Path) -> None:
    """Write the judge's weights and architecture to a safetensors file."""
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in judge.state_dict().items()}
    metadata = {
        "format": _FORMAT,
        "format_version": _FORMAT_VERSION,
        "resolution": str(judge.resolution),
        "width": str(judge.width),
        "feature_dim": str(judge.feature_dim),
        "num_classes": str(judge.num_classes),
    }
    save_file(state, str(path), metadata=metadata)


_METADATA_INTS = ("resolution", "width", "feature_dim", "num_classes")  # DigitJudge's constructor arguments


def load_judge(path: str | Path, *, device: str | torch.device = "cpu") -> DigitJudge:
    """Read a judge written by `save_judge`; returned in eval mode on `device`.

    Raises:
        UsageError: a missing or unreadable file, metadata that does not describe a judge (a missing key, a value
            that is not a positive integer), or weights that do not fit it (keys, shapes, dtypes, NaN / inf).
    """
    path = Path(path)
    fix = "pass a judge's .safetensors file (RUN_DIR/judge.safetensors of `trainlab train judge`, or the demo's)"
    if not path.is_file():
        raise UsageError(f"judge weights {path} {missing_file(path)}: train one with `trainlab train judge`")
    if path.suffix != ".safetensors" and zipfile.is_zipfile(path):  # a torch.save file: a checkpoint, not the export
        raise UsageError(f"{path} is a torch checkpoint, not a judge's safetensors weights file; {fix}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise UsageError(f"{path} is not a readable safetensors file ({first_line(e)}); {fix}") from None
    if metadata.get("format") != _FORMAT or metadata.get("format_version") != _FORMAT_VERSION:
        raise UsageError(
            f"{path} is not a trainlab digit-judge file (v{_FORMAT_VERSION}): re-save it with save_judge()"
        )
    sizes: dict[str, int] = {}
    for key in _METADATA_INTS:
        text = metadata.get(key)
        if text is None:
            raise UsageError(f"judge file {path} lacks the metadata key {key!r}: {fix}")
        try:
            sizes[key] = int(text)
        except ValueError:
            raise UsageError(f"judge file {path}: metadata {key!r} is {text!r}, not an integer: {fix}") from None
        if sizes[key] < 1:
            raise UsageError(f"judge file {path}: metadata {key!r} is {sizes[key]}, it must be >= 1: {fix}")
    try:
        with torch.device("meta"):  # the expected shapes, without allocating what the metadata claims
            expected = DigitJudge(**sizes).state_dict()
    except UsageError as err:
        raise UsageError(f"judge file {path}: {err}; {fix}") from None
    check_state_dict(state, expected, source=f"judge file {path}")
    judge = DigitJudge(**sizes)
    judge.load_state_dict(state, strict=True)
    return judge.to(device).eval()
