"""Parameter groups with and without weight decay (the official VAR `filter_params` rule, usable by any recipe).

A parameter gets no weight decay when it has one dimension (biases, norms, gains), its name ends in "bias", or its
name contains one of the keywords (learned positional tables, class / start tokens, AdaLN gains).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

# Official `train.py` nowd_keys; with `filter_params`' rule "1-D or name ends with bias" they select no-decay params.
NO_WEIGHT_DECAY_KEYWORDS = (
    "cls_token",
    "start_token",
    "task_token",
    "cfg_uncond",
    "pos_embed",
    "pos_1LC",
    "pos_start",
    "start_pos",
    "lvl_embed",
    "gamma",
    "beta",
    "ada_gss",
    "moe_bias",
    "scale_mul",
)


def no_weight_decay(name: str, param: nn.Parameter, keywords: Sequence[str] = NO_WEIGHT_DECAY_KEYWORDS) -> bool:
    """Official `filter_params`: 1-D parameters, biases and names containing one of `keywords`."""
    return param.ndim == 1 or name.endswith("bias") or any(k in name for k in keywords)


def param_groups(
    model: nn.Module, weight_decay: float, lr: float, keywords: Sequence[str] = NO_WEIGHT_DECAY_KEYWORDS
) -> list[dict[str, Any]]:
    """Two groups, decayed and not, both at the same peak lr (the schedule keeps per-group ratios); frozen
    parameters are in neither."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if no_weight_decay(name, param, keywords) else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "lr": lr, "group": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr, "group": "no_decay"},
    ]
