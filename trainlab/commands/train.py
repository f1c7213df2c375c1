"""`trainlab train RECIPE [--config file.yaml] [flags]`: flags are generated from the recipe's typed config."""

from __future__ import annotations

import logging
import sys

from trainlab import dist
from trainlab.config import parse
from trainlab.errors import UsageError
from trainlab.recipes import get_recipe, list_recipes

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: trainlab train RECIPE [--config file.yaml] [--field value ...]")
        print(f"recipes: {', '.join(list_recipes())}")
        print("`trainlab train RECIPE --help` lists every field of that recipe's config.")
        return 0 if argv else 2
    recipe_cls = get_recipe(argv[0])
    config = parse(recipe_cls.config_class, argv[1:], prog=f"trainlab train {argv[0]}")
    recipe = recipe_cls(config)
    if config.debug:
        from trainlab.engine.debug import run_debug_check

        report = run_debug_check(recipe_cls, recipe, config.run_dir / "debug")
        print(report.line())
        return 0 if report.passed else 1

    from trainlab.engine.loop import Trainer

    is_main = True
    try:
        trainer = Trainer(recipe)
        result = trainer.fit()
        is_main = dist.is_main()  # read before cleanup(): afterwards every rank looks like rank 0
    except UsageError:
        raise
    except Exception:
        log.error("training failed; the last good checkpoint (if any) in %s/ckpt is untouched", config.run_dir)
        raise
    finally:
        dist.cleanup()
    if is_main:
        summary = ", ".join(f"{k}={v:.4g}" for k, v in result.last_eval.items())
        where = config.run_dir
        if result.status == "interrupted":
            print(
                f"interrupted at step {result.step}; saved {where}/ckpt/last.pt; run the same command again to resume",
                file=sys.stderr,
            )
        else:
            print(
                f"done: {result.step} steps, {result.epoch} epochs{'; ' + summary if summary else ''}; run dir {where}"
            )
    return 0
