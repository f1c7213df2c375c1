"""An independent digit classifier that judges generated samples (the demo's stand-in for an Inception network).

The judge is trained only on the real "train" digits and shares no weights or code with the tokenizer or VAR, so
`conditional_accuracy` (the fraction of samples classified as the class they were conditioned on) and FID on its
`features` measure the generator, not the generator's own view of itself.

Design: conv-BN-ReLU layers (3x3; a stem at full resolution, then stride-2 convs, each but the last followed by a
stride-1 conv) down to 4x4, a linear layer to D = 64 features (after ReLU: the FID features), dropout and a linear
classifier; ~0.1 M parameters at 16x16. Training uses light random augmentation: affine (shift up to 10% of the
side, rotation up to 10 degrees, scale 0.9-1.1) and a 3x3 Gaussian blur with sigma up to 1 px, so that the judge
still recognises slightly blurry or off-centre generated digits (without the blur, a 3x3 box blur of real held-out
digits dropped its accuracy from 98% to 74%; with it, 98%). FID on its features still separates blurred digits from
sharp ones (20 vs a real-vs-real floor of 4).

    judge = train_judge(load_digits_dataset(split="train"), seed=0)  # 16x16: ~98.5% on "heldout", 12-30 s on 1 thread
"""

# Legend: B batch, N images, C channels, H/W pixels (R = H = W), D feature width, K classes.

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from trainlab.data.digits import NUM_CLASSES, DigitsData
from trainlab.errors import UsageError, first_line
from trainlab.user_files import check_state_dict

log = logging.getLogger(__name__)

DEMO_EPOCHS = 10
_FORMAT = "trainlab.digit_judge"
_FORMAT_VERSION = "1"
_MAX_SHIFT = 0.1  # fraction of the image side
_MAX_ROTATION_DEG = 10.0
_SCALE_RANGE = (0.9, 1.1)
_MAX_BLUR_SIGMA = 1.0  # pixels; generated digits are often softer than real ones


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
        if resolution not in (8, 16, 32):
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


def train_judge(
    train_data: DigitsData,
    *,
    epochs: int = DEMO_EPOCHS,
    seed: int = 0,
    device: str | torch.device = "cpu",
    batch_size: int = 128,
    lr: float = 3e-3,
    width: int = 16,
    feature_dim: int = 64,
) -> DigitJudge:
    """Train a `DigitJudge` on real digits (AdamW, one-cycle schedule, random affine + blur augmentation).

    The seed fixes initialisation, dropout, batch order and augmentation; the caller's RNG state is restored
    afterwards. On CPU the result is bitwise repeatable for a fixed thread count (not across thread counts); on CUDA
    cuDNN is put in deterministic mode for the duration.

    Args:
        train_data: real labelled digits, e.g. `load_digits_dataset(split="train")`.
        epochs: passes over `train_data` (the default, 10, gives 98.1-98.7% held-out accuracy at 16x16).
        seed: fixes everything random.
        device: where to train; the judge is returned there, in eval mode.
        batch_size: images per step (the last partial batch of each epoch is dropped).
        lr: peak learning rate.
        width: stem channels of the judge.
        feature_dim: width of the FID features.

    Returns:
        The trained judge in eval mode on `device`.
    """
    if epochs < 1:
        raise UsageError(f"judge epochs must be >= 1, got {epochs}")
    device = torch.device(device)
    # seed initialisation and dropout through the global RNG, restored afterwards so the caller's stream is untouched
    cuda_devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    with (
        torch.random.fork_rng(devices=cuda_devices),
        torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True),
    ):
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        judge = DigitJudge(resolution=train_data.resolution, width=width, feature_dim=feature_dim)
        judge.to(device).to(memory_format=torch.channels_last).train()  # channels-last convs: ~1.4x faster on CPU
        _fit(judge, train_data, epochs=epochs, seed=seed, batch_size=batch_size, lr=lr)
    return judge.eval()


@torch.no_grad()
def predict(judge: DigitJudge, images_N3HW: torch.Tensor, *, batch_size: int = 1000) -> torch.Tensor:
    """Predicted class ids (N,) int64 on CPU, computed on the judge's device (the judge is left in eval mode)."""
    return torch.cat([judge(img_B3HW).argmax(dim=1).cpu() for img_B3HW in _batches(judge, images_N3HW, batch_size)])


@torch.no_grad()
def extract_features(judge: DigitJudge, images_N3HW: torch.Tensor, *, batch_size: int = 1000) -> torch.Tensor:
    """Penultimate features (N, D) float32 on CPU, for `trainlab.evaluate.fid.fid_from_features` (eval mode)."""
    return torch.cat([judge.features(img_B3HW).cpu() for img_B3HW in _batches(judge, images_N3HW, batch_size)])


def accuracy(judge: DigitJudge, images_N3HW: torch.Tensor, labels_N: torch.Tensor) -> float:
    """Fraction of `images_N3HW` whose predicted class equals `labels_N`."""
    if labels_N.shape != (images_N3HW.shape[0],):
        raise UsageError(f"need one label per image: got labels {tuple(labels_N.shape)}, images {images_N3HW.shape[0]}")
    return (predict(judge, images_N3HW) == labels_N.cpu()).float().mean().item()


def conditional_accuracy(judge: DigitJudge, samples_N3HW: torch.Tensor, conditioned_labels_N: torch.Tensor) -> float:
    """Fraction of generated samples that the judge classifies as the class they were conditioned on.

    Args:
        judge: a trained judge at the samples' resolution.
        samples_N3HW: generated images in [-1, 1] (values outside are clamped).
        conditioned_labels_N: the class each sample was generated for.

    Returns:
        A number in [0, 1]; chance is 1/K, the judge's own held-out accuracy is the practical ceiling.
    """
    return accuracy(judge, samples_N3HW, conditioned_labels_N)


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
    fix = "re-save it with save_judge() (or run trainlab demo again)"
    if not path.is_file():
        raise UsageError(f"judge weights not found at {path}: train one with train_judge() and save_judge()")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise UsageError(f"{path} is not a readable safetensors file ({first_line(e)}): {fix}") from None
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


def _fit(judge: DigitJudge, train_data: DigitsData, *, epochs: int, seed: int, batch_size: int, lr: float) -> None:
    """The training loop of `train_judge`; batch order and augmentation come from a generator seeded with `seed`."""
    device = next(judge.parameters()).device
    images_N3HW = train_data.images_N3HW.to(device, memory_format=torch.channels_last)
    labels_N = train_data.labels_N.to(device)
    num_images = len(labels_N)
    steps_per_epoch = max(1, num_images // batch_size)
    generator = torch.Generator(device=device).manual_seed(seed)
    optimizer = torch.optim.AdamW(judge.parameters(), lr=lr, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=epochs * steps_per_epoch)
    for epoch in range(epochs):
        order_N = torch.randperm(num_images, generator=generator, device=device)
        total_loss = 0.0
        for step in range(steps_per_epoch):
            batch_B = order_N[step * batch_size : (step + 1) * batch_size]
            img_B3HW = _augment(images_N3HW[batch_B], generator)
            loss = F.cross_entropy(judge(img_B3HW), labels_N[batch_B])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total_loss += loss.item()
        log.debug("judge epoch %d/%d: loss %.4f", epoch + 1, epochs, total_loss / steps_per_epoch)


def _conv_bn_relu(in_channels: int, out_channels: int, *, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    )


def _augment(img_B3HW: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random shift, rotation and scale per image; uncovered pixels become background (-1)."""
    batch = img_B3HW.shape[0]
    unit_B4 = torch.rand(batch, 4, generator=generator, device=img_B3HW.device)  # uniform in [0, 1)
    angle_B = (unit_B4[:, 0] * 2.0 - 1.0) * math.radians(_MAX_ROTATION_DEG)
    low, high = _SCALE_RANGE
    inv_scale_B = 1.0 / (low + (high - low) * unit_B4[:, 1])
    shift_B2 = (unit_B4[:, 2:] * 2.0 - 1.0) * 2.0 * _MAX_SHIFT  # grid coordinates span 2 units per image side
    cos_B, sin_B = torch.cos(angle_B) * inv_scale_B, torch.sin(angle_B) * inv_scale_B
    theta_B23 = torch.stack(
        [
            torch.stack([cos_B, -sin_B, shift_B2[:, 0]], dim=1),
            torch.stack([sin_B, cos_B, shift_B2[:, 1]], dim=1),
        ],
        dim=1,
    )
    grid_BHW2 = F.affine_grid(theta_B23, list(img_B3HW.shape), align_corners=False)
    # sample (img + 1) so that zero padding outside the frame is background after shifting back
    warped_B3HW = F.grid_sample(img_B3HW + 1.0, grid_BHW2, mode="bilinear", padding_mode="zeros", align_corners=False)
    sigma_B = unit_B4.new_empty(batch).uniform_(0.0, _MAX_BLUR_SIGMA, generator=generator)
    return _gaussian_blur_3x3(warped_B3HW, sigma_B) - 1.0


def _gaussian_blur_3x3(img_BCHW: torch.Tensor, sigma_B: torch.Tensor) -> torch.Tensor:
    """Blur each image with its own 3x3 Gaussian (sigma in pixels; ~0 leaves it unchanged), zero padding."""
    batch, channels, height, width = img_BCHW.shape
    offsets_3 = torch.tensor([-1.0, 0.0, 1.0], device=img_BCHW.device)
    taps_B3 = torch.exp(-(offsets_3**2) / (2.0 * sigma_B.clamp_min(1e-3)[:, None] ** 2))
    taps_B3 = taps_B3 / taps_B3.sum(dim=1, keepdim=True)
    kernel_B33 = taps_B3[:, :, None] * taps_B3[:, None, :]
    kernel_K133 = kernel_B33.repeat_interleave(channels, dim=0)[:, None]  # K = B * C, one kernel per image channel
    x_1KHW = img_BCHW.reshape(1, batch * channels, height, width)
    return F.conv2d(x_1KHW, kernel_K133, padding=1, groups=batch * channels).reshape(batch, channels, height, width)


def _batches(judge: DigitJudge, images_N3HW: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Validate `images_N3HW` for `judge`, put the judge in eval mode, and cut the images into device batches."""
    expected = (3, judge.resolution, judge.resolution)
    if images_N3HW.ndim != 4 or tuple(images_N3HW.shape[1:]) != expected:
        raise UsageError(
            f"the judge takes (N, {', '.join(map(str, expected))}) images, got {tuple(images_N3HW.shape)}: "
            "resize the samples or train a judge at their resolution"
        )
    judge.eval()
    device = next(judge.parameters()).device
    return [img_B3HW.to(device, torch.float32) for img_B3HW in images_N3HW.split(batch_size)]
