"""`--fsdp`: FSDP2 sharding of the trained models (`torch.distributed.fsdp.fully_shard`).

Each trained model is sharded block by block (the recipe names its blocks in `TrainParts.shard_units`), then the
rest of the model as its root unit. This module holds the engine's side of that contract.
"""

from __future__ import annotations

from torch import nn

from trainlab.engine.recipe import TrainParts


def check_shard_units(parts: TrainParts) -> None:
    """Refuse a `TrainParts.shard_units` the engine cannot shard: a key that is no trained model, a unit that is not
    a submodule of its model (or is the model itself), a unit named twice or inside another unit.

    Raises:
        ValueError: naming the model and the unit (a recipe bug, not a user error).
    """
    for name, units in parts.shard_units.items():
        model = parts.models.get(name)
        if model is None:
            raise ValueError(f"shard_units names {name!r}, which is not a trained model ({', '.join(parts.models)})")
        path = {id(module): sub for sub, module in model.named_modules() if sub}
        seen: dict[int, str] = {}
        for unit in units:
            if id(unit) not in path:
                raise ValueError(f"shard_units[{name!r}] holds a {type(unit).__name__} that is no submodule of it")
            if id(unit) in seen:
                raise ValueError(f"shard_units[{name!r}] names {path[id(unit)]} twice")
            seen[id(unit)] = path[id(unit)]
        for unit in units:
            inner = [path[id(m)] for m in unit.modules() if m is not unit and id(m) in seen]
            if inner:
                raise ValueError(f"shard_units[{name!r}]: {inner[0]} is inside {path[id(unit)]}; name disjoint blocks")


def unit_names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    """The dotted paths of `units` inside `model` (for the log and the planner)."""
    path = {id(module): sub for sub, module in model.named_modules()}
    return [path[id(unit)] for unit in units]
