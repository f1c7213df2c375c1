"""The block-naming contract (`TrainParts.shard_units`): each recipe names blocks of its trained models, inner ones
first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from trainlab.engine.debug import debug_run_config
from trainlab.engine.fsdp import check_shard_units, unit_names
from trainlab.engine.recipe import Phase, TrainParts
from trainlab.recipes import get_recipe

EXPECTED = {  # recipe (config overrides) -> model name -> the first unit's path and the number of units
    ("var", ()): ("var", "blocks.0", 2),
    ("moco", ()): ("moco", "base_encoder.layer1", 10),
    ("moco", (("model", "moco_vit_debug"),)): ("moco", "base_encoder.blocks.0", 6),
    ("cifar", ()): ("model", "layer1", 4),
    ("tokenizer", ()): ("vqvae", "encoder.down.0", 6),
}


@pytest.mark.parametrize(("recipe", "overrides"), list(EXPECTED), ids=lambda v: str(v))
def test_recipes_name_their_blocks(recipe: str, overrides: tuple[tuple[str, str], ...], tmp_path: Path) -> None:
    cls = get_recipe(recipe)
    config = debug_run_config(cls(cls.config_class(run_dir=tmp_path, **dict(overrides))))
    parts = cls(config).build(torch.device("cpu"))
    check_shard_units(parts)
    name, first, count = EXPECTED[(recipe, overrides)]
    names = unit_names(parts.models[name], parts.shard_units[name])
    assert (names[0], len(names)) == (first, count), names


def test_toy_shards_the_root_only(tmp_path: Path) -> None:
    cls = get_recipe("toy")
    parts = cls(cls.config_class(run_dir=tmp_path)).build(torch.device("cpu"))
    assert parts.shard_units == {}


def _parts(units: list[nn.Module], model: nn.Module) -> TrainParts:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainParts(models={"m": model}, phases=[Phase("main", optimizer, ["m"])], shard_units={"m": units})


def test_bad_units_are_refused() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 1))
    check_shard_units(_parts([model[0], model[1]], model))
    with pytest.raises(ValueError, match="no submodule"):
        check_shard_units(_parts([nn.Linear(2, 2)], model))
    with pytest.raises(ValueError, match="twice"):
        check_shard_units(_parts([model[1], model[1]], model))
    check_shard_units(_parts([model[0][1], model[0]], model))  # inside out
    with pytest.raises(ValueError, match="inside"):
        check_shard_units(_parts([model[0], model[0][1]], model))
    with pytest.raises(ValueError, match="not a trained model"):
        check_shard_units(TrainParts(models={"m": model}, phases=[], shard_units={"x": []}))
