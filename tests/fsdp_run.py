"""One debug run of a recipe (`python tests/fsdp_run.py RECIPE RUN_DIR JSON`), in one process or under torchrun:
the recipe's debug config with the JSON's config fields on top (nested groups as {"data": {...}}), trained by the
Trainer to its end or to {"stop_at_step": N}. The tests read the run directory (metrics, checkpoints)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from trainlab import dist
from trainlab.engine.debug import debug_run_config
from trainlab.engine.loop import Trainer
from trainlab.recipes import get_recipe


def _replace(config: Any, fields: dict[str, Any]) -> Any:
    values = {
        key: _replace(getattr(config, key), value) if isinstance(value, dict) else value
        for key, value in fields.items()
    }
    return dataclasses.replace(config, **values)


def main() -> None:
    recipe_name, run_dir, overrides = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    stop_at_step = overrides.pop("stop_at_step", None)
    cls = get_recipe(recipe_name)
    base = cls(cls.config_class(**overrides.pop("base", {})))
    config = _replace(
        debug_run_config(base), {"run_dir": run_dir, "tensorboard": False, "progress": False, **overrides}
    )
    Trainer(cls(config)).fit(stop_at_step=stop_at_step)
    dist.barrier()


if __name__ == "__main__":
    main()
