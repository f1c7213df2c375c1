"""Official MoCo v3 checkpoints in and out.

`load_official` reads what facebookresearch/moco-v3 main_moco.py saves, `{"epoch", "arch", "state_dict",
"optimizer", "scaler"}` with the DDP-wrapped model's keys (`module.base_encoder.conv1.weight`, ...), and bare state
dicts; `read_moco_state(path, unwrap=...)` also reads trainlab's own MoCo checkpoints (`ckpt/last.pt` of `trainlab
train moco`), unwrapped by the caller (`trainlab.engine.checkpoint.weights_in_checkpoint`); `export_official` writes
the official key names
back (no `module.` prefix), for main_moco.py `--resume` (after re-adding the prefix) and main_lincls.py
`--pretrained`. The architecture is inferred from the keys and shapes; the temperature is not stored by the
official code and is an argument.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainlab.errors import UsageError
from trainlab.models.backbones.resnet import _DEBUG_WIDTHS
from trainlab.models.backbones.vit import VIT_SIZES
from trainlab.models.moco.model import OFFICIAL_ARCH, MoCo
from trainlab.models.names import MocoBackbone
from trainlab.user_files import check_state_dict, load_user_file, refuse_hollow_tensors

_PREFIX = "module."
_FIX = "pass a MoCo v3 pretraining checkpoint (main_moco.py's checkpoint_*.pth.tar or trainlab's ckpt/last.pt)"
# The tensors the architecture is read from, with their ranks; the predictor is part of every MoCo v3 checkpoint
# (main_moco.py saves the whole model), and its first layer gives the projection and hidden widths.
_INFERENCE_RANKS = {
    "predictor.0.weight": 2,
    "base_encoder.cls_token": 3,
    "base_encoder.pos_embed": 3,
    "base_encoder.patch_embed.proj.weight": 4,
    "base_encoder.conv1.weight": 4,
}


def _strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if state and all(key.startswith(_PREFIX) for key in state):
        return {key[len(_PREFIX) :]: value for key, value in state.items()}
    return state


def _count_blocks(state: dict[str, torch.Tensor], pattern: str) -> int:
    found = {int(m.group(1)) for key in state if (m := re.match(pattern, key))}
    return max(found) + 1 if found else 0


def infer_arch(state: dict[str, torch.Tensor], where: str = "checkpoint") -> dict[str, Any]:
    """The `MoCo` constructor arguments (except temperature) that produce `state`'s keys and shapes (`backbone`: a
    registry name).

    Raises:
        UsageError: the keys are not those of a MoCo v3 model of a known architecture (names what was found).
    """
    if not any(key.startswith("base_encoder.") for key in state):
        if any(key.startswith(("fc.", "head.")) for key in state) and ("conv1.weight" in state or "cls_token" in state):
            raise UsageError(
                f"{where} is a linear-classification checkpoint (main_lincls.py format: a backbone with a trained "
                "fc/head classifier), not a MoCo v3 pretraining checkpoint; pass the pretraining checkpoint "
                "(main_moco.py's checkpoint_*.pth.tar or trainlab's ckpt/last.pt)"
            )
        sample = ", ".join(sorted(state)[:4])
        raise UsageError(f"{where} holds no MoCo v3 model (no base_encoder.* keys; first keys: {sample})")
    for key, rank in _INFERENCE_RANKS.items():
        value = state.get(key)
        if value is not None and (not isinstance(value, torch.Tensor) or value.ndim != rank or 0 in value.shape):
            seen = str(tuple(value.shape)) if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
            raise UsageError(f"{where}: {key} is {seen} where MoCo v3 keeps a {rank}-d tensor; {_FIX}")
    if "predictor.0.weight" not in state:
        raise UsageError(
            f"{where} lacks predictor.0.weight: it holds a base encoder but not the MoCo v3 predictor (an incomplete "
            f"or edited file); {_FIX}"
        )
    pred_in = state["predictor.0.weight"]
    mlp_dim, dim = int(pred_in.shape[0]), int(pred_in.shape[1])
    predictor_last_bn = "predictor.4.running_mean" in state
    if "base_encoder.cls_token" in state:
        conv_stem = "base_encoder.patch_embed.proj.0.weight" in state
        needed = ["base_encoder.pos_embed"] + ([] if conv_stem else ["base_encoder.patch_embed.proj.weight"])
        absent = [key for key in needed if key not in state]
        if absent:
            raise UsageError(f"{where} lacks {absent[0]}, which every MoCo v3 ViT holds; {_FIX}")
        embed_dim = int(state["base_encoder.cls_token"].shape[-1])
        depth = _count_blocks(state, r"base_encoder\.blocks\.(\d+)\.")
        num_tokens = int(state["base_encoder.pos_embed"].shape[1]) - 1
        patch = 16 if conv_stem else int(state["base_encoder.patch_embed.proj.weight"].shape[-1])
        for arch, size in VIT_SIZES.items():
            if (size.embed_dim, size.depth, size.conv_stem, size.patch_size) == (embed_dim, depth, conv_stem, patch):
                side = round(num_tokens**0.5)
                return {"backbone": arch, "dim": dim, "mlp_dim": mlp_dim, "image_size": side * patch}
        raise UsageError(
            f"{where}: unknown ViT (embedding width {embed_dim}, {depth} blocks, patch {patch}, "
            f"conv stem {conv_stem}); known: {', '.join(VIT_SIZES)}"
        )
    if "base_encoder.conv1.weight" not in state:
        raise UsageError(f"{where}: base encoder is neither a ResNet nor a ViT (first key {sorted(state)[0]})")
    conv1 = state["base_encoder.conv1.weight"]
    stages = [_count_blocks(state, rf"base_encoder\.layer{i}\.(\d+)\.") for i in range(1, 5)]
    bottleneck = "base_encoder.layer1.0.conv3.weight" in state
    found = f"ResNet with {conv1.shape[-1]}x{conv1.shape[-1]} stem of width {conv1.shape[0]}, stages {stages}"
    found += ", bottleneck blocks" if bottleneck else ", basic blocks"
    resnet_arch: MocoBackbone
    if bottleneck and stages == [3, 4, 6, 3] and conv1.shape[-1] == 7:
        resnet_arch = "tv_resnet50"
    elif not bottleneck and stages == [2, 2, 2, 2] and conv1.shape[-1] == 3 and conv1.shape[0] == 64:
        resnet_arch = "tv_resnet18_cifar"
    elif not bottleneck and stages == [1, 1, 1, 1] and conv1.shape[-1] == 3 and conv1.shape[0] == _DEBUG_WIDTHS[0]:
        resnet_arch = "tv_resnet_debug"
    else:
        raise UsageError(
            f"{where}: unknown architecture ({found}); known: tv_resnet50, tv_resnet18_cifar, tv_resnet_debug"
        )
    if predictor_last_bn:
        raise UsageError(f"{where}: a {resnet_arch} with a last-BN predictor is not MoCo v3's ResNet layout")
    return {"backbone": resnet_arch, "dim": dim, "mlp_dim": mlp_dim}


def read_moco_state(
    path: str | Path, *, unwrap: Callable[[Any, Path], Any] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The MoCo state_dict (official key names) of an official checkpoint or a bare state_dict, and what else the
    file says (`arch`, `epoch`). `unwrap`: the caller's unwrapping of a container this module does not know (a
    trainlab run's `ckpt/last.pt`: `trainlab.engine.checkpoint.weights_in_checkpoint`), applied first.

    Raises:
        UsageError: missing or unreadable file, or a checkpoint that holds no MoCo model.
    """
    path = Path(path)
    ckpt = load_user_file(path, "checkpoint", fix=_FIX)
    if unwrap is not None:
        ckpt = unwrap(ckpt, path)
    if not isinstance(ckpt, dict):
        raise UsageError(f"{path} is not a checkpoint (a {type(ckpt).__name__}, expected a dict); {_FIX}")
    extra: dict[str, Any] = {}
    state: Any
    if "state_dict" in ckpt:
        if "best_acc1" in ckpt:
            raise UsageError(
                f"{path} is a linear-classification checkpoint (main_lincls.py format, best_acc1="
                f"{float(ckpt['best_acc1']):.2f}), not a MoCo v3 pretraining checkpoint; pass the pretraining "
                "checkpoint (main_moco.py's checkpoint_*.pth.tar or trainlab's ckpt/last.pt)"
            )
        state = ckpt["state_dict"]
        extra = {"arch": ckpt.get("arch"), "epoch": ckpt.get("epoch")}
    else:
        state = ckpt  # a bare state_dict, e.g. from export_official
    if not isinstance(state, dict) or not state:
        raise UsageError(
            f"{path}: its state_dict is {type(state).__name__}, not a non-empty name -> tensor dict; {_FIX}"
        )
    if not all(isinstance(key, str) and isinstance(v, torch.Tensor) for key, v in state.items()):
        raise UsageError(f"{path}: its state_dict holds values that are not tensors; {_FIX}")
    refuse_hollow_tensors(state, str(path), _FIX)
    return _strip_prefix(state), extra


def build_moco(
    state: dict[str, torch.Tensor], *, where: str, temperature: float = 1.0, stop_grad_conv1: bool = False
) -> MoCo:
    """A `MoCo` model of the architecture `state` describes, with its weights (checked: keys, shapes, dtypes and
    finite values, before anything is loaded).

    Raises:
        UsageError: an unknown architecture, weights that do not fit it, or `stop_grad_conv1` for a model without a
            linear patch projection.
    """
    kwargs = infer_arch(state, where=where)
    if stop_grad_conv1 and not (kwargs["backbone"] in VIT_SIZES and "base_encoder.patch_embed.proj.weight" in state):
        raise UsageError(
            f"stop_grad_conv1 freezes a ViT's linear patch projection, but {where} is a {kwargs['backbone']} without "
            "one (the official code applies --stop-grad-conv1 to those ViTs only); leave it False"
        )
    with torch.device("meta"):  # the expected keys and shapes, before anything is allocated
        expected = MoCo(temperature=temperature, stop_grad_conv1=stop_grad_conv1, **kwargs).state_dict()
    check_state_dict(state, expected, source=where)
    model = MoCo(temperature=temperature, stop_grad_conv1=stop_grad_conv1, **kwargs)
    model.load_state_dict(state, strict=True)
    return model


def load_official(path: str | Path, *, temperature: float, stop_grad_conv1: bool = False) -> MoCo:
    """A `MoCo` model with the weights of an official main_moco.py checkpoint (or a trainlab MoCo checkpoint).

    `model(x1, x2, m)` then returns the official `forward(x1, x2, m)` loss in one process.

    Args:
        path: the checkpoint (loaded with `weights_only=True`).
        temperature: the run's `--moco-t` (not stored by the official code; 1.0 for ResNet, 0.2 for ViT).
        stop_grad_conv1: the run's `--stop-grad-conv1` (not stored either; the official ViT recipes train with it):
            True keeps the ViT's patch projection frozen (`requires_grad=False` on its weight and bias, in both
            encoders) when training goes on from this checkpoint. Only for ViTs with a linear patch projection.

    Raises:
        UsageError: unreadable file, a linear-probe checkpoint, an unknown architecture, weights that do not fit it
            (missing predictor, wrong shapes or dtypes, NaN / inf), or `stop_grad_conv1` for a ResNet / conv-stem ViT.
    """
    state, _ = read_moco_state(path)
    return build_moco(state, where=str(path), temperature=temperature, stop_grad_conv1=stop_grad_conv1)


def export_official(model: MoCo) -> dict[str, torch.Tensor]:
    """The state_dict with the official key names (`base_encoder.*`, `momentum_encoder.*`, `predictor.*`, no
    `module.` prefix); wrap it as {"state_dict": {"module." + k: v}, "arch": ...} for main_moco.py `--resume`."""
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def official_checkpoint(model: MoCo, *, epoch: int) -> dict[str, Any]:
    """What main_moco.py saves (without optimizer / scaler state): `epoch`, `arch`, `state_dict` with `module.`."""
    return {
        "epoch": epoch,
        "arch": OFFICIAL_ARCH[model.backbone],
        "state_dict": {_PREFIX + k: v for k, v in export_official(model).items()},
    }
