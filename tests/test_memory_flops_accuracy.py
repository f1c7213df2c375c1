"""The FLOP counter against analytic counts of a VAR, a ResNet-50 and a ViT-S training step (within 1 %).

The counter runs over the real step's dispatch (here on real tensors of small inputs, one sample or two); the
expected numbers come from each architecture's layer shapes, not from the dispatch:

    forward  = 2 x MACs of the matrix products, convolutions and attention (2 FLOPs per multiply-add);
    backward = 2 x forward for matrix products and convolutions (one product for the input's gradient, one for the
               weight's) minus the input gradient of the first layer, which nothing needs (the images / token
               embeddings do not require gradients); 2.5 x forward for attention (torch's count of a fused attention
               backward: it recomputes Q K^T, then dV, dP, dQ, dK: 5 products against the forward's 2).
The optimizer's count (elementwise, per parameter) is checked against the toy MLP in test_memory_flops.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from trainlab.memory.flop_counter import FlopCounter
from trainlab.models.registry import create_model
from trainlab.models.var.transformer import VAR, VARConfig


def _counted(model: nn.Module, forward: Any) -> tuple[int, int]:
    """(forward, backward) FLOPs of one step of `forward()` -> loss, counted over the dispatch."""
    tracer = SimpleNamespace(region="forward", step=0)
    counter = FlopCounter(tracer)  # type: ignore[arg-type]
    with counter:
        loss = forward()
        tracer.region = "backward"
        loss.backward()
    return counter.flops[(0, "forward")], counter.flops[(0, "backward")]


def _layer_macs(model: nn.Module, run: Any) -> tuple[int, int]:
    """MACs of every nn.Conv2d / nn.Linear call of `run()` from the layers' shapes (module hooks, no dispatch), and
    those of the first layer called."""
    macs: list[int] = []

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            k = module.kernel_size[0] * module.kernel_size[1] * module.in_channels // module.groups
            macs.append(out.numel() * k)
        elif isinstance(module, nn.Linear):
            macs.append(out.numel() * module.in_features)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        run()
    for h in handles:
        h.remove()
    return sum(macs), macs[0]


def test_resnet50_at_64_px() -> None:
    torch.manual_seed(0)
    model = create_model("tv_resnet50", num_classes=1000)
    x = torch.randn(2, 3, 64, 64)
    forward, backward = _counted(model, lambda: model(x).sum())
    macs, stem = _layer_macs(model, lambda: model(x))
    assert forward == pytest.approx(2 * macs, rel=0.01)
    assert backward == pytest.approx(2 * (2 * macs) - 2 * stem, rel=0.01)


def test_vit_small() -> None:
    """Linear layers from their shapes, plus attention: 2 products (Q K^T, A V) of L x L x D per block."""
    torch.manual_seed(0)
    model = create_model("moco_vit_small", num_classes=0, image_size=64)
    x = torch.randn(1, 3, 64, 64)
    forward, backward = _counted(model, lambda: model(x).sum())
    linear_macs, stem = _layer_macs(model, lambda: model(x))
    L, D, depth = (64 // 16) ** 2 + 1, 384, 12
    attention_macs = depth * 2 * L * L * D
    assert forward == pytest.approx(2 * (linear_macs + attention_macs), rel=0.01)
    assert backward == pytest.approx(2 * 2 * linear_macs + 2.5 * 2 * attention_macs - 2 * stem, rel=0.01)


def test_var_debug() -> None:
    """VAR by its formula: word embedding B (L-1) Cv C; per block AdaLN B C 6C, qkv B L C 3C, projection B L C C, MLP
    2 B L C 4C, block-causal attention sum over query segments 2 B l k C; head AdaLN B C 2C, head B L C V."""
    torch.manual_seed(0)
    B, C, V, Cv, depth = 2, 64, 64, 8, 2
    cfg = VARConfig.from_depth(
        depth,
        embed_dim=C,
        num_heads=2,
        patch_nums=(1, 2, 3, 4),
        vocab_size=V,
        num_classes=10,
        vae_embed_dim=Cv,
        drop_path_rate=0.0,
    )
    model = VAR(cfg)
    L = sum(p * p for p in cfg.patch_nums)
    x = torch.randn(B, L - 1, Cv)
    label = torch.zeros(B, dtype=torch.long)
    forward, backward = _counted(model, lambda: model(label, x).sum())
    attention = sum(2 * B * (s.q_end - s.q_start) * s.k_end * C for s in model._segments(L))
    block = B * C * 6 * C + B * L * C * 3 * C + B * L * C * C + 2 * B * L * C * 4 * C
    embed = B * (L - 1) * Cv * C
    macs = embed + depth * block + B * C * 2 * C + B * L * C * V
    assert forward == pytest.approx(2 * (macs + depth * attention), rel=0.01)
    assert backward == pytest.approx(2 * 2 * macs + 2.5 * 2 * depth * attention - 2 * embed, rel=0.01)
