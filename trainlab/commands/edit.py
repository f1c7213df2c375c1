"""`trainlab edit`: zero-shot in-painting, out-painting and class-conditional editing with a VAR checkpoint pair.

    trainlab edit --tokenizer-weights vae_ch160v4096z32.pth --var-weights var_d16.pth --image in.png \\
        --mask mask.png --out grid.png
    trainlab edit --tokenizer-weights ... --var-weights ... --image in.png --box 64 128 192 256 --mode edit \\
        --class 207 --out grid.png
    trainlab edit --tokenizer-weights ... --var-weights ... --image in.png --mode outpaint --pad 32 --out grid.png

The image is preprocessed like the tokenizer's data (shorter side resized to 1.125 x the side with LANCZOS, then a
center crop); the mask (white = regenerate: gray levels >= 128 count as white) or the --box (x0 y0 x1 y1, pixels of
the input image, x1 / y1 exclusive) goes through the same resize (bilinear) and crop, and a pixel is regenerated when
at least half of it comes from the mask. A mask of another size than the image is resized to it first (with a
warning). With --mode outpaint --pad P, the image is preprocessed to side - 2P and
padded back to the full side by repeating its edge pixels; the P-pixel border is the mask.
inpaint / outpaint are unconditional (the null class, as in the VAR paper) unless --class is given; edit needs
--class, which conditions the regenerated region.

Output: one grid row: the original as preprocessed (the padded canvas for outpaint), the mask over it in red, then
--num-results results. Result i uses seed --seed + i and is sampled alone (a batch of one), so it does not depend on
--num-results and equals `edit_images(..., seed=seed + i)` on that image. --save-tokens writes a list of int64
(n, pn, pn), one per scale. The command logs how far the edit bleeds into the kept region: the largest |result -
reconstruction of the original| (pixel values in [0, 1]) at each Chebyshev distance from the mask.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from trainlab.commands.sample import MAX_GUIDANCE
from trainlab.config import option, parse
from trainlab.engine.device import DEVICE_HELP
from trainlab.errors import UsageError, missing_file

if TYPE_CHECKING:  # imported where used: parsing the flags (and refusing bad ones) loads neither
    import torch
    from PIL import Image

# Shape legend: N results, H/W image side (R), 3 RGB channels, B a batch (here 1).

log = logging.getLogger(__name__)

Mode = Literal["inpaint", "outpaint", "edit"]


@dataclasses.dataclass(kw_only=True)
class EditConfig:
    """Regenerate the masked part of an image with VAR (in-painting, out-painting, class-conditional editing)."""

    tokenizer_weights: Path = option(
        help="tokenizer (VQVAE) weights: vae_ch160v4096z32.pth, or a trainlab tokenizer export or checkpoint",
        metavar="PATH",
        deprecated=("--vae-weights", "--vae"),
    )
    var_weights: Path = option(
        help="VAR weights: var_d16.pth, or a trainlab VAR export or checkpoint", metavar="PATH", deprecated=("--var",)
    )
    image: Path = option(help="the image to edit (any size; resized and center-cropped)", metavar="PNG")
    mask: Path | None = option(None, "mask image: white = regenerate", metavar="PNG")
    box: list[int] | None = option(None, "rectangle to regenerate: x0 y0 x1 y1 in input pixels", metavar="PX", ge=0)
    label: int | None = option(
        None,
        "class id conditioning the new content (none: unconditional)",
        metavar="ID",
        flag="--class",
        deprecated=("--label",),
        ge=0,
    )
    mode: Mode = option("inpaint", "inpaint / outpaint: unconditional unless --class; edit: needs --class")
    pad: int = option(0, "outpaint only: pixels of new border around the (shrunk) image", metavar="P", ge=0)
    seed: int = option(0, "result i uses seed + i", ge=0, lt=2**63)
    guidance: float = option(
        1.5, "classifier-free guidance scale", metavar="SCALE", ge=0, le=MAX_GUIDANCE, deprecated=("--cfg",)
    )
    top_k: int = option(900, "keep the K most likely tokens, 0 = all", metavar="K", ge=0)
    top_p: float = option(0.96, "nucleus mass, 1 = off", metavar="P", gt=0, le=1)
    more_smooth: bool = option(False, "Gumbel-softmax code mixing inside the mask (kept tokens stay hard)")
    num_results: int = option(
        4, "results in the grid (one row: at most 64)", metavar="N", ge=1, le=64, deprecated=("--n",)
    )
    out: Path = option(help="the grid: original, mask overlay, results", metavar="PNG")
    save_tokens: Path | None = option(None, "torch.save a list of int64 (N, pn, pn), one per scale", metavar="PT")
    device: str = option("auto", DEVICE_HELP)

    def validate(self) -> None:
        from trainlab.commands.sample import _check_writable

        if self.out.suffix.lower() != ".png":
            raise UsageError(f"--out must be a .png file, got {self.out}")
        if self.mask is not None and self.box is not None:
            raise UsageError("pass either --mask or --box, not both")
        if self.box is not None and len(self.box) != 4:
            raise UsageError(f"--box takes 4 numbers x0 y0 x1 y1, got {len(self.box)}")
        if self.box is not None and not (self.box[0] < self.box[2] and self.box[1] < self.box[3]):
            raise UsageError(f"--box {' '.join(map(str, self.box))} is empty: it needs x0 < x1 and y0 < y1")
        if self.pad and self.mode != "outpaint":
            raise UsageError("--pad extends the canvas: use it with --mode outpaint")
        if self.pad and (self.mask is not None or self.box is not None):
            raise UsageError("--pad makes the mask (the new border): drop --mask / --box")
        if not self.pad and self.mask is None and self.box is None:
            hint = " or --pad P" if self.mode == "outpaint" else ""
            raise UsageError(f"nothing marks the region to regenerate: pass --mask mask.png, --box x0 y0 x1 y1{hint}")
        if self.mode == "edit" and self.label is None:
            raise UsageError("--mode edit regenerates the masked region as a class: pass --class C")
        inputs = [("--image", self.image), ("--mask", self.mask)]
        for flag, path in inputs:
            if path is not None and not path.is_file():
                raise UsageError(f"{flag} {path} {missing_file(path)}; pass an existing image file")
        _check_writable("--out", self.out, is_dir=False)
        if self.save_tokens is not None:
            _check_writable("--save-tokens", self.save_tokens, is_dir=False)
        for out_flag, out in (("--out", self.out), ("--save-tokens", self.save_tokens)):
            for other_flag, other in (*inputs, ("--out", self.out)):
                if out is not None and other is not None and out_flag != other_flag and _same_file(out, other):
                    raise UsageError(f"{out_flag} {out} is the {other_flag} file: writing destroys it; pass another")


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (the same path, or links to one file); False where one does not exist."""
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------ inputs
def _open(path: Path, flag: str, mode: str) -> Image.Image:
    """The image through the one image reader (regular files, plain formats, a pixel limit); errors name `flag`."""
    from trainlab.data.images import UnreadableImage, read_image

    try:
        return read_image(path, mode)
    except UnreadableImage as err:
        raise UsageError(f"{flag} {err}; pass a PNG or JPEG image") from None


def _mask_image(config: EditConfig, size: tuple[int, int]) -> Image.Image:
    """The mask at the input image's size (W, H), 8-bit gray, white = regenerate."""
    from PIL import Image

    if config.box is not None:
        x0, y0, x1, y1 = config.box
        W, H = size
        if not (0 <= x0 < x1 <= W and 0 <= y0 < y1 <= H):
            raise UsageError(f"--box {x0} {y0} {x1} {y1} is not inside the {W}x{H} image with x0 < x1, y0 < y1")
        mask = Image.new("L", size, 0)
        mask.paste(255, (x0, y0, x1, y1))
        return mask
    assert config.mask is not None
    mask = _open(config.mask, "--mask", "L").point(lambda v: 255 if v >= 128 else 0)
    if mask.size != size:
        log.warning("--mask is %dx%d but the image is %dx%d: resizing the mask to the image", *mask.size, *size)
        mask = mask.resize(size, Image.Resampling.NEAREST)
    return mask


def load_inputs(config: EditConfig, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The image as the tokenizer sees it, (1, 3, R, R) in [-1, 1], and the mask (1, 1, R, R) bool (True =
    regenerate), both through the tokenizer's resize + center crop (outpaint: shrunk, then edge-padded).

    Raises:
        UsageError: unreadable files, a box outside the image, a pad too large, or a mask that marks nothing.
    """
    import torch
    import torch.nn.functional as F
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    from trainlab.data.transforms import RESIZE_RATIO, var_resize_crop

    image = _open(config.image, "--image", "RGB")
    if config.pad:
        inner = side - 2 * config.pad
        if inner < 1:
            raise UsageError(f"--pad {config.pad} leaves no image on a {side}x{side} canvas: use --pad < {side / 2:g}")
        inner_3hw = var_resize_crop(image, inner, crop="center", flip="none")
        pads = (config.pad,) * 4
        img_3HW = F.pad(inner_3hw.unsqueeze(0), pads, mode="replicate")[0]
        mask_HW = torch.ones(side, side, dtype=torch.bool)
        mask_HW[config.pad : side - config.pad, config.pad : side - config.pad] = False
    else:
        img_3HW = var_resize_crop(image, side, crop="center", flip="none")
        mask = _mask_image(config, image.size)
        mask = TF.resize(mask, round(RESIZE_RATIO * side), interpolation=InterpolationMode.BILINEAR)
        mask_HW = TF.pil_to_tensor(TF.center_crop(mask, [side, side]))[0] >= 128
    if not bool(mask_HW.any()):
        raise UsageError("the mask is all black after resizing and cropping: nothing to edit (white = regenerate)")
    return img_3HW.unsqueeze(0), mask_HW.view(1, 1, side, side)


# ------------------------------------------------------------------------------------------------ outputs
def distance_from_mask(mask_B1HW: torch.Tensor) -> torch.Tensor:
    """Chebyshev distance (pixels) of every pixel to the nearest masked one, (B, 1, H, W) int64; 0 inside the mask."""
    import torch
    import torch.nn.functional as F

    grown_B1HW = mask_B1HW.float()
    dist_B1HW = torch.where(mask_B1HW, 0, -1).long()
    d = 0
    while bool((dist_B1HW < 0).any()):
        d += 1
        grown_B1HW = F.max_pool2d(grown_B1HW, kernel_size=3, stride=1, padding=1)
        dist_B1HW = torch.where((dist_B1HW < 0) & (grown_B1HW > 0), d, dist_B1HW)
    return dist_B1HW


def seam_bleed(results_N3HW: torch.Tensor, recon_13HW: torch.Tensor, mask_11HW: torch.Tensor) -> dict[int, float]:
    """Largest |result - reconstruction| (over results and channels) at each distance d >= 1 from the mask."""
    dist_HW = distance_from_mask(mask_11HW)[0, 0]
    diff_HW = (results_N3HW - recon_13HW).abs().amax(dim=(0, 1))
    return {
        d: float(diff_HW[dist_HW == d].max()) for d in range(1, int(dist_HW.max()) + 1) if bool((dist_HW == d).any())
    }


def _overlay(img_13HW: torch.Tensor, mask_11HW: torch.Tensor) -> torch.Tensor:
    import torch

    red_13HW = torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1).expand_as(img_13HW)
    return torch.where(mask_11HW, 0.5 * img_13HW + 0.5 * red_13HW, img_13HW)


# ------------------------------------------------------------------------------------------------ command
def main(argv: list[str]) -> int:
    """Run `trainlab edit`; returns the exit code (errors raise UsageError)."""
    config = parse(EditConfig, argv, prog="trainlab edit", epilog=__doc__ or "")

    import torch

    from trainlab.commands.sample import TOKENIZER_MODEL, _save_grid, check_tokenizer_matches, load_var_pair
    from trainlab.engine.checkpoint import atomic_save, weights_in_checkpoint
    from trainlab.engine.device import resolve_device
    from trainlab.models.var.convert import read_state_dict
    from trainlab.models.var.edit import edit_tokens, encode_tokens, kept_token_maps

    device = resolve_device(config.device)
    vqvae, var = load_var_pair(config.tokenizer_weights, config.var_weights)
    check_tokenizer_matches(config.var_weights, config.tokenizer_weights, vqvae)
    vae_sd = read_state_dict(config.tokenizer_weights, "VQVAE", unwrap=weights_in_checkpoint(TOKENIZER_MODEL))
    hits = vae_sd.get("quantize.ema_vocab_hit_SV")  # one row per scale
    ema_rows = len(var.patch_nums) if hits is None else int(hits.shape[0])
    if ema_rows != len(var.patch_nums):
        raise UsageError(
            f"--tokenizer-weights {config.tokenizer_weights} was built for {ema_rows} scales but --var-weights "
            f"{config.var_weights} has "
            f"{len(var.patch_nums)} (patch_nums={var.patch_nums}): pass the tokenizer the VAR was trained with"
        )
    if config.label is not None and not 0 <= config.label < var.num_classes:
        raise UsageError(
            f"--class {config.label} is out of range: use 0..{var.num_classes - 1} (leave it out for unconditional)"
        )
    label = var.num_classes if config.label is None else config.label
    side = vqvae.cfg.image_size
    img_13HW, mask_11HW = load_inputs(config, side)
    if bool(mask_11HW.all()):
        log.warning("the mask covers the whole image: this is plain sampling (nothing of the image is kept)")
    vqvae, var = vqvae.to(device), var.to(device)

    image_tokens = encode_tokens(vqvae, img_13HW)
    kept = kept_token_maps(mask_11HW, var.patch_nums)
    log.info(
        "kept tokens per scale (of pn x pn): %s",
        ", ".join(f"{pn}x{pn}: {int(k.sum())}" for pn, k in zip(var.patch_nums, kept)),
    )
    results: list[torch.Tensor] = []
    tokens: list[list[torch.Tensor]] = []
    for i in range(config.num_results):
        samples = edit_tokens(
            var,
            vqvae,
            image_tokens,
            kept,
            [label],
            seed=config.seed + i,
            cfg=config.guidance,
            top_k=config.top_k,
            top_p=config.top_p,
            more_smooth=config.more_smooth,
        )
        with torch.inference_mode():
            results.append(vqvae.fhat_to_img(samples.f_hat).add_(1.0).mul_(0.5).float().cpu())
        tokens.append([t.view(1, pn, pn).cpu() for t, pn in zip(samples.tokens, var.patch_nums)])
    with torch.inference_mode():
        recon_13HW = vqvae.idx_to_img(image_tokens).add_(1.0).mul_(0.5).float().cpu()
    results_N3HW = torch.cat(results)

    bleed = seam_bleed(results_N3HW, recon_13HW, mask_11HW)
    if bleed:
        far = max((d for d, v in bleed.items() if v > 0.5 / 255), default=0)
        if far == max(bleed):
            verdict = "the edit changes the kept region up to its farthest pixel"
        else:
            verdict = f"identical up to 8-bit rounding beyond {far} px" if far else "identical outside the mask"
        log.info(
            "seam bleed, max |result - reconstruction| by distance from the mask (px: value in [0, 1]): %s; %s",
            ", ".join(f"{d}: {v:.3f}" for d, v in bleed.items()),
            verdict,
        )
    original_13HW = img_13HW.add(1.0).mul(0.5)
    grid_N3HW = torch.cat([original_13HW, _overlay(original_13HW, mask_11HW), results_N3HW])
    _save_grid(grid_N3HW, config.out, len(grid_N3HW))
    condition = "unconditional" if config.label is None else f"class {label}"
    print(f"wrote {config.out} (original, mask, {config.num_results} results; {config.mode}, {condition})")
    if config.save_tokens is not None:
        per_scale = [torch.cat(scale) for scale in zip(*tokens)]
        config.save_tokens.parent.mkdir(parents=True, exist_ok=True)
        atomic_save(per_scale, config.save_tokens, fix="free disk space or pass another --save-tokens")
        print(f"wrote {config.save_tokens} ({len(per_scale)} scales of int64 (N, pn, pn), N={config.num_results})")
    return 0
