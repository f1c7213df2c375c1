"""The portable golden check still catches real changes.

Each probe changes the computation slightly and the fp64 reference comparison (`tests/golden.py`, relative
tolerance `REFERENCE_RTOL`) must report it, by a margin: the first reported difference is at least 100x the
tolerance. A probe that went unnoticed would mean the tolerance hides real changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from golden import REFERENCE, REFERENCE_RTOL, differences, load_json, run_case

from trainlab.engine.loop import Trainer


def _one_more_warmup_step(trainer: Trainer) -> None:
    for scheduler in trainer.schedulers.values():
        steps = round(scheduler.config.warmup_fraction * scheduler.total_steps)
        scheduler.config = dataclasses.replace(scheduler.config, warmup_fraction=(steps + 1) / scheduler.total_steps)


def _another_dropout_draw(trainer: Trainer) -> None:
    torch.rand(1)  # advances the global generator that dropout draws from: every mask after it changes


# name -> (golden case, config changes, perturbation of the built trainer)
PROBES: dict[str, tuple[str, dict[str, Any], Callable[[Trainer], None] | None]] = {
    "learning rate x (1 + 1e-4)": ("toy", {"optim.learning_rate": 0.1 * (1 + 1e-4)}, None),
    "one more warm-up step": ("var", {}, _one_more_warmup_step),
    "a different dropout draw": ("toy", {}, _another_dropout_draw),
    "the codebook's dead-code restart one step later": ("tokenizer", {"dead_code_steps": 3}, None),
}


def _largest_relative_difference(got: dict[str, Any], want: dict[str, Any]) -> float:
    worst = 0.0
    for key, values in want["losses"].items():
        for a, b in zip(got["losses"][key], values):
            x, y = float.fromhex(a), float.fromhex(b)
            worst = max(worst, abs(x - y) / max(abs(x), abs(y), 1e-300))
    return worst


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_the_portable_golden_check_reports_a_small_real_change(probe: str, tmp_path: Path) -> None:
    case, changes, perturb = PROBES[probe]
    reference = load_json(REFERENCE)["cases"][case]
    got = run_case(case, tmp_path / case, precision="fp64", perturb=perturb, **changes)
    problems = differences(got, reference, REFERENCE_RTOL)
    assert problems, f"{probe}: the golden check did not notice"
    assert _largest_relative_difference(got, reference) >= 100 * REFERENCE_RTOL, f"{probe}: noticed without margin"


def test_the_unchanged_run_is_not_reported(tmp_path: Path) -> None:
    """The control: the same case without a probe passes (the probes above fail because of the probe)."""
    got = run_case("toy", tmp_path / "toy", precision="fp64")
    assert differences(got, load_json(REFERENCE)["cases"]["toy"], REFERENCE_RTOL) == []
