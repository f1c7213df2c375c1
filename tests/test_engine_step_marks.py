"""The training loop's `StepMark`s (`Trainer(on_mark=...)`, what `trainlab plan --measure` times): one where each
epoch's steps start and one after each step, in order, with the epoch's time inside the loader; the loop trains the
same with or without an observer."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from trainlab.engine.loop import StepMark, Trainer
from trainlab.recipes import get_recipe


def _trainer(run_dir: Path, marks: list[StepMark] | None) -> Trainer:
    recipe_cls = get_recipe("toy")
    config = recipe_cls.config_class(
        num_samples=64, batch_size=16, epochs=2, device="cpu", run_dir=run_dir, tensorboard=False, progress=False
    )
    return Trainer(recipe_cls(config), on_mark=None if marks is None else marks.append)


def test_the_loop_marks_each_epoch_start_and_each_step_end(tmp_path: Path) -> None:
    marks: list[StepMark] = []
    _trainer(tmp_path / "run", marks).fit()
    assert [(m.step, m.epoch_start) for m in marks] == [
        (0, True), (1, False), (2, False), (3, False), (4, False),
        (4, True), (5, False), (6, False), (7, False), (8, False),
    ]  # fmt: skip
    for epoch in (marks[:5], marks[5:]):
        assert epoch[0].data_wait_seconds == 0.0  # a new epoch's loader: nothing drawn yet
        waited = [m.data_wait_seconds for m in epoch]
        assert all(b > a for a, b in itertools.pairwise(waited))  # every step drew its batch through the loader


def test_an_observer_does_not_change_the_training(tmp_path: Path) -> None:
    observed = _trainer(tmp_path / "observed", [])
    plain = _trainer(tmp_path / "plain", None)
    assert observed.fit().losses == plain.fit().losses
    for a, b in zip(observed.parts.models["model"].parameters(), plain.parts.models["model"].parameters()):
        assert torch.equal(a, b)
