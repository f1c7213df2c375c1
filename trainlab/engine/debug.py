"""`--debug`: a tiny run straight through vs. the same run stopped half-way, saved, reloaded and finished.

The tiny run is the recipe's `debug_config()` (a small model and little data) with the engine's debug settings on
top (`DEBUG_OVERRIDES`: every step logged, no --max-steps, no nested --debug): `debug_run_config`, also what the
golden runs train. Passes when, after the reload,

- the per-step losses are bit-identical to the straight run's,
- the final trained weights and the averaged copies (`TrainParts.averaged`) are bit-identical,
- the recipe's own state (`Recipe.state_dict()`: counters, EMA codebook statistics, generators) is identical,
- the last evaluation's metrics are identical (weights an evaluation uses that live outside the engine's slots,
  e.g. an EMA kept in a recipe attribute, are rebuilt by a resume and show up here),

and when no frozen model's weights or buffers changed during the straight run (a frozen model that trains is a bug
either way: it is not checkpointed, so a resume would silently start from other weights).

The check's runs use deterministic kernels (`--deterministic true`, logged): on CUDA, cuDNN's autotuned algorithms
and kernels that accumulate with atomics do not repeat to the bit, so without them two straight runs differ and the
check could not tell a resume bug from kernel noise (measured on an H100: the fp32 debug runs of cifar, judge, moco
and tokenizer differ after the reload without it and are identical with it; benchmarks/README.md, "On a GPU").
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import Recipe, TrainConfig
from trainlab.engine.run_lock import RunDirLock

log = logging.getLogger(__name__)

DEBUG_OVERRIDES: dict[str, Any] = {"debug": False, "log_every": 1, "max_steps": -1}
"""Engine settings of every debug run (a recipe's `debug_config` only shrinks its model and data)."""


def debug_run_config(recipe: Recipe[Any]) -> TrainConfig:
    """The config `--debug` (and the golden runs) train: the recipe's `debug_config()` with `DEBUG_OVERRIDES`."""
    return dataclasses.replace(recipe.debug_config(), **DEBUG_OVERRIDES)


@dataclasses.dataclass
class DebugReport:
    passed: bool
    steps: int
    resumed_at: int
    max_loss_difference: float
    weights_identical: bool
    averaged_identical: bool = True
    recipe_state_identical: bool = True
    evaluation_identical: bool = True
    frozen_changed: list[str] = dataclasses.field(default_factory=list)  # frozen models whose weights moved

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        text = (
            f"debug {verdict}: {self.steps} steps, resumed at step {self.resumed_at}; "
            f"max |loss difference| after resume = {self.max_loss_difference:.3g}; "
            f"final weights identical: {self.weights_identical}; averaged weights identical: "
            f"{self.averaged_identical}; recipe state identical: {self.recipe_state_identical}; last evaluation "
            f"identical: {self.evaluation_identical}"
        )
        if self.frozen_changed:
            text += f"; frozen models changed by training: {', '.join(self.frozen_changed)}"
        return text


def run_debug_check(recipe_cls: type[Recipe[Any]], recipe: Recipe[Any], work_dir: Path) -> DebugReport:
    """Run the check in `work_dir` (replaced), holding the lock of its parent, the run directory (a second --debug
    or a training run there is refused instead of having its files deleted)."""
    with RunDirLock(work_dir.parent):
        return _run_debug_check(recipe_cls, recipe, work_dir)


def _run_debug_check(recipe_cls: type[Recipe[Any]], recipe: Recipe[Any], work_dir: Path) -> DebugReport:
    tiny = debug_run_config(recipe)
    if not tiny.deterministic:
        log.info("debug: --deterministic true for the check (autotuned, atomic CUDA kernels do not repeat to the bit)")
        tiny = dataclasses.replace(tiny, deterministic=True)
    if work_dir.exists():
        shutil.rmtree(work_dir)
    fresh: dict[str, Any] = {"resume": "never", "overwrite": False}
    straight = Trainer(recipe_cls(dataclasses.replace(tiny, run_dir=work_dir / "straight", **fresh)))
    frozen_before = _digests(straight.parts.frozen)
    result_a = straight.fit()
    frozen_changed = sorted(n for n, d in _digests(straight.parts.frozen).items() if d != frozen_before[n])
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
    weights_same = _same_weights(straight.parts.models, second.parts.models)
    averaged_same = _same_weights(straight.averaged, second.averaged)
    state_same = same_state(straight.recipe.state_dict(), second.recipe.state_dict())
    eval_same = same_state(result_a.last_eval, result_b2.last_eval)
    passed = same_count and max_diff == 0.0 and weights_same and averaged_same and state_same and eval_same
    passed = passed and not frozen_changed
    return DebugReport(
        passed, total, resume_at, max_diff, weights_same, averaged_same, state_same, eval_same, frozen_changed
    )


def _same_weights(a: Mapping[str, nn.Module], b: Mapping[str, nn.Module]) -> bool:
    return a.keys() == b.keys() and all(same_state(a[n].state_dict(), b[n].state_dict()) for n in a)


def same_state(a: Any, b: Any) -> bool:
    """Whether two (nested) states are identical: tensors bit for bit (dtype and shape included), containers entry by
    entry, floats equal or both NaN, anything else by `==` (of the same type)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _bytes(a) == _bytes(b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(type(a) is type(b) and a == b)


def _bytes(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return str(t.dtype), tuple(t.shape), flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _digests(models: Mapping[str, nn.Module]) -> dict[str, str]:
    """One SHA-256 per model over its weights and buffers (names, dtypes, shapes, bytes)."""
    out = {}
    for name, model in models.items():
        h = hashlib.sha256()
        for key, tensor in model.state_dict().items():
            dtype, shape, data = _bytes(tensor)
            h.update(f"{key}:{dtype}:{shape}".encode())
            h.update(data)
        out[name] = h.hexdigest()
    return out
