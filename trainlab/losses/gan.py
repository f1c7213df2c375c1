"""Adversarial losses for VQGAN-style tokenizer training (the conventions of taming-transformers).

Discriminator (D) losses, on logits of real images and of reconstructions:
    hinge    0.5 * (mean(relu(1 - real)) + mean(relu(1 + fake)))
    vanilla  0.5 * (mean(softplus(-real)) + mean(softplus(fake)))      (cross-entropy of a sigmoid classifier)
Generator (G) losses, on logits of reconstructions:
    hinge    -mean(fake)                                                (what taming uses for both D losses)
    vanilla  mean(softplus(-fake))                                      (the non-saturating loss)
All are computed in float32, whatever the autocast dtype of the logits.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from trainlab.dtypes import at_least_float32

# Shape legend: logits of any shape (a PatchGAN map is (B, 1, h, w)); losses are scalars.

GanLossKind = Literal["hinge", "vanilla"]


def discriminator_loss(logits_real: torch.Tensor, logits_fake: torch.Tensor, kind: GanLossKind) -> torch.Tensor:
    """D loss: low when real logits are high and fake logits are low.

    Args:
        logits_real: D's logits on real images.
        logits_fake: D's logits on (detached) reconstructions.
        kind: "hinge" or "vanilla".
    """
    real, fake = at_least_float32(logits_real), at_least_float32(logits_fake)
    if kind == "hinge":
        return 0.5 * (F.relu(1.0 - real).mean() + F.relu(1.0 + fake).mean())
    if kind == "vanilla":
        return 0.5 * (F.softplus(-real).mean() + F.softplus(fake).mean())
    raise ValueError(f"unknown GAN loss {kind!r}")


def generator_loss(logits_fake: torch.Tensor, kind: GanLossKind) -> torch.Tensor:
    """G's adversarial loss on D's logits for reconstructions (D frozen, gradient flows to the images)."""
    fake = at_least_float32(logits_fake)
    if kind == "hinge":
        return -fake.mean()
    if kind == "vanilla":
        return F.softplus(-fake).mean()
    raise ValueError(f"unknown GAN loss {kind!r}")


def adaptive_gan_weight(
    recon_loss: torch.Tensor, g_loss: torch.Tensor, last_layer_weight: torch.Tensor, max_weight: float = 1e4
) -> torch.Tensor:
    """Balance of the adversarial term (taming-transformers' `calculate_adaptive_weight`, without the D weight).

    w = ||d recon_loss / d W|| / (||d g_loss / d W|| + 1e-4), clamped to [0, max_weight] and detached, where W is the
    generator's last layer weight. Both losses must still have their graphs (they are retained for the backward).

    Args:
        recon_loss: the reconstruction loss (pixel + perceptual), scalar.
        g_loss: the generator's adversarial loss, scalar.
        last_layer_weight: weight of the decoder's last conv (requires grad).
        max_weight: upper clamp.

    Returns:
        A detached float32 scalar tensor.
    """
    (recon_grad,) = torch.autograd.grad(recon_loss, last_layer_weight, retain_graph=True)
    (g_grad,) = torch.autograd.grad(g_loss, last_layer_weight, retain_graph=True)
    weight = at_least_float32(recon_grad).norm() / (at_least_float32(g_grad).norm() + 1e-4)
    return weight.clamp(0.0, max_weight).detach()
