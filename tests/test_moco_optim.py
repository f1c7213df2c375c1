"""LARS against the published update rule (facebookresearch/moco-v3 moco/optimizer.py), step by step in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainlab.optim import LARS


def _reference_step(
    p: np.ndarray, g: np.ndarray, mu: np.ndarray, *, lr: float, wd: float, momentum: float, eta: float
) -> tuple[np.ndarray, np.ndarray]:
    if p.ndim > 1:
        g = g + wd * p
        p_norm, g_norm = np.linalg.norm(p), np.linalg.norm(g)
        trust = eta * p_norm / g_norm if p_norm > 0 and g_norm > 0 else 1.0
        g = g * trust
    mu = momentum * mu + g
    return p - lr * mu, mu


def test_lars_follows_the_rule_step_by_step() -> None:
    rng = np.random.default_rng(0)
    values = {"weight": rng.normal(size=(4, 3)), "bias": rng.normal(size=(4,)), "zero": np.zeros((2, 2))}
    params = {k: torch.nn.Parameter(torch.tensor(v, dtype=torch.float64)) for k, v in values.items()}
    lr, wd, momentum, eta = 0.5, 1e-2, 0.9, 0.001
    opt = LARS(params.values(), lr=lr, weight_decay=wd, momentum=momentum, trust_coefficient=eta)
    ref = {k: (v.copy(), np.zeros_like(v)) for k, v in values.items()}
    for _step in range(4):
        grads = {k: rng.normal(size=v.shape) for k, v in values.items()}
        for k, p in params.items():
            p.grad = torch.tensor(grads[k])
        opt.step()
        for k in params:
            p_ref, mu_ref = _reference_step(ref[k][0], grads[k], ref[k][1], lr=lr, wd=wd, momentum=momentum, eta=eta)
            ref[k] = (p_ref, mu_ref)
            np.testing.assert_allclose(params[k].detach().numpy(), p_ref, rtol=1e-12, atol=1e-15)
    # the 1-D parameter got plain momentum SGD (no decay, no trust ratio): its total move is lr * sum of buffers
    assert not np.allclose(params["bias"].detach().numpy(), values["bias"])
    # a zero matrix falls back to trust ratio 1 (and moves)
    assert np.abs(params["zero"].detach().numpy()).max() > 0


def test_lars_trust_ratio_scales_only_matrices() -> None:
    w = torch.nn.Parameter(torch.ones(2, 2))
    b = torch.nn.Parameter(torch.ones(2))
    opt = LARS([w, b], lr=1.0, weight_decay=0.0, momentum=0.0, trust_coefficient=0.001)
    w.grad, b.grad = torch.full((2, 2), 3.0), torch.full((2,), 3.0)
    opt.step()
    # matrix: update scaled to eta * ||w|| / ||g|| * g = 0.001 * 2 / 6 * 3 = 0.001 per entry
    assert torch.allclose(w, torch.full((2, 2), 1 - 0.001))
    assert torch.allclose(b, torch.full((2,), 1 - 3.0))
    assert w.grad is not None and opt.state[w]["mu"].shape == (2, 2)
    assert pytest.approx(float(opt.param_groups[0]["lr"])) == 1.0
