"""Per-image transforms, named by what they do. Datasets apply them; `trainlab.data.sources.open_split` picks the
dataset for a transform and a data kind.

    var_resize_crop           VAR's official preprocessing: shorter side to round(1.125 R) with LANCZOS, random or
                              centre crop R, optional flip, into [-1, 1] (VAR, the tokenizer, `trainlab edit`)
    random_resized_crop_flip  RandomResizedCrop(S, scale (0.08, 1), ratio (3/4, 4/3)) + horizontal flip, normalised
                              (linear-probe training, main_lincls.py)
    resize_center_crop        Resize(round(S * 256 / 224)) of the shorter side + CenterCrop(S), normalised
                              (linear-probe evaluation: 256 + 224 at S = 224)
    two_views                 MoCo v3's two asymmetric augmented views (BYOL's recipe), normalised
    pad_crop_flip             zero-pad 4 px, crop back to the input side, horizontal flip (the CIFAR-10 recipe)
    normalise                 [0, 1] (or uint8) images -> (x - mean) / std, no augmentation

Each has a spec, a frozen dataclass holding its settings (`VarResizeCrop`, `RandomResizedCropFlip`,
`ResizeCenterCrop`, `TwoViews`, `PadCropFlip`, `Normalise`): what a recipe hands to `open_split`.

Randomness: every random choice is a pure function of (seed, epoch, sample index) through `trainlab.data.augment`
(no global RNG, no worker id), so resumed runs and any number of loader workers see the same pixels.
    var_resize_crop, random_resized_crop_flip   `augment_draws`: word 0 places the crop, the low bit of word 1 flips
    two_views                                   one word seeds a `random.Random` that draws view 1, then view 2
    pad_crop_flip                               one word: crop top, crop left and flip as mixed-radix digits

Resizing: `var_resize_crop` resizes PIL images (LANCZOS, as the official VAR; only the crop is resampled,
`pixel_ops.lanczos_resize_crop`, within 1 level on 0.05 % of pixels of resizing the whole image); the crops of
tensors resize bilinearly with antialias, where the official code resizes PIL images (bilinear). Random crops of
uint8 images are resized on their 8-bit pixels, then converted to float (`crop_to_unit_float`: torch's uint8
kernels on channels-last memory, `pixel_ops.uint8_view`), as the official PIL pipelines do; `resize_center_crop`
(evaluation) resizes in float.
Two views: the blur runs on tensors with kernel 2*ceil(3*sigma)+1 (capped to the image), where the official code
calls PIL's `GaussianBlur(radius=sigma)`: the same Gaussian, a different truncation. Hue and blur are
`trainlab.data.pixel_ops`' (torchvision's formulas, equal to them within float rounding, faster on one core).

Shape legend: C channels (3), H/W pixels, R / S output side, N images.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torchvision.transforms.functional as TF
import torchvision.transforms.v2.functional as TF2
from PIL import Image

from trainlab.data.augment import FlipMode, augment_draws, decide_flip, draw_words, mixed_radix_digits
from trainlab.data.pixel_ops import adjust_hue, gaussian_blur, lanczos_resize_crop, normalise_uint8, resized_size

CropMode = Literal["random", "center"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)  # maps [0, 1] to [-1, 1] (digits, fake images)

RESIZE_RATIO = 1.125  # VAR official: mid_reso = round(1.125 * final_reso)
CROP_MIN = 0.08  # RandomResizedCrop's default scale (0.08, 1), as main_lincls.py uses it
EVAL_RESIZE_RATIO = 256 / 224  # Resize(256) + CenterCrop(224)
MAX_EVAL_ASPECT = 16  # resize_center_crop cuts longer images to their centre first (exact for any usual photo)
CROP_PADDING = 4  # CIFAR: RandomCrop(32, padding=4)
SOLARIZE_THRESHOLD = 128 / 255  # moco/loader.py: ImageOps.solarize(threshold=128) on 8-bit pixels

Stats = tuple[float, float, float]


# ------------------------------------------------------------------------------------------------ specs
@dataclass(frozen=True)
class VarResizeCrop:
    """`var_resize_crop` at side `image_size`: {"image": (3, R, R) in [-1, 1], "label"}.

    In-memory images (digits, fake) are made at side R already: only the flip applies to them.
    """

    image_size: int
    crop: CropMode = "center"
    flip: FlipMode = "none"


@dataclass(frozen=True)
class RandomResizedCropFlip:
    """`random_resized_crop_flip` at side `image_size`, normalised with mean / std: {"image", "label"}."""

    image_size: int
    mean: Stats = IMAGENET_MEAN
    std: Stats = IMAGENET_STD


@dataclass(frozen=True)
class ResizeCenterCrop:
    """`resize_center_crop` at side `image_size`, normalised: {"image", "label"}.

    In-memory images (digits, CIFAR-10, fake) are evaluated at their own side, normalised as they are.
    """

    image_size: int
    mean: Stats = IMAGENET_MEAN
    std: Stats = IMAGENET_STD


@dataclass(frozen=True)
class TwoViews:
    """`two_views` of each image: {"view1": (3, S, S), "view2": (3, S, S), "label"}.

    Attributes:
        image_size: S, the output side.
        crop_min: smallest crop area fraction (official `--crop-min`: 0.08 ViT, 0.2 ResNet).
        blur: Gaussian blur p 1.0 / 0.1 on views 1 / 2 (False: the CIFAR-size variant, no blur).
        mean: per-channel mean subtracted from [0, 1] pixels.
        std: per-channel std divided by.
        deferred: the dataset stops after the crops (`two_view_crops`: {"view1", "view1_draws", "view2",
            "view2_draws", "label"}) and `trainlab.data.batch_views.adjust_views` finishes the batch on its device.
    """

    image_size: int
    crop_min: float = 0.08
    blur: bool = True
    mean: Stats = IMAGENET_MEAN
    std: Stats = IMAGENET_STD
    deferred: bool = False


@dataclass(frozen=True)
class PadCropFlip:
    """`pad_crop_flip` then `normalise`: {"image": (3, 32, 32), "label"} (CIFAR-format images only)."""

    mean: Stats
    std: Stats


@dataclass(frozen=True)
class Normalise:
    """`normalise` only (no augmentation). Image folders first go through the centre crop of
    `var_resize_crop` at `image_size`; in-memory images keep their side."""

    image_size: int
    mean: Stats
    std: Stats


Transform = VarResizeCrop | RandomResizedCropFlip | ResizeCenterCrop | TwoViews | PadCropFlip | Normalise


# ------------------------------------------------------------------------------------------- functions
def var_resize_crop(
    img: Image.Image,
    image_size: int,
    *,
    crop: CropMode,
    flip: FlipMode,
    draws: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """The official VAR preprocessing of one PIL image.

    Args:
        img: an RGB PIL image.
        image_size: R, the output side.
        crop: "random" (offsets from `draws[0]`) or "center".
        flip: "none", "random" (from `draws[1]`) or "always".
        draws: two 64-bit words from `augment_draws(seed, epoch, index)` for the random choices.

    Returns:
        float32 (3, R, R) in [-1, 1].
    """
    mid = round(RESIZE_RATIO * image_size)
    w, h = resized_size(img.width, img.height, mid)
    if crop == "random":
        top, left = mixed_radix_digits(draws[0], h - image_size + 1, w - image_size + 1)
    else:  # torchvision's center_crop
        top, left = round((h - image_size) / 2.0), round((w - image_size) / 2.0)
    img = lanczos_resize_crop(img, mid, top, left, image_size)
    if decide_flip(flip, draws):
        img = TF.hflip(img)
    # TF.to_tensor then 2x - 1, the same float operations with one conversion pass and no temporaries
    pixels_3HW = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1)
    x_3HW = pixels_3HW.to(torch.get_default_dtype(), memory_format=torch.contiguous_format).div_(255)
    return x_3HW.add_(x_3HW).add_(-1.0)


def to_unit_float(img_CHW: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> [0, 1]; float pixels (already in [0, 1]) -> the default dtype."""
    dtype = torch.get_default_dtype()
    return img_CHW.to(dtype).div(255.0) if img_CHW.dtype == torch.uint8 else img_CHW.to(dtype)


def crop_to_unit_float(img_CHW: torch.Tensor, top: int, left: int, h: int, w: int, size: int) -> torch.Tensor:
    """The (top, left, h, w) crop of a uint8 or [0, 1] float image resized to (size, size) (bilinear, antialiased),
    as float in [0, 1] (the default dtype). uint8 images are cropped and resized on their 8-bit pixels (rounded
    once, by the resize), then converted: the crop is all that is converted to float."""
    x_CSS = TF2.resized_crop(img_CHW, top, left, h, w, [size, size], antialias=True)
    return to_unit_float(x_CSS) if img_CHW.dtype == torch.uint8 else x_CSS.clamp(0.0, 1.0)


def random_resized_crop_box(rng: random.Random, height: int, width: int, crop_min: float) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params with `rng`: (top, left, h, w)."""
    area = height * width
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target_area = area * rng.uniform(crop_min, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height  # fallback: central crop
    if in_ratio < 3 / 4:
        w, h = width, round(width / (3 / 4))
    elif in_ratio > 4 / 3:
        h, w = height, round(height * (4 / 3))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def random_resized_crop_flip(
    img_CHW: torch.Tensor,
    image_size: int,
    *,
    seed: int,
    epoch: int,
    index: int,
    mean: Sequence[float],
    std: Sequence[float],
) -> torch.Tensor:
    """RandomResizedCrop(S) + flip of one image (uint8 or float in [0, 1]), normalised: (3, S, S) float32.

    A pure function of (image, image_size, seed, epoch, index, mean, std): word 0 of `augment_draws` seeds the
    `random.Random` that places the crop, the low bit of word 1 is the flip. A uint8 image stays 8-bit until the
    flipped crop is normalised (`normalise_uint8`, one pass).
    """
    draws = augment_draws(seed, epoch, index)
    top, left, h, w = random_resized_crop_box(random.Random(draws[0]), img_CHW.shape[-2], img_CHW.shape[-1], CROP_MIN)
    if img_CHW.dtype == torch.uint8:
        crop_3SS = TF2.resized_crop(img_CHW, top, left, h, w, [image_size, image_size], antialias=True)
        if decide_flip("random", draws):
            crop_3SS = TF2.horizontal_flip(crop_3SS)
        return normalise_uint8(crop_3SS, mean, std)
    x_CSS = crop_to_unit_float(img_CHW, top, left, h, w, image_size)
    if decide_flip("random", draws):
        x_CSS = TF2.horizontal_flip(x_CSS)
    return TF2.normalize(x_CSS, list(mean), list(std))


def resize_center_crop(
    img_CHW: torch.Tensor, image_size: int, *, mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """Resize(round(S * 256 / 224)) of the shorter side + CenterCrop(S), normalised: (3, S, S) float32.

    An image longer than `MAX_EVAL_ASPECT` times its shorter side is first cut to its central part of that aspect
    (the centre crop never sees the rest): resized whole, a valid 4,000,000 x 1 PNG would take 15 GB.
    """
    height, width = img_CHW.shape[-2:]
    longest = MAX_EVAL_ASPECT * min(height, width)
    if max(height, width) > longest:
        img_CHW = TF2.center_crop(img_CHW, [min(height, longest), min(width, longest)])
    x_CHW = TF2.resize(to_unit_float(img_CHW), [round(image_size * EVAL_RESIZE_RATIO)], antialias=True)
    x_CSS = TF2.center_crop(x_CHW, [image_size, image_size]).clamp(0.0, 1.0)
    return TF2.normalize(x_CSS, list(mean), list(std))


@dataclass(frozen=True)
class ViewDraws:
    """The random choices of one view (drawn in `draw_view`'s fixed order; `adjust_view` / `adjust_views` apply them).

    Attributes:
        box: the crop (top, left, h, w) in the source image.
        jitter_order: the colour adjustments' order (0 brightness, 1 contrast, 2 saturation, 3 hue); () when the
            jitter (p 0.8) is not applied.
        jitter: the brightness, contrast, saturation and hue factors (drawn whether or not they apply).
        grey: greyscale (p 0.2).
        blur_sigma: the Gaussian blur's sigma; 0.0 when the blur is not applied.
        blur_kernel: its kernel side, 2*ceil(3*sigma)+1 capped to the view (0 without blur).
        solarize: solarize at 128/255.
        flip: horizontal flip.
    """

    box: tuple[int, int, int, int]
    jitter_order: tuple[int, ...]
    jitter: tuple[float, float, float, float]
    grey: bool
    blur_sigma: float
    blur_kernel: int
    solarize: bool
    flip: bool

    def row(self) -> list[float]:
        """The adjustments as `VIEW_DRAW_FIELDS` numbers (the crop box left out: it is applied in the worker)."""
        order = list(self.jitter_order) or [0, 1, 2, 3]
        return [
            float(bool(self.jitter_order)),
            *map(float, order),
            *self.jitter,
            float(self.grey),
            self.blur_sigma,
            float(self.blur_kernel),
            float(self.solarize),
            float(self.flip),
        ]


# The columns of `ViewDraws.row` (what a batch of deferred views carries per view, `trainlab.data.batch_views`).
VIEW_DRAW_FIELDS = (
    "jitter",
    "order0",
    "order1",
    "order2",
    "order3",
    "brightness",
    "contrast",
    "saturation",
    "hue",
    "grey",
    "blur_sigma",
    "blur_kernel",
    "solarize",
    "flip",
)


def draw_view(
    rng: random.Random, height: int, width: int, spec: TwoViews, *, p_blur: float, p_solarize: float
) -> ViewDraws:
    """One view's choices for an image of `height` x `width`; consumes `rng` in a fixed order (crop, jitter, grey,
    blur, solarize, flip: main_moco.py's order; every probability test draws, applied or not).

    RandomResizedCrop(S, scale=(crop_min, 1)), ColorJitter(0.4, 0.4, 0.2, 0.1) with p 0.8 (the four adjustments in
    a random order, as torchvision does), RandomGrayscale p 0.2, blur sigma in [0.1, 2], solarize, flip p 0.5.
    """
    box = random_resized_crop_box(rng, height, width, spec.crop_min)
    order: tuple[int, ...] = ()
    factors = (1.0, 1.0, 1.0, 0.0)
    if rng.random() < 0.8:  # colour jitter, the four adjustments in a random order
        order = tuple(rng.sample(range(4), 4))
        brightness, contrast = rng.uniform(0.6, 1.4), rng.uniform(0.6, 1.4)
        saturation, hue = rng.uniform(0.8, 1.2), rng.uniform(-0.1, 0.1)
        factors = (brightness, contrast, saturation, hue)
    grey = rng.random() < 0.2
    sigma, kernel = 0.0, 0
    if rng.random() < p_blur:
        sigma = rng.uniform(0.1, 2.0)
        kernel = min(2 * math.ceil(3 * sigma) + 1, spec.image_size - (1 - spec.image_size % 2))
    solarize = rng.random() < p_solarize
    flip = rng.random() < 0.5
    return ViewDraws(box, order, factors, grey, sigma, kernel, solarize, flip)


def adjust_view(x_CSS: torch.Tensor, draws: ViewDraws, spec: TwoViews) -> torch.Tensor:
    """The colour jitter, greyscale, blur, solarize and flip of `draws` on one float crop in [0, 1], normalised."""
    brightness, contrast, saturation, hue = draws.jitter
    for op in draws.jitter_order:
        if op == 0:
            x_CSS = TF2.adjust_brightness(x_CSS, brightness)
        elif op == 1:
            x_CSS = TF2.adjust_contrast(x_CSS, contrast)
        elif op == 2:
            x_CSS = TF2.adjust_saturation(x_CSS, saturation)
        else:
            x_CSS = adjust_hue(x_CSS, hue)
    if draws.grey:
        x_CSS = TF2.rgb_to_grayscale(x_CSS, num_output_channels=3)
    if draws.blur_kernel:
        x_CSS = gaussian_blur(x_CSS, draws.blur_kernel, draws.blur_sigma)
    if draws.solarize:
        x_CSS = TF2.solarize(x_CSS, threshold=SOLARIZE_THRESHOLD)
    if draws.flip:
        x_CSS = TF2.horizontal_flip(x_CSS)
    return TF2.normalize(x_CSS, list(spec.mean), list(spec.std))


def view_crop(img_CHW: torch.Tensor, draws: ViewDraws, size: int) -> torch.Tensor:
    """The view's crop resized to (size, size) on the image's own pixels: uint8 stays uint8, float stays in [0, 1]."""
    top, left, h, w = draws.box
    x_CSS = TF2.resized_crop(img_CHW, top, left, h, w, [size, size], antialias=True)
    return x_CSS if img_CHW.dtype == torch.uint8 else x_CSS.clamp(0.0, 1.0)


def one_view(
    img_CHW: torch.Tensor, rng: random.Random, spec: TwoViews, *, p_blur: float, p_solarize: float
) -> torch.Tensor:
    """One augmented view of a uint8 or [0, 1] float image (C, H, W), normalised; consumes `rng` as `draw_view`.

    The crop is resized before any float conversion (`crop_to_unit_float`); the adjustments run on the float crop.
    """
    draws = draw_view(rng, img_CHW.shape[-2], img_CHW.shape[-1], spec, p_blur=p_blur, p_solarize=p_solarize)
    x_CSS = crop_to_unit_float(img_CHW, *draws.box, spec.image_size)
    return adjust_view(x_CSS, draws, spec)


def view_rng(seed: int, epoch: int, index: int) -> random.Random:
    """The `random.Random` both views of sample `index` in `epoch` draw from (view 1 first)."""
    (word,) = draw_words(seed, epoch, index, num_words=1)
    return random.Random(word)


def two_view_draws(spec: TwoViews, height: int, width: int, rng: random.Random) -> tuple[ViewDraws, ViewDraws]:
    """Views 1 and 2's choices. View 1: blur p 1.0 (0 without `spec.blur`), no solarize; view 2: blur p 0.1 (0),
    solarize p 0.2."""
    view1 = draw_view(rng, height, width, spec, p_blur=1.0 if spec.blur else 0.0, p_solarize=0.0)
    view2 = draw_view(rng, height, width, spec, p_blur=0.1 if spec.blur else 0.0, p_solarize=0.2)
    return view1, view2


def two_views(
    img_CHW: torch.Tensor, spec: TwoViews, *, seed: int, epoch: int, index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views 1 and 2 of sample `index` in `epoch`: a pure function of (image, spec, seed, epoch, index).

    Order as in main_moco.py: crop, jitter, grey, blur, solarize, flip, then normalise (`two_view_draws`).
    """
    draws = two_view_draws(spec, img_CHW.shape[-2], img_CHW.shape[-1], view_rng(seed, epoch, index))
    views = [adjust_view(crop_to_unit_float(img_CHW, *d.box, spec.image_size), d, spec) for d in draws]
    return views[0], views[1]


def two_view_crops(
    img_CHW: torch.Tensor, spec: TwoViews, *, seed: int, epoch: int, index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`two_views` stopped after the crops: (crop 1, draws 1, crop 2, draws 2), each crop (3, S, S) on the image's
    pixels (uint8 for uint8 images), each draws float64 (`VIEW_DRAW_FIELDS`,) for `batch_views.adjust_views`."""
    draws = two_view_draws(spec, img_CHW.shape[-2], img_CHW.shape[-1], view_rng(seed, epoch, index))
    crop1, crop2 = (view_crop(img_CHW, d, spec.image_size) for d in draws)
    row1, row2 = (torch.tensor(d.row(), dtype=torch.float64) for d in draws)
    return crop1, row1, crop2, row2


def pad_crop_flip_draws(seed: int, epoch: int, index: int, *, padding: int = CROP_PADDING) -> tuple[int, int, bool]:
    """The random crop offsets and flip of `pad_crop_flip` for one sample, as a pure function of its arguments.

    One 64-bit word of `trainlab.data.augment.draw_words` is split into the mixed-radix digits `top`, `left`
    (uniform in [0, 2 * padding]) and `flip`. The modulo bias is below 1e-17.

    Returns:
        (top, left, flip): crop offsets into the padded image and whether to mirror horizontally.
    """
    (word,) = draw_words(seed, epoch, index, num_words=1)
    span = 2 * padding + 1
    top, left, flip = mixed_radix_digits(word, span, span, 2)
    return top, left, flip == 1


def pad_crop_flip(
    img_3HW: torch.Tensor, top: int, left: int, flip: bool, *, padding: int = CROP_PADDING
) -> torch.Tensor:
    """Zero-pads by `padding`, crops back to the input size at (top, left), optionally mirrors left-right.

    Equivalent to torchvision's `RandomCrop(size, padding=padding)` + `RandomHorizontalFlip` with the given draws.
    """
    _, h, w = img_3HW.shape
    padded_3HW = img_3HW.new_zeros(img_3HW.shape[0], h + 2 * padding, w + 2 * padding)
    padded_3HW[:, padding : padding + h, padding : padding + w] = img_3HW
    out_3HW = padded_3HW[:, top : top + h, left : left + w]
    return out_3HW.flip(-1) if flip else out_3HW.contiguous()


def normalise(images_N3HW: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """[0, 1] (or uint8) images normalised with `mean` / `std` (evaluation inputs, no augmentation)."""
    dtype = torch.get_default_dtype()
    x = images_N3HW.to(dtype).div(255.0) if images_N3HW.dtype == torch.uint8 else images_N3HW.to(dtype)
    mean_311 = torch.tensor(mean, dtype=dtype).view(1, 3, 1, 1)
    std_311 = torch.tensor(std, dtype=dtype).view(1, 3, 1, 1)
    return (x - mean_311) / std_311
