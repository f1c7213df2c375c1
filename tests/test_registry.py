"""Every lazily imported name resolves (mypy cannot see string imports), and every recipe passes `--debug`."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from trainlab import cli
from trainlab.engine.recipe import Recipe, TrainConfig
from trainlab.recipes import get_recipe, list_recipes


@pytest.mark.parametrize("command", sorted(cli._COMMANDS))
def test_every_command_resolves_to_a_main(command: str) -> None:
    main = cli._load(cli._COMMANDS[command][0])
    assert callable(main)
    assert list(inspect.signature(main).parameters) == ["argv"]


@pytest.mark.parametrize("name", list_recipes())
def test_every_recipe_resolves(name: str) -> None:
    recipe_cls = get_recipe(name)
    assert issubclass(recipe_cls, Recipe)
    assert recipe_cls.name == name
    assert issubclass(recipe_cls.config_class, TrainConfig)
    assert recipe_cls.config_class is not TrainConfig, f"recipe {name} has no config class of its own"


@pytest.mark.parametrize("name", list_recipes())
def test_every_recipe_passes_its_debug_self_check(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["train", name, "--debug", "--run-dir", str(tmp_path), "--tensorboard", "false"]) == 0
    assert "debug PASS" in capsys.readouterr().out
