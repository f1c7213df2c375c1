"""MoCo v3 (Chen, Xie, He 2021, https://arxiv.org/abs/2104.02057), after facebookresearch/moco-v3 moco/builder.py.

A base encoder (backbone + projector) with a predictor, and a momentum encoder (same constructor, parameters copied
from the base, no gradients). The loss is the symmetric InfoNCE of the official `forward(x1, x2, m)`:
ctr(q1, k2) + ctr(q2, k1), each cross-entropy x 2T over L2-normalised queries and keys.

Differences from the official module, none of which changes a number:
- `forward(x1, x2, momentum=None)` skips the momentum update (the engine runs it once per optimizer step, in the
  recipe's after-optimizer-step hook); `forward(x1, x2, m)` is the official order (queries, update, keys).
- Keys are gathered by `gather_keys` (injected by the caller; the identity by default), so the module works with no
  process group and never imports torch.distributed.
- `forward(x1, x2, keys=...)` scores the queries against keys computed before (the keys of the whole optimizer
  batch under accumulation, `batch_keys.py`) and does not run the momentum encoder.

Shape legend: B batch (per process), M keys (all processes), D projection width, C channels, H/W pixels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from trainlab.dtypes import at_least_float32
from trainlab.models.moco.resnet import RESNET_ARCHS, make_resnet, resnet_features, resnet_forward_checkpointed
from trainlab.models.moco.vit import VIT_SIZES, make_vit, vit_features

MocoArch = Literal[
    "resnet50",
    "resnet18_cifar",
    "resnet_debug",
    "vit_small",
    "vit_base",
    "vit_conv_small",
    "vit_conv_base",
    "vit_debug",
]
MOCO_ARCHS: tuple[str, ...] = get_args(MocoArch)
assert set(MOCO_ARCHS) == set(RESNET_ARCHS) | set(VIT_SIZES)

GatherKeys = Callable[[torch.Tensor], tuple[torch.Tensor, int]]
"""keys (B, D) of this process -> (keys of every process (M, D), index of this process's first key in them)."""


def local_keys(k_BD: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The single-process `GatherKeys`: the keys themselves, offset 0."""
    return k_BD, 0


def build_mlp(num_layers: int, input_dim: int, mlp_dim: int, output_dim: int, last_bn: bool = True) -> nn.Sequential:
    """The official `_build_mlp`: hidden layers Linear (no bias) -> BN -> ReLU; the last Linear (no bias) is followed
    by an affine-free BN when `last_bn` (SimCLR's design)."""
    layers: list[nn.Module] = []
    for layer in range(num_layers):
        dim1 = input_dim if layer == 0 else mlp_dim
        dim2 = output_dim if layer == num_layers - 1 else mlp_dim
        layers.append(nn.Linear(dim1, dim2, bias=False))
        if layer < num_layers - 1:
            layers += [nn.BatchNorm1d(dim2), nn.ReLU(inplace=True)]
        elif last_bn:
            layers.append(nn.BatchNorm1d(dim2, affine=False))
    return nn.Sequential(*layers)


def contrastive_loss(
    q_BD: torch.Tensor, k_BD: torch.Tensor, temperature: float, gather_keys: GatherKeys = local_keys
) -> torch.Tensor:
    """InfoNCE of queries against all keys (the positive of query i is key i of this process), x 2T.

    Computed in fp32 (a no-op for fp32 inputs, so it equals the official formula there).
    """
    q_BD = F.normalize(at_least_float32(q_BD), dim=1)
    k_BD = F.normalize(at_least_float32(k_BD), dim=1)
    k_MD, offset = gather_keys(k_BD)
    logits_BM = torch.einsum("nc,mc->nm", q_BD, k_MD) / temperature
    labels_B = torch.arange(q_BD.shape[0], dtype=torch.long, device=q_BD.device) + offset
    return F.cross_entropy(logits_BM, labels_B) * (2 * temperature)


def momentum_update_(base: nn.Module, momentum_encoder: nn.Module, momentum: float) -> None:
    """theta_k <- m * theta_k + (1 - m) * theta_q on every parameter (frozen ones included), never on buffers.

    The expression is the official one, so the result is bit-identical to `_update_momentum_encoder`.
    """
    with torch.no_grad():
        for param_b, param_m in zip(base.parameters(), momentum_encoder.parameters(), strict=True):
            param_m.copy_(param_m * momentum + param_b.detach() * (1.0 - momentum))


class MoCo(nn.Module):
    """MoCo v3: `base_encoder` (backbone + projector as its classifier), `momentum_encoder`, `predictor`.

    Args:
        arch: backbone, one of `MOCO_ARCHS`.
        dim: output width of projector and predictor (official `--moco-dim`, 256).
        mlp_dim: hidden width of the MLPs (official `--moco-mlp-dim`, 4096).
        temperature: softmax temperature T (official `--moco-t`: 1.0 for ResNet, 0.2 for ViT).
        image_size: input side (ViT only: fixes the position table).
        stop_grad_conv1: ViT only: keep the patch projection at its random init.
    """

    def __init__(
        self,
        arch: MocoArch,
        *,
        dim: int = 256,
        mlp_dim: int = 4096,
        temperature: float = 1.0,
        image_size: int = 224,
        stop_grad_conv1: bool = False,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.temperature = temperature
        self.gather_keys: GatherKeys = local_keys
        self.is_vit = arch.startswith("vit")
        base: Any
        momentum_encoder: Any
        if self.is_vit:
            base = make_vit(arch, num_classes=mlp_dim, image_size=image_size, stop_grad_conv1=stop_grad_conv1)
            momentum_encoder = make_vit(
                arch, num_classes=mlp_dim, image_size=image_size, stop_grad_conv1=stop_grad_conv1
            )
            hidden_dim = int(base.head.weight.shape[1])
            base.head = build_mlp(3, hidden_dim, mlp_dim, dim)
            momentum_encoder.head = build_mlp(3, hidden_dim, mlp_dim, dim)
            predictor = build_mlp(2, dim, mlp_dim, dim)
        else:
            base = make_resnet(arch, num_classes=mlp_dim)
            momentum_encoder = make_resnet(arch, num_classes=mlp_dim)
            hidden_dim = int(base.fc.weight.shape[1])
            base.fc = build_mlp(2, hidden_dim, mlp_dim, dim)
            momentum_encoder.fc = build_mlp(2, hidden_dim, mlp_dim, dim)
            predictor = build_mlp(2, dim, mlp_dim, dim, last_bn=False)
        self.base_encoder: nn.Module = base
        self.momentum_encoder: nn.Module = momentum_encoder
        self.predictor = predictor  # registered after the encoders: the official state_dict order
        self.activation_checkpointing = False  # see `set_activation_checkpointing`
        for param_b, param_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters(), strict=True):
            param_m.data.copy_(param_b.data)
            param_m.requires_grad = False

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute in backward: each ViT block (timm's `set_grad_checkpointing` on both encoders; the momentum
        encoder runs without gradients, where it saves nothing) or each ResNet stage of the base encoder (in
        training with gradients only; BatchNorm statistics are updated once, as without)."""
        from timm.models.vision_transformer import VisionTransformer

        self.activation_checkpointing = enabled
        if self.is_vit:
            for encoder in (self.base_encoder, self.momentum_encoder):
                assert isinstance(encoder, VisionTransformer), type(encoder)
                encoder.set_grad_checkpointing(enabled)

    def encode(self, encoder: nn.Module, x_BCHW: torch.Tensor) -> torch.Tensor:
        """`encoder(x_BCHW)`, with the ResNet stages checkpointed when that is on and gradients are recorded."""
        from torchvision.models.resnet import ResNet

        if not self.is_vit and self.activation_checkpointing and self.training and torch.is_grad_enabled():
            assert isinstance(encoder, ResNet), type(encoder)
            return resnet_forward_checkpointed(encoder, x_BCHW)
        out: torch.Tensor = encoder(x_BCHW)
        return out

    def update_momentum_encoder(self, momentum: float) -> None:
        """theta_k <- m * theta_k + (1 - m) * theta_q (parameters only)."""
        momentum_update_(self.base_encoder, self.momentum_encoder, momentum)

    def contrastive_loss(self, q_BD: torch.Tensor, k_BD: torch.Tensor) -> torch.Tensor:
        return contrastive_loss(q_BD, k_BD, self.temperature, self.gather_keys)

    def forward(
        self, x1_BCHW: torch.Tensor, x2_BCHW: torch.Tensor, momentum: float | None = None, keys: Any = None
    ) -> torch.Tensor:
        """The symmetric loss of two views. With `momentum`, the momentum update runs between queries and keys
        (the official order); with None it is left to the caller (once per optimizer step)."""
        q1_BD = self.predictor(self.encode(self.base_encoder, x1_BCHW))
        q2_BD = self.predictor(self.encode(self.base_encoder, x2_BCHW))
        with torch.no_grad():
            if momentum is not None:
                self.update_momentum_encoder(momentum)
            if keys is None:
                k1_BD = self.momentum_encoder(x1_BCHW)
                k2_BD = self.momentum_encoder(x2_BCHW)
        if keys is not None:  # a `batch_keys.MicroBatchKeys`: the optimizer batch's keys, computed before
            loss: torch.Tensor = keys.loss(q1_BD, q2_BD, self.temperature)
            return loss
        return self.contrastive_loss(q1_BD, k2_BD) + self.contrastive_loss(q2_BD, k1_BD)

    def features(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        """Backbone features of the base encoder (before the projector): what kNN and linear probes read."""
        return backbone_features(self.base_encoder, x_BCHW)


def backbone_features(encoder: nn.Module, x_BCHW: torch.Tensor) -> torch.Tensor:
    """Features (B, F) of a MoCo ResNet or ViT backbone, without its projector / classifier."""
    from timm.models.vision_transformer import VisionTransformer
    from torchvision.models.resnet import ResNet

    if isinstance(encoder, VisionTransformer):
        return vit_features(encoder, x_BCHW)
    assert isinstance(encoder, ResNet), type(encoder)
    return resnet_features(encoder, x_BCHW)


def cosine_momentum(step: int, total_steps: int, base_momentum: float) -> float:
    """The official `adjust_moco_momentum`: 1 - (1 + cos(pi * step / total)) / 2 * (1 - m0), from m0 to 1."""
    import math

    return 1.0 - 0.5 * (1.0 + math.cos(math.pi * step / max(total_steps, 1))) * (1.0 - base_momentum)
