"""Recipes: a typed config plus build/train_step on the shared engine. Looked up by name, imported lazily: listing
the names imports no recipe (and no torch); `get_recipe` imports the one asked for."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from trainlab.errors import UsageError

if TYPE_CHECKING:
    from trainlab.engine.recipe import Recipe

_RECIPES = {
    "toy": "trainlab.recipes.toy:ToyRecipe",
    "cifar": "trainlab.recipes.cifar:CifarRecipe",
    "var": "trainlab.recipes.var:VARRecipe",
    "tokenizer": "trainlab.recipes.tokenizer:TokenizerRecipe",
    "moco": "trainlab.recipes.moco:MocoRecipe",
    "linear-probe": "trainlab.recipes.linear_probe:LinearProbeRecipe",
    "judge": "trainlab.recipes.judge:JudgeRecipe",
}


def list_recipes() -> list[str]:
    return sorted(_RECIPES)


def check_recipe(name: str) -> None:
    """Raise the one-line UsageError for a name no recipe has (without importing any recipe)."""
    if name not in _RECIPES:
        raise UsageError(f"unknown recipe {name!r}; choose one of: {', '.join(list_recipes())}")


def get_recipe(name: str) -> type[Recipe]:
    check_recipe(name)
    module_name, cls_name = _RECIPES[name].split(":")
    cls: type[Recipe] = getattr(importlib.import_module(module_name), cls_name)
    return cls
