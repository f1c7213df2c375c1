"""Optimizer settings, one spelling: the nested `optim` group of every recipe, its one linear-scaling rule, the
optimizers it builds (the same as built by hand), and the former flat spellings (one release, with a warning)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from trainlab.config import parse
from trainlab.errors import UsageError
from trainlab.optim import LARS
from trainlab.optim.config import OptimConfig
from trainlab.recipes import get_recipe, list_recipes
from trainlab.recipes.cifar import CifarConfig
from trainlab.recipes.linear_probe import LinearProbeConfig
from trainlab.recipes.moco import MocoConfig
from trainlab.recipes.tokenizer import TokenizerConfig
from trainlab.recipes.toy import ToyConfig
from trainlab.recipes.var import VARTrainConfig


@pytest.mark.parametrize("name", list_recipes())
def test_every_recipe_has_the_optim_group(name: str) -> None:
    config = get_recipe(name).config_class()
    assert isinstance(config.optim, OptimConfig)
    config.optim.validate()
    assert config.optim.peak_lr(config.batch_size) > 0


def test_the_one_linear_scaling_rule() -> None:
    base = OptimConfig(name="adamw", base_learning_rate=1e-4)
    assert base.scales_with_batch and base.peak_lr(768) == 1e-4 * 768 / 256
    assert "= base 0.0001 x batch 768 / 256 = 0.0003" in base.describe_lr(768)
    peak = OptimConfig(name="sgd", learning_rate=0.1)
    assert not peak.scales_with_batch and peak.peak_lr(768) == 0.1 == peak.peak_lr(16)


def test_exactly_one_learning_rate_and_two_betas() -> None:
    with pytest.raises(UsageError, match="are both set; keep one"):
        OptimConfig(learning_rate=0.1, base_learning_rate=0.2).validate()
    with pytest.raises(UsageError, match="no learning rate"):
        OptimConfig().validate()
    with pytest.raises(UsageError, match=r"--optim\.betas takes two values"):
        OptimConfig(name="adam", learning_rate=0.1, betas=(0.9,)).validate()


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return list(nn.Linear(4, 3).parameters())


def _step(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[torch.Tensor]:
    for _ in range(2):
        optimizer.zero_grad()
        sum(p.square().sum() for p in params).backward()  # type: ignore[union-attr]
        optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize(
    ("optim", "by_hand"),
    [
        (
            OptimConfig(name="sgd", learning_rate=0.1, momentum=0.8, weight_decay=5e-4),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.8, weight_decay=5e-4),
        ),
        (
            OptimConfig(name="lars", base_learning_rate=0.6, momentum=0.9, weight_decay=1e-6),
            lambda p: LARS(p, 0.6 * 64 / 256, weight_decay=1e-6, momentum=0.9),
        ),
        (
            OptimConfig(name="adam", learning_rate=2e-4, betas=(0.5, 0.9)),
            lambda p: torch.optim.Adam(p, lr=2e-4, betas=(0.5, 0.9)),
        ),
        (
            OptimConfig(name="adamw", base_learning_rate=1e-3, betas=(0.9, 0.95), weight_decay=0.05),
            lambda p: torch.optim.AdamW(p, lr=1e-3 * 64 / 256, betas=(0.9, 0.95), weight_decay=0.05),
        ),
    ],
    ids=["sgd", "lars", "adam", "adamw"],
)
def test_build_equals_the_optimizer_built_by_hand(optim: OptimConfig, by_hand: object) -> None:
    ours_params, theirs_params = _params(), _params()
    ours = optim.build(ours_params, batch_size=64, device=torch.device("cpu"))
    theirs = by_hand(theirs_params)  # type: ignore[operator]
    assert type(ours) is type(theirs)
    for a, b in zip(_step(ours, ours_params), _step(theirs, theirs_params)):
        assert torch.equal(a, b)


def test_fused_applies_to_adam_on_cpu_and_cuda_only() -> None:
    optim = OptimConfig(name="adamw", learning_rate=1e-3, fused=True)
    assert optim.build(_params(), batch_size=1, device=torch.device("cpu")).defaults["fused"] is True
    assert optim.build(_params(), batch_size=1, device=torch.device("meta")).defaults["fused"] is None


# ------------------------------------------------------------------------------------------- former spellings
@pytest.mark.parametrize(
    ("cls", "argv", "expected"),
    [
        (ToyConfig, ["--learning-rate", "0.2", "--weight-decay", "0.01"], {"learning_rate": 0.2, "weight_decay": 0.01}),
        (CifarConfig, ["--momentum", "0.8", "--learning-rate", "0.05"], {"momentum": 0.8, "learning_rate": 0.05}),
        (
            VARTrainConfig,
            ["--betas", "0.8", "0.99", "--fused-optimizer", "false"],
            {"betas": (0.8, 0.99), "fused": False},
        ),
        (VARTrainConfig, ["--base-learning-rate", "2e-4"], {"base_learning_rate": 2e-4, "learning_rate": -1.0}),
        (MocoConfig, ["--optimizer", "adamw", "--optimizer-momentum", "0.8"], {"name": "adamw", "momentum": 0.8}),
        (LinearProbeConfig, ["--base-learning-rate", "3"], {"base_learning_rate": 3.0, "name": "sgd"}),
        (TokenizerConfig, ["--generator-learning-rate", "1e-3"], {"learning_rate": 1e-3, "betas": (0.5, 0.9)}),
        (TokenizerConfig, ["--adam-beta1", "0.6"], {"betas": (0.6, 0.9), "name": "adam"}),
    ],
)
def test_former_optimizer_flags_set_the_optim_group_with_a_warning(
    cls: type, argv: list[str], expected: dict[str, object], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    extra = ["--discriminator-layers", "2", "--model", "vqvae_debug"] if cls is TokenizerConfig else []
    with caplog.at_level(logging.WARNING):
        config = parse(cls, [*argv, *extra, "--run-dir", str(tmp_path)], prog="t")
    assert {k: getattr(config.optim, k) for k in expected} == expected
    assert "former spelling" in caplog.text and "--optim." in caplog.text


def test_a_former_beta_flag_that_contradicts_optim_betas_is_refused(tmp_path: Path) -> None:
    argv = ["--discriminator-layers", "2", "--model", "vqvae_debug", "--run-dir", str(tmp_path)]
    with pytest.raises(UsageError, match=r"ask for betas 0.5 0.95 but --optim.betas is 0.9 0.95; pass only"):
        parse(TokenizerConfig, ["--adam-beta1", "0.5", "--optim.betas", "0.9", "0.95", *argv], prog="t")
    agreeing = parse(TokenizerConfig, ["--adam-beta1", "0.9", "--optim.betas", "0.9", "0.95", *argv], prog="t")
    assert agreeing.optim.betas == (0.9, 0.95)


def test_mocos_momentum_stays_the_encoder_coefficient(tmp_path: Path) -> None:
    """`--momentum` is MoCo's momentum-encoder coefficient (official --moco-m); SGD / LARS momentum is
    `--optim.momentum` in every recipe (CIFAR's former `--momentum` only in CIFAR)."""
    config = parse(MocoConfig, ["--momentum", "0.9", "--run-dir", str(tmp_path)], prog="t")
    assert config.momentum == 0.9 and config.optim.momentum == MocoConfig().optim.momentum


def test_former_optimizer_yaml_keys_move_into_the_group(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("base_learning_rate: 1.5e-4\nbetas: [0.9, 0.95]\nweight_decay: 0.1\nfused_optimizer: false\n")
    with caplog.at_level(logging.WARNING):
        config = parse(VARTrainConfig, ["--config", str(path)], prog="t")
    want = dataclasses.replace(VARTrainConfig().optim, base_learning_rate=1.5e-4, weight_decay=0.1, fused=False)
    assert config.optim == want
    assert "'base_learning_rate' is the former name of 'optim.base_learning_rate'" in caplog.text


def test_a_partial_group_keeps_the_recipes_optimizer(tmp_path: Path) -> None:
    """`--optim.learning-rate 0.05` on CIFAR changes the rate only: still SGD, momentum 0.9, weight decay 5e-4."""
    config = parse(CifarConfig, ["--optim.learning-rate", "0.05", "--run-dir", str(tmp_path)], prog="t")
    assert config.optim == dataclasses.replace(CifarConfig().optim, learning_rate=0.05)
