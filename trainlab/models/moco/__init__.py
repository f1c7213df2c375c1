"""MoCo v3 models: the MoCo module (a registry backbone, projector, predictor, momentum encoder) and its momentum
update (`model`), and official checkpoint loading / export (`convert`). The loss is `trainlab.losses.infonce`, the
momentum schedule `trainlab.optim.momentum`, the backbones `trainlab.models.backbones`."""

from __future__ import annotations

from trainlab.models.moco.convert import (
    build_moco,
    export_official,
    infer_arch,
    load_official,
    official_checkpoint,
    read_moco_state,
)
from trainlab.models.moco.model import (
    MoCo,
    backbone_features,
    build_mlp,
    is_vit,
    momentum_update_,
)

__all__ = [
    "MoCo",
    "backbone_features",
    "build_mlp",
    "build_moco",
    "export_official",
    "infer_arch",
    "is_vit",
    "load_official",
    "momentum_update_",
    "official_checkpoint",
    "read_moco_state",
]
