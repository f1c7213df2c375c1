"""BatchNorm under accumulation (--batchnorm-decay per-optimizer-step): k micro-batches decay the running statistics
as much as one large-batch step, 1 - (1 - m)^(1/k) per micro-batch, on every BatchNorm of every recipe, logged."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from trainlab.engine.batchnorm_momentum import batchnorms, decay_per_optimizer_step_, micro_step_momentum
from trainlab.engine.loop import Trainer
from trainlab.recipes.moco import MocoConfig, MocoRecipe


@pytest.mark.parametrize("k", [2, 4, 7])
def test_k_micro_steps_with_identical_statistics_are_one_large_batch_step(k: int) -> None:
    """The large batch is k copies of one micro-batch (identical micro-batch statistics): its mean is the micro-batch
    mean, and the running mean after k micro-steps equals the large batch's after one. The running variance decays the
    same way; the statistic it moves towards is each batch's unbiased variance, whose n / (n - 1) differs between b and
    k x b samples (the rule makes the decay equal, not the statistics)."""
    torch.manual_seed(0)
    large = nn.BatchNorm1d(5, momentum=0.1)
    large.running_mean.normal_()
    large.running_var.uniform_(0.5, 2.0)
    micro, plain = copy.deepcopy(large), copy.deepcopy(large)
    decay_per_optimizer_step_([micro], k)
    assert micro.momentum == pytest.approx(1 - 0.9 ** (1 / k))
    x_bC = torch.randn(8, 5) * 3 + 1
    large(x_bC.repeat(k, 1))
    for _ in range(k):
        micro(x_bC)
        plain(x_bC)
    torch.testing.assert_close(micro.running_mean, large.running_mean, rtol=1e-6, atol=1e-6)
    var_b, var_kb = x_bC.var(0, unbiased=True), x_bC.repeat(k, 1).var(0, unbiased=True)
    torch.testing.assert_close(micro.running_var - 0.1 * var_b, large.running_var - 0.1 * var_kb, rtol=1e-5, atol=1e-6)
    # without the rule the old statistics decay by 0.9^k per optimizer step instead of 0.9
    assert (plain.running_mean - large.running_mean).abs().max() > 1e-2


def test_micro_step_momentum_edges() -> None:
    assert micro_step_momentum(0.1, 1) == pytest.approx(0.1)
    assert micro_step_momentum(1.0, 4) == 1.0  # the last batch's statistics only, as the large batch
    assert micro_step_momentum(0.0, 4) == 0.0
    cumulative = nn.BatchNorm2d(3, momentum=None)
    assert "cumulative average left" in decay_per_optimizer_step_([cumulative], 4)
    assert cumulative.momentum is None


def test_the_engine_sets_every_batchnorm_and_logs_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    base = dataclasses.replace(
        MocoRecipe(MocoConfig()).debug_config(), run_dir=tmp_path / "a", tensorboard=False, progress=False
    )
    caplog.set_level(logging.INFO, logger="trainlab.engine.assemble")  # where a run is assembled
    cfg = dataclasses.replace(base, grad_accumulation=4, batchnorm_decay="per-optimizer-step")
    layers = batchnorms(Trainer(MocoRecipe(cfg)).parts.models.values())
    assert len(layers) > 5
    assert all(layer.momentum == pytest.approx(1 - 0.9**0.25) for layer in layers)
    assert "decay per optimizer step as the large batch's" in caplog.text
    caplog.clear()
    default = dataclasses.replace(base, run_dir=tmp_path / "b", grad_accumulation=4)
    assert {layer.momentum for layer in batchnorms(Trainer(MocoRecipe(default)).parts.models.values())} == {0.1}
    assert "updated at each micro-batch" in caplog.text and "--batchnorm-decay per-optimizer-step" in caplog.text
