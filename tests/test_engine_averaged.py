"""The averaged-weights slot (`TrainParts.averaged`, `engine/ema.py`) and what `--debug` checks across a resume.

A DiT-like toy recipe, defined here as a newcomer would write it (a class-conditional denoiser trained on the latents
of a frozen encoder, plus an EMA of the denoiser that evaluation uses), passes `--debug` and resumes bit for bit, the
EMA included. The same recipe with its EMA kept outside the slot (in `frozen`, or in a recipe attribute) fails the
check, naming what differs.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainlab.config import option
from trainlab.data.tensors import NamedTensorDataset
from trainlab.engine.checkpoint import averaged_weights, load_checkpoint
from trainlab.engine.debug import DEBUG_OVERRIDES, debug_run_config, run_debug_check
from trainlab.engine.ema import WeightAverage, averaged_copy, update_average_
from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts
from trainlab.optim.config import OptimConfig

# Shape legend: B batch, D image features, L latent width, W model width.

EmaHome = Literal["slot", "frozen", "attribute"]


@dataclass(kw_only=True)
class DitConfig(TrainConfig):
    """A class-conditional denoiser on a frozen encoder's latents, with an EMA of its weights."""

    run_dir: Path = option(Path("runs/dit"), "output directory")
    num_samples: int = option(512, "training images", ge=1)
    ema_decay: float = option(0.9, "decay of the denoiser's EMA (0: off)", ge=0, lt=1)
    ema_home: EmaHome = option("slot", "where the EMA lives: the engine's slot, or (wrongly) frozen / an attribute")
    optim: OptimConfig = option(OptimConfig(name="adamw", learning_rate=1e-2), "optimizer (AdamW)")
    batch_size: int = option(32, "global batch", gt=0)


class Denoiser(nn.Module):
    def __init__(self, latent: int = 8, classes: int = 4, width: int = 32) -> None:
        super().__init__()
        self.label_embed = nn.Embedding(classes, width)
        self.time_embed = nn.Linear(1, width)
        self.net = nn.Sequential(nn.Linear(latent + width, width), nn.GELU(), nn.Dropout(0.1), nn.Linear(width, latent))

    def forward(self, z_BL: torch.Tensor, t_B: torch.Tensor, y_B: torch.Tensor) -> torch.Tensor:
        cond_BW = self.label_embed(y_B) + self.time_embed(t_B[:, None])
        return self.net(torch.cat([z_BL, cond_BW], dim=1))


def _images(n: int, seed: int) -> NamedTensorDataset:
    g = torch.Generator().manual_seed(seed)
    return NamedTensorDataset(image=torch.randn(n, 16, generator=g), label=torch.randint(4, (n,), generator=g))


class DitRecipe(Recipe[DitConfig]):
    name = "dit-toy"
    config_class = DitConfig
    best_metric = "ema_loss"
    best_mode = "min"

    def __init__(self, config: DitConfig) -> None:
        super().__init__(config)
        self.eval_set = _images(64, seed=config.seed + 1)
        self.attribute_ema: nn.Module | None = None
        self.handed_to_fit_end: list[str] = []

    @property
    def ema_name(self) -> str:
        return "dit_ema"

    def build(self, device: torch.device) -> TrainParts:
        c = self.config
        encoder = nn.Linear(16, 8)  # the frozen "VAE"
        dit = Denoiser()
        optimizer = torch.optim.AdamW(dit.parameters(), lr=c.optim.learning_rate)
        parts = TrainParts(models={"dit": dit}, phases=[Phase("main", optimizer, ["dit"])], frozen={"vae": encoder})
        if c.ema_home == "slot":
            parts.averaged[self.ema_name] = WeightAverage(follows="dit", decay=c.ema_decay)
        elif c.ema_home == "frozen":  # the written rule before the slot: "used but not trained goes in frozen"
            parts.frozen[self.ema_name] = copy.deepcopy(dit)
        else:
            self.attribute_ema = copy.deepcopy(dit).eval().requires_grad_(False)
        return parts

    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        return _images(self.config.num_samples, seed=self.config.seed)

    def example_batch(self, batch_size: int) -> Batch:
        return {"image": torch.zeros(batch_size, 16), "label": torch.zeros(batch_size, dtype=torch.long)}

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        dtype = next(models["dit"].parameters()).dtype  # the precision mode's (the frozen encoder stays fp32)
        z_BL = models["vae"](batch["image"].float()).to(dtype)
        noise_BL = torch.randn_like(z_BL)
        t_B = torch.rand(z_BL.shape[0], device=z_BL.device, dtype=dtype)
        noisy_BL = (1 - t_B[:, None]) * z_BL + t_B[:, None] * noise_BL
        return {"loss": F.mse_loss(models["dit"](noisy_BL, t_B, batch["label"]).float(), noise_BL.float())}

    def after_optimizer_step(self, models: Mapping[str, nn.Module], phase: str, info: StepInfo) -> dict[str, float]:
        home = self.config.ema_home
        if home == "frozen":
            update_average_(models[self.ema_name], models["dit"], self.config.ema_decay)
        elif home == "attribute":
            assert self.attribute_ema is not None
            update_average_(self.attribute_ema, models["dit"], self.config.ema_decay)
        return {}

    def _ema(self, models: Mapping[str, nn.Module]) -> nn.Module:
        if self.config.ema_home == "attribute":
            assert self.attribute_ema is not None
            return self.attribute_ema
        return models[self.ema_name]

    def evaluate(self, models: Mapping[str, nn.Module], device: torch.device, epoch: int) -> dict[str, float]:
        g = torch.Generator().manual_seed(0)
        image, label = self.eval_set.tensors["image"], self.eval_set.tensors["label"]
        z_BL = models["vae"](image)
        noise_BL = torch.randn(z_BL.shape, generator=g)
        t_B = torch.rand(z_BL.shape[0], generator=g)
        noisy_BL = (1 - t_B[:, None]) * z_BL + t_B[:, None] * noise_BL
        return {"ema_loss": float(F.mse_loss(self._ema(models)(noisy_BL, t_B, label), noise_BL))}

    def on_fit_end(self, models: Mapping[str, nn.Module]) -> None:
        self.handed_to_fit_end = sorted(models)

    def debug_config(self) -> DitConfig:
        return dataclasses.replace(self.config, num_samples=64, batch_size=8, epochs=2)


def _config(tmp_path: Path, **changes: Any) -> DitConfig:
    return DitConfig(run_dir=tmp_path / "run", tensorboard=False, progress=False, **changes)


# --------------------------------------------------------------------------------------------- the debug check
def test_a_dit_with_an_ema_passes_debug_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    recipe = DitRecipe(_config(tmp_path))
    report = run_debug_check(DitRecipe, recipe, tmp_path / "debug")
    assert report.passed, report.line()
    assert report.averaged_identical and report.evaluation_identical and report.steps == 16

    # the EMA was really checkpointed and resumed: the resumed run's file holds the straight run's EMA to the bit
    straight = load_checkpoint(tmp_path / "debug" / "straight" / "ckpt" / "last.pt")
    resumed = load_checkpoint(tmp_path / "debug" / "resumed" / "ckpt" / "last.pt")
    found_a, found_b = averaged_weights(straight, "dit"), averaged_weights(resumed, "dit")
    assert found_a is not None and found_b is not None and found_a[0] == "dit_ema"
    for key, value in found_a[1].items():
        assert torch.equal(value, found_b[1][key]), key
    # ... and it is an average: neither the trained weights nor the initial ones
    trained = straight["models"]["dit"]
    assert any(not torch.equal(v, trained[k]) for k, v in found_a[1].items())


@pytest.mark.parametrize("home", ["frozen", "attribute"])
def test_an_ema_kept_outside_the_slot_fails_debug(home: EmaHome, tmp_path: Path) -> None:
    report = run_debug_check(DitRecipe, DitRecipe(_config(tmp_path, ema_home=home)), tmp_path / "debug")
    assert not report.passed, report.line()
    assert report.max_loss_difference == 0.0 and report.weights_identical  # the trained model resumes fine ...
    assert not report.evaluation_identical  # ... but the EMA restarts from its initial weights
    if home == "frozen":
        assert report.frozen_changed == ["dit_ema"] and "frozen models changed by training: dit_ema" in report.line()


def test_debug_applies_the_engine_settings_itself(tmp_path: Path) -> None:
    recipe = DitRecipe(_config(tmp_path, log_every=7, max_steps=3, debug=True))
    cfg = debug_run_config(recipe)
    assert {k: getattr(cfg, k) for k in DEBUG_OVERRIDES} == DEBUG_OVERRIDES
    assert (cfg.num_samples, cfg.batch_size, cfg.epochs) == (64, 8, 2)  # the recipe's own shrinking


def test_recipe_state_that_does_not_resume_fails_debug(tmp_path: Path) -> None:
    class Forgetful(DitRecipe):
        """Counts its optimizer steps in `state_dict` but forgets to restore them."""

        def __init__(self, config: DitConfig) -> None:
            super().__init__(config)
            self.steps = 0

        def after_optimizer_step(self, models: Mapping[str, nn.Module], phase: str, info: StepInfo) -> dict[str, float]:
            self.steps += 1
            return super().after_optimizer_step(models, phase, info)

        def state_dict(self) -> dict[str, Any]:
            return {"steps": self.steps}

    report = run_debug_check(Forgetful, Forgetful(_config(tmp_path)), tmp_path / "debug")
    assert not report.passed and not report.recipe_state_identical and report.max_loss_difference == 0.0


# ------------------------------------------------------------------------------------------------ the slot
def test_the_engine_makes_places_and_hands_on_the_averaged_copy(tmp_path: Path) -> None:
    recipe = DitRecipe(_config(tmp_path, precision="bf16", ema_decay=0.5))
    trainer = Trainer(recipe)
    ema, dit = trainer.averaged["dit_ema"], trainer.parts.models["dit"]
    assert not ema.training and not any(p.requires_grad for p in ema.parameters())
    assert next(dit.parameters()).dtype == torch.bfloat16  # the precision mode casts the trained model ...
    assert next(ema.parameters()).dtype == torch.float32  # ... never the average
    assert "dit_ema" not in trainer.runner.wrapped and "dit_ema" not in trainer.parts.models
    assert all(torch.equal(a.bfloat16(), b) for a, b in zip(ema.parameters(), dit.parameters()))  # the fp32 init
    trainer.fit()
    assert recipe.handed_to_fit_end == ["dit", "dit_ema", "vae"]
    assert not ema.training  # evaluation and training left it in eval mode
    state = load_checkpoint(tmp_path / "run" / "ckpt" / "last.pt")
    assert state["averaged"]["dit_ema"]["follows"] == "dit" and state["averaged"]["dit_ema"]["decay"] == 0.5


def test_the_average_takes_one_step_per_optimizer_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    average = averaged_copy(model)
    before = [p.detach().clone() for p in average.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.train()(torch.randn(4, 3))  # moves the BatchNorm statistics
    update_average_(average, model, decay=0.75)
    for old, new, current in zip(before, average.parameters(), model.parameters()):
        assert torch.allclose(new, 0.75 * old + 0.25 * current)
    assert torch.equal(average[1].running_mean, model[1].running_mean)  # buffers are copied


@pytest.mark.parametrize(
    ("averaged", "match"),
    [
        ({"dit_ema": WeightAverage(follows="nope", decay=0.9)}, "follows 'nope', which no phase trains"),
        ({"vae": WeightAverage(follows="dit", decay=0.9)}, "'vae' is in both TrainParts.frozen and .averaged"),
        ({"dit_ema": WeightAverage(follows="dit", decay=1.0)}, r"decay 1.0, not in \[0, 1\)"),
    ],
)
def test_a_wrong_slot_declaration_is_refused(
    averaged: dict[str, WeightAverage], match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = DitRecipe.build

    def build(self: DitRecipe, device: torch.device) -> TrainParts:
        parts = original(self, device)
        parts.averaged = averaged
        return parts

    monkeypatch.setattr(DitRecipe, "build", build)
    with pytest.raises(ValueError, match=match):
        Trainer(DitRecipe(_config(tmp_path)))


def test_a_recipe_class_attribute_the_engine_does_not_read_fails_at_import() -> None:
    with pytest.raises(TypeError, match="sets resume_must_match, which the engine does not read"):

        class Misspelt(DitRecipe):
            resume_must_match = ("arch",)
