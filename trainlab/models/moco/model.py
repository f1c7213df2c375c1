"""MoCo v3 (Chen, Xie, He 2021, https://arxiv.org/abs/2104.02057), after facebookresearch/moco-v3 moco/builder.py.

A base encoder (backbone + projector) with a predictor, and a momentum encoder (same constructor, parameters copied
from the base, no gradients). The loss is the symmetric InfoNCE of the official `forward(x1, x2, m)`:
ctr(q1, k2) + ctr(q2, k1), each cross-entropy x 2T over L2-normalised queries and keys (`losses/infonce.py`).
Backbones come from the model registry (`models/backbones/`): torchvision's ResNets (`tv_resnet50`, ...) or MoCo
v3's ViTs (`moco_vit_small`, ...).

Differences from the official module, none of which changes a number:
- `forward(x1, x2, momentum=None)` skips the momentum update (the engine runs it once per optimizer step, in the
  recipe's after-optimizer-step hook); `forward(x1, x2, m)` is the official order (queries, update, keys).
- Keys are gathered by `gather_keys` (injected by the caller; the identity by default), so the module works with no
  process group and never imports torch.distributed.
- `forward(x1, x2, keys=...)` scores the queries against keys computed before (the keys of the whole optimizer
  batch under accumulation, `batch_keys.py`) and does not run the momentum encoder.

Shape legend: B batch (per process), D projection width, C channels, H/W pixels, F backbone feature width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainlab.losses.infonce import GatherKeys, infonce_loss, local_keys
from trainlab.models.backbones.vit import VIT_SIZES
from trainlab.models.grad_checkpoint import set_grad_checkpointing
from trainlab.models.names import MocoBackbone
from trainlab.models.registry import create_model

OFFICIAL_ARCH: dict[str, str] = {
    "tv_resnet50": "resnet50",
    "tv_resnet18_cifar": "resnet18",
    "tv_resnet_debug": "resnet18",
    "moco_vit_small": "vit_small",
    "moco_vit_base": "vit_base",
    "moco_vit_conv_small": "vit_conv_small",
    "moco_vit_conv_base": "vit_conv_base",
    "moco_vit_debug": "vit_small",
}
"""The `arch` main_moco.py records for each backbone (its torchvision / vits.py constructor name)."""


def is_vit(backbone: str) -> bool:
    """Whether `backbone` is one of MoCo v3's ViTs (else a torchvision ResNet)."""
    return backbone in VIT_SIZES


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


def momentum_update_(base: nn.Module, momentum_encoder: nn.Module, momentum: float) -> None:
    """theta_k <- m * theta_k + (1 - m) * theta_q on every parameter (frozen ones included), never on buffers.

    The expression is the official one, so the result is bit-identical to `_update_momentum_encoder`.
    """
    with torch.no_grad():
        for param_b, param_m in zip(base.parameters(), momentum_encoder.parameters(), strict=True):
            param_m.copy_(param_m * momentum + param_b.detach() * (1.0 - momentum))


def _encoder(backbone: str, *, mlp_dim: int, image_size: int, stop_grad_conv1: bool) -> nn.Module:
    """The backbone with its classifier `mlp_dim` wide (replaced by the projector), as main_moco.py builds it."""
    if is_vit(backbone):
        return create_model(backbone, num_classes=mlp_dim, image_size=image_size, stop_grad_conv1=stop_grad_conv1)
    return create_model(backbone, num_classes=mlp_dim, zero_init_residual=True)


class MoCo(nn.Module):
    """MoCo v3: `base_encoder` (backbone + projector as its classifier), `momentum_encoder`, `predictor`.

    Args:
        backbone: a registry name, one of `MOCO_BACKBONES`.
        dim: output width of projector and predictor (official `--moco-dim`, 256).
        mlp_dim: hidden width of the MLPs (official `--moco-mlp-dim`, 4096).
        temperature: softmax temperature T (official `--moco-t`: 1.0 for ResNet, 0.2 for ViT).
        image_size: input side (ViT only: fixes the position table).
        stop_grad_conv1: ViT only: keep the patch projection at its random init.
    """

    def __init__(
        self,
        backbone: MocoBackbone,
        *,
        dim: int = 256,
        mlp_dim: int = 4096,
        temperature: float = 1.0,
        image_size: int = 224,
        stop_grad_conv1: bool = False,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.temperature = temperature
        self.gather_keys: GatherKeys = local_keys
        self.is_vit = is_vit(backbone)
        base: Any = _encoder(backbone, mlp_dim=mlp_dim, image_size=image_size, stop_grad_conv1=stop_grad_conv1)
        momentum_encoder: Any = _encoder(
            backbone, mlp_dim=mlp_dim, image_size=image_size, stop_grad_conv1=stop_grad_conv1
        )
        if self.is_vit:
            hidden_dim = int(base.head.weight.shape[1])
            base.head = build_mlp(3, hidden_dim, mlp_dim, dim)
            momentum_encoder.head = build_mlp(3, hidden_dim, mlp_dim, dim)
            predictor = build_mlp(2, dim, mlp_dim, dim)
        else:
            hidden_dim = int(base.fc.weight.shape[1])
            base.fc = build_mlp(2, hidden_dim, mlp_dim, dim)
            momentum_encoder.fc = build_mlp(2, hidden_dim, mlp_dim, dim)
            predictor = build_mlp(2, dim, mlp_dim, dim, last_bn=False)
        self.base_encoder: nn.Module = base
        self.momentum_encoder: nn.Module = momentum_encoder
        self.predictor = predictor  # registered after the encoders: the official state_dict order
        for param_b, param_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters(), strict=True):
            param_m.data.copy_(param_b.data)
            param_m.requires_grad = False

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        """Recompute in backward: each ViT block or each ResNet stage, in both encoders (the momentum encoder runs
        without gradients, where it saves nothing; BatchNorm statistics are updated once, as without)."""
        for encoder in (self.base_encoder, self.momentum_encoder):
            supported = set_grad_checkpointing(encoder, enabled)
            assert supported, f"{type(encoder).__name__} has no set_grad_checkpointing"

    def shard_units(self) -> list[nn.Module]:
        """The blocks `--fsdp` shards one by one (`TrainParts.shard_units`): each ViT block or ResNet stage of the
        base encoder, then the encoder around them, the same for the momentum encoder (sharded alike: its momentum
        update runs on the local shards). The encoders are units of their own because they are also called
        outside `forward` (the keys of a whole optimizer batch, the features)."""
        return [
            *encoder_blocks(self.base_encoder),
            self.base_encoder,
            *encoder_blocks(self.momentum_encoder),
            self.momentum_encoder,
        ]

    def update_momentum_encoder(self, momentum: float) -> None:
        """theta_k <- m * theta_k + (1 - m) * theta_q (parameters only)."""
        momentum_update_(self.base_encoder, self.momentum_encoder, momentum)

    def contrastive_loss(self, q_BD: torch.Tensor, k_BD: torch.Tensor) -> torch.Tensor:
        """InfoNCE x 2T of queries against the keys of every process (`losses/infonce.py`)."""
        return infonce_loss(q_BD, k_BD, self.temperature, self.gather_keys)

    def forward(
        self, x1_BCHW: torch.Tensor, x2_BCHW: torch.Tensor, momentum: float | None = None, keys: Any = None
    ) -> torch.Tensor:
        """The symmetric loss of two views. With `momentum`, the momentum update runs between queries and keys
        (the official order); with None it is left to the caller (once per optimizer step)."""
        q1_BD = self.predictor(self.base_encoder(x1_BCHW))
        q2_BD = self.predictor(self.base_encoder(x2_BCHW))
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
        """Backbone features (B, F) of the base encoder (before the projector): what kNN and linear probes read."""
        return backbone_features(self.base_encoder, x_BCHW)


def encoder_blocks(encoder: nn.Module) -> list[nn.Module]:
    """A backbone's repeated blocks in forward order: a ViT's `blocks`, a ResNet's four stages."""
    blocks = getattr(encoder, "blocks", None)
    if isinstance(blocks, nn.Sequential | nn.ModuleList):
        return list(blocks)
    return [getattr(encoder, f"layer{i}") for i in range(1, 5)]


def backbone_features(encoder: nn.Module, x_BCHW: torch.Tensor) -> torch.Tensor:
    """Pooled features (B, F) of a backbone with timm's interface, without its projector / classifier (a ResNet's
    pooled last stage, a ViT's normalised cls token)."""
    feats: torch.Tensor = encoder.forward_head(encoder.forward_features(x_BCHW), pre_logits=True)  # type: ignore[operator]
    return feats
