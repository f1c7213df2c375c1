"""The checkpoint format has one home (`engine/checkpoint.py`): its marker and version, the readers of the weights
inside, and configs read back under today's setting names, so that a checkpoint written before a rename resumes and is
still checked field by field."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from trainlab.config import option
from trainlab.engine.checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    Progress,
    atomic_save,
    averaged_weights,
    is_trainlab_checkpoint,
    load_checkpoint,
    model_weights,
    recipe_state,
    stored_config,
    weights_in_checkpoint,
)
from trainlab.engine.loop import Trainer
from trainlab.errors import UsageError
from trainlab.recipes.toy import ToyConfig, ToyRecipe


def _toy(tmp_path: Path, **changes: Any) -> ToyConfig:
    return ToyConfig(run_dir=tmp_path, num_samples=64, batch_size=16, tensorboard=False, progress=False, **changes)


def test_what_the_trainer_writes_is_read_by_the_readers(tmp_path: Path) -> None:
    trainer = Trainer(ToyRecipe(_toy(tmp_path, epochs=1)))
    trainer.fit()
    state = load_checkpoint(tmp_path / "ckpt" / "last.pt")
    assert is_trainlab_checkpoint(state) and (state["format"], state["version"]) == (FORMAT, FORMAT_VERSION)
    assert Progress.from_state(state) == trainer.progress  # every Progress field, saved as it is
    weights = model_weights(state, "model")
    assert all(torch.equal(v, trainer.parts.models["model"].state_dict()[k]) for k, v in weights.items())
    assert averaged_weights(state, "model") is None and recipe_state(state) == {}
    with pytest.raises(UsageError, match=r"recipe 'toy' holding no model 'var' \(models: model\)"):
        model_weights(state, "var")
    assert not is_trainlab_checkpoint(weights)


def test_a_loader_reads_the_average_when_the_run_kept_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trained, average = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    state = {"format": FORMAT, "models": {"var": trained}}
    state["averaged"] = {"var_ema": {"follows": "var", "decay": 0.9, "weights": average}}
    with caplog.at_level(logging.INFO, logger="trainlab.engine.checkpoint"):
        assert weights_in_checkpoint("var")(state, Path("x.pt")) is not None
        assert torch.equal(weights_in_checkpoint("var")(state, Path("x.pt"))["w"], average["w"])
    assert "averaged weights 'var_ema' of its model 'var'" in caplog.text
    assert torch.equal(weights_in_checkpoint("var", averaged=False)(state, Path("x.pt"))["w"], trained["w"])
    official = {"w": torch.zeros(1)}
    assert weights_in_checkpoint("var")(official, Path("x.pt")) is official  # other formats pass unchanged


def test_a_checkpoint_of_a_newer_format_is_one_line(tmp_path: Path) -> None:
    atomic_save({"format": FORMAT, "version": FORMAT_VERSION + 1}, tmp_path / "last.pt")
    with pytest.raises(UsageError, match=f"format version {FORMAT_VERSION + 1}, this trainlab reads up to"):
        load_checkpoint(tmp_path / "last.pt")


@dataclass(kw_only=True)
class RenamedToyConfig(ToyConfig):
    """The toy config after `dropout` was renamed from `drop_rate` (kept as a deprecated spelling for one release)."""

    dropout: float = option(0.0, "dropout probability", ge=0, lt=1, deprecated=("--drop-rate",))


class RenamedToy(ToyRecipe):
    config_class = RenamedToyConfig


def _renamed(tmp_path: Path, **changes: Any) -> RenamedToyConfig:
    config = _toy(tmp_path, **changes)
    return RenamedToyConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def _written_before_the_rename(tmp_path: Path) -> Path:
    """A toy checkpoint whose config spells `dropout` as `drop_rate`, as the release before the rename wrote it."""
    Trainer(ToyRecipe(_toy(tmp_path, epochs=2, dropout=0.1))).fit(stop_at_step=2)
    path = tmp_path / "ckpt" / "last.pt"
    state = load_checkpoint(path)
    state["config"]["drop_rate"] = state["config"].pop("dropout")
    atomic_save(state, path)
    return path


def test_a_checkpoint_written_before_a_rename_resumes(tmp_path: Path) -> None:
    path = _written_before_the_rename(tmp_path)
    assert stored_config(load_checkpoint(path), RenamedToyConfig)["dropout"] == 0.1  # type: ignore[index]
    result = Trainer(RenamedToy(_renamed(tmp_path, epochs=2, dropout=0.1))).fit()
    assert (result.status, result.epoch, len(result.losses)) == ("finished", 2, 6)  # resumed at step 2 of 8


def test_and_is_still_checked_field_by_field(tmp_path: Path) -> None:
    _written_before_the_rename(tmp_path)
    with pytest.raises(UsageError, match=r"was trained with dropout=0\.1 but this run has dropout=0\.2"):
        Trainer(RenamedToy(_renamed(tmp_path, epochs=2, dropout=0.2)))
