"""Zero-shot editing with VAR (in-painting, out-painting, class-conditional editing), as in the VAR paper's
zero-shot generalisation experiments: encode the image to its token maps at every scale, then sample scale by scale
and, right after each scale is drawn, overwrite the positions outside the mask with the image's tokens
("teacher-force the ground truth outside the mask, generate only inside it"). The overwrite is `generate`'s
`token_hook`, so it happens before the scale is embedded:
the next scale's input, the accumulated f_hat and the KV cache are all built from the edited token maps.

Mask rule (`kept_token_maps`): a token is kept (ground truth) only if its cell lies entirely outside the mask.
    1. pixels -> latent grid (side h = patch_nums[-1]): a latent cell is masked if any of its pixels is masked
       (max-pool over the downsample x downsample pixels; adaptive when the side does not divide).
    2. latent grid -> scale pn: adaptive max-pool, i.e. cell i covers latent rows [floor(i h / pn), ceil((i+1) h /
       pn)), the same cells `F.interpolate(mode="area")` averages when the tokenizer quantizes scale pn (so with a
       non-dividing grid neighbouring cells overlap, and a latent row on the overlap marks both).
Why "entirely outside": a token whose cell is partly masked was computed (area average) from features of the region
to regenerate, so keeping it would copy the erased content back into the hole (e.g. the lower half of a digit).
The coarse scales therefore keep little (scale 1x1 is kept only for an empty mask) and the model fills them in.
What the rule cannot remove: the encoder's receptive field (a few pixels) and the tokenizer's bicubic upsampling and
phi convs mix neighbouring cells, so kept tokens next to the mask still carry a little of the masked content, and the
decoder spreads the regenerated content a few pixels into the kept region (the CLI measures that seam).

Labels: `num_classes` (the null class) gives unconditional in/out-painting, as in the paper; a class id conditions
the regenerated region on that class (class-conditional editing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainlab.errors import UsageError
from trainlab.models.var.sample import LogitsHook, Samples, check_sampling_args, generate
from trainlab.models.var.transformer import VAR
from trainlab.models.var.vqvae import VQVAE

# Shape legend: B images, H/W image side, h latent side (= patch_nums[-1]), pn side of one scale, l = pn^2 tokens of
# one scale, Cv code width.


@dataclass
class EditResult:
    """What `edit_images` returns.

    Attributes:
        images: edited images (B, 3, H, W) float32 in [0, 1] (like `sample_images`).
        tokens: per-scale token maps (B, pn^2) int64 of the edited images.
        kept: per-scale bool maps (B, pn^2): True where the image's token was kept.
        f_hat: the accumulated tokenizer features (B, Cv, h, w) the images were decoded from.
    """

    images: torch.Tensor
    tokens: list[torch.Tensor]
    kept: list[torch.Tensor]
    f_hat: torch.Tensor


def kept_token_maps(mask_B1HW: torch.Tensor, patch_nums: Sequence[int]) -> list[torch.Tensor]:
    """Reduce a pixel mask (True / nonzero = regenerate) to each scale's grid by the module's rule.

    Args:
        mask_B1HW: bool or float mask at image resolution (any side that is at least patch_nums[-1]).
        patch_nums: token-map sides, coarse to fine; the last is the latent side.

    Returns:
        one bool tensor (B, pn^2) per scale, row-major: True where the token's cell lies entirely outside the mask.
    """
    if mask_B1HW.ndim != 4 or mask_B1HW.shape[1] != 1:
        raise UsageError(f"mask must have shape (B, 1, H, W), got {tuple(mask_B1HW.shape)}")
    side = patch_nums[-1]
    if min(mask_B1HW.shape[-2:]) < side:
        raise UsageError(f"mask of side {tuple(mask_B1HW.shape[-2:])} is smaller than the latent grid {side}")
    masked_B1hw = F.adaptive_max_pool2d((mask_B1HW != 0).float(), side)
    B = mask_B1HW.shape[0]
    return [F.adaptive_max_pool2d(masked_B1hw, pn).reshape(B, pn * pn) == 0 for pn in patch_nums]


@torch.inference_mode()
def encode_tokens(vqvae: VQVAE, image_B3HW: torch.Tensor) -> list[torch.Tensor]:
    """Image in [-1, 1] (B, 3, H, W) at the tokenizer's side -> its per-scale token maps (B, pn^2) int64."""
    side = vqvae.cfg.image_size
    if image_B3HW.ndim != 4 or image_B3HW.shape[1] != 3 or tuple(image_B3HW.shape[-2:]) != (side, side):
        raise UsageError(
            f"images must be (B, 3, {side}, {side}) for this tokenizer, got {tuple(image_B3HW.shape)}: resize and "
            "crop them first (trainlab.data.transforms.var_resize_crop)"
        )
    device = next(vqvae.parameters()).device
    return vqvae.img_to_idx(image_B3HW.to(device=device, dtype=torch.float32))


def edit_tokens(
    var: VAR,
    vqvae: VQVAE,
    image_tokens: Sequence[torch.Tensor],
    kept: Sequence[torch.Tensor],
    labels_B: torch.Tensor | Sequence[int],
    *,
    seed: int,
    cfg: float = 1.5,
    top_k: int = 900,
    top_p: float = 0.96,
    more_smooth: bool = False,
    logits_hook: LogitsHook | None = None,
) -> Samples:
    """Sample with the image's tokens written over every kept position of every scale (the sampling loop of
    `generate`, same seed semantics and random stream; see `sample_tokens` for the sampling arguments).

    Args:
        image_tokens: the image's per-scale tokens (B, pn^2) (`encode_tokens`).
        kept: per-scale bool maps (B, pn^2), True = keep the image's token (`kept_token_maps`).
        logits_hook: as for `generate` (sees each scale's guided logits).

    Returns:
        the edited per-scale tokens and the accumulated f_hat.
    """
    device = var.pos_start.device
    check_sampling_args(var, vqvae, torch.as_tensor(labels_B, dtype=torch.int64), cfg, top_k, top_p)
    patch_nums = var.patch_nums
    if len(image_tokens) != len(patch_nums) or len(kept) != len(patch_nums):
        raise UsageError(f"need one token map and one kept map per scale ({len(patch_nums)} scales)")
    B = len(labels_B)
    for pn, idx, keep in zip(patch_nums, image_tokens, kept):
        if tuple(idx.shape) != (B, pn * pn) or tuple(keep.shape) != (B, pn * pn):
            raise UsageError(
                f"scale {pn}x{pn}: tokens {tuple(idx.shape)} and kept map {tuple(keep.shape)} must both be "
                f"({B}, {pn * pn}) for {B} labels"
            )
    truth = [idx.to(device=device, dtype=torch.int64) for idx in image_tokens]
    keep_maps = [keep.to(device=device, dtype=torch.bool) for keep in kept]

    def write_kept(si: int, idx_Bl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.where(keep_maps[si], truth[si], idx_Bl), keep_maps[si]

    return generate(
        var,
        vqvae,
        labels_B,
        seed=seed,
        cfg=cfg,
        top_k=top_k,
        top_p=top_p,
        more_smooth=more_smooth,
        logits_hook=logits_hook,
        token_hook=write_kept,
    )


def edit_images(
    var: VAR,
    vqvae: VQVAE,
    image_B3HW: torch.Tensor,
    mask_B1HW: torch.Tensor,
    labels_B: torch.Tensor | Sequence[int],
    *,
    seed: int,
    cfg: float = 1.5,
    top_k: int = 900,
    top_p: float = 0.96,
    more_smooth: bool = False,
) -> EditResult:
    """Regenerate the masked part of each image, keeping the image's tokens outside the mask at every scale.

    Args:
        var, vqvae: a matching transformer + tokenizer pair (sampling runs on the transformer's device).
        image_B3HW: images in [-1, 1] at the tokenizer's side (the tokenizer's preprocessing).
        mask_B1HW: True / nonzero = regenerate, at the images' resolution; a batch of 1 applies to every image.
        labels_B: per image, a class id, or `num_classes` for unconditional in/out-painting.
        seed, cfg, top_k, top_p, more_smooth: as for `sample_images` (row b of a batch draws like row b of
            `sample_images` with the same seed and batch size).

    Returns:
        `EditResult`: edited images in [0, 1], per-scale tokens, the kept maps, f_hat.

    Raises:
        UsageError: wrong image / mask shapes, class ids out of range, bad sampling options, a mismatched pair.
    """
    check_sampling_args(var, vqvae, torch.as_tensor(labels_B, dtype=torch.int64), cfg, top_k, top_p)
    B = image_B3HW.shape[0]
    if mask_B1HW.ndim == 4 and mask_B1HW.shape[0] == 1 and B > 1:
        mask_B1HW = mask_B1HW.expand(B, -1, -1, -1)
    if tuple(mask_B1HW.shape[-2:]) != tuple(image_B3HW.shape[-2:]) or mask_B1HW.shape[0] != B:
        raise UsageError(
            f"mask {tuple(mask_B1HW.shape)} does not fit images {tuple(image_B3HW.shape)}: pass (B or 1, 1, H, W)"
        )
    if len(labels_B) != B:
        raise UsageError(f"{len(labels_B)} labels for {B} images: pass one class id per image")
    image_tokens = encode_tokens(vqvae, image_B3HW)
    kept = kept_token_maps(mask_B1HW, var.patch_nums)
    samples = edit_tokens(
        var,
        vqvae,
        image_tokens,
        kept,
        labels_B,
        seed=seed,
        cfg=cfg,
        top_k=top_k,
        top_p=top_p,
        more_smooth=more_smooth,
    )
    with torch.inference_mode():
        images_B3HW = vqvae.fhat_to_img(samples.f_hat).add_(1.0).mul_(0.5).float()
    return EditResult(images=images_B3HW, tokens=samples.tokens, kept=[k.cpu() for k in kept], f_hat=samples.f_hat)
