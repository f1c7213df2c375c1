"""`--debug`: a tiny run straight through vs. the same run stopped half-way, saved, reloaded and finished.

Passes when the per-step losses after the reload and the final weights are bit-identical to the straight run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
from pathlib import Path

import torch

from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import Recipe
from trainlab.engine.run_lock import RunDirLock

log = logging.getLogger(__name__)


@dataclasses.dataclass
class DebugReport:
    passed: bool
    steps: int
    resumed_at: int
    max_loss_difference: float
    weights_identical: bool

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"debug {verdict}: {self.steps} steps, resumed at step {self.resumed_at}; "
            f"max |loss difference| after resume = {self.max_loss_difference:.3g}; "
            f"final weights identical: {self.weights_identical}"
        )


def run_debug_check(recipe_cls: type[Recipe], recipe: Recipe, work_dir: Path) -> DebugReport:
    """Run the check in `work_dir` (replaced), holding the lock of its parent, the run directory (a second --debug
    or a training run there is refused instead of having its files deleted)."""
    with RunDirLock(work_dir.parent):
        return _run_debug_check(recipe_cls, recipe, work_dir)


def _run_debug_check(recipe_cls: type[Recipe], recipe: Recipe, work_dir: Path) -> DebugReport:
    tiny = recipe.debug_config()
    if work_dir.exists():
        shutil.rmtree(work_dir)
    fresh = {"resume": "never", "overwrite": False, "debug": False}
    straight_cfg = dataclasses.replace(tiny, run_dir=work_dir / "straight", **fresh)
    straight = Trainer(recipe_cls(straight_cfg))
    result_a = straight.fit()
    total = len(result_a.losses)
    resume_at = max(1, total // 2)

    split_cfg = dataclasses.replace(tiny, run_dir=work_dir / "resumed", **fresh)
    first = Trainer(recipe_cls(split_cfg))
    result_b1 = first.fit(stop_at_step=resume_at)
    second = Trainer(recipe_cls(dataclasses.replace(split_cfg, resume="auto")))
    result_b2 = second.fit()

    losses_b = result_b1.losses + result_b2.losses
    diffs = [abs(a - b) if not (math.isnan(a) and math.isnan(b)) else 0.0 for a, b in zip(result_a.losses, losses_b)]
    max_diff = max(diffs) if diffs else 0.0
    same_count = len(losses_b) == total
    weights_same = all(
        torch.equal(pa, pb)
        for name in straight.parts.models
        for pa, pb in zip(
            straight.parts.models[name].state_dict().values(), second.parts.models[name].state_dict().values()
        )
    )
    passed = same_count and max_diff == 0.0 and weights_same
    return DebugReport(passed, total, resume_at, max_diff, weights_same)
