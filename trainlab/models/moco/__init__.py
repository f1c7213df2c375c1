"""MoCo v3 models: the MoCo module (ResNet / ViT backbones, projector, predictor, momentum encoder), its loss and
momentum update, and official checkpoint loading / export."""

from __future__ import annotations

from trainlab.models.moco.builder import (
    MOCO_ARCHS,
    MoCo,
    MocoArch,
    backbone_features,
    build_mlp,
    contrastive_loss,
    cosine_momentum,
    local_keys,
    momentum_update_,
)
from trainlab.models.moco.official import (
    build_moco,
    export_official,
    infer_arch,
    load_official,
    official_checkpoint,
    read_moco_state,
)

__all__ = [
    "MOCO_ARCHS",
    "MoCo",
    "MocoArch",
    "backbone_features",
    "build_mlp",
    "build_moco",
    "contrastive_loss",
    "cosine_momentum",
    "export_official",
    "infer_arch",
    "load_official",
    "local_keys",
    "momentum_update_",
    "official_checkpoint",
    "read_moco_state",
]
