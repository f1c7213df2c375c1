"""Checkpoints: resume mid-epoch to the bit, atomic writes, crash safety, config mismatch, debug mode."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainlab.engine.checkpoint import atomic_save, load_checkpoint
from trainlab.engine.debug import run_debug_check
from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import StepInfo
from trainlab.errors import UsageError
from trainlab.recipes.toy import ToyConfig, ToyRecipe


def _config(run_dir: Path, **overrides: Any) -> ToyConfig:
    base = ToyConfig(
        run_dir=run_dir,
        num_samples=96,
        batch_size=16,
        epochs=2,
        dropout=0.2,
        log_every=1,
        grad_accumulation=2,
        tensorboard=False,
        progress=False,
        seed=11,
    )
    return dataclasses.replace(base, **overrides)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.parts.models["model"].state_dict().items()}


def test_resume_mid_epoch_is_bit_exact(tmp_path: Path) -> None:
    straight = Trainer(ToyRecipe(_config(tmp_path / "a")))
    result_a = straight.fit()
    assert result_a.step == 12  # 6 steps per epoch x 2

    first = Trainer(ToyRecipe(_config(tmp_path / "b")))
    result_b1 = first.fit(stop_at_step=4)  # mid-epoch 0
    state = load_checkpoint(tmp_path / "b" / "ckpt" / "last.pt")
    assert (state["step"], state["epoch"], state["step_in_epoch"]) == (4, 0, 4)
    second = Trainer(ToyRecipe(_config(tmp_path / "b", resume="auto")))
    result_b2 = second.fit()

    assert result_b1.losses + result_b2.losses == result_a.losses  # exact float equality, every step
    for name, tensor in _weights(straight).items():
        assert torch.equal(tensor, _weights(second)[name]), name


def test_resuming_a_run_that_reached_max_steps_trains_nothing(tmp_path: Path) -> None:
    """`--max-steps` is where the run ends: running it again (resume auto) must not take one more step."""
    first = Trainer(ToyRecipe(_config(tmp_path, max_steps=4)))
    assert first.fit().step == 4
    before = (tmp_path / "ckpt" / "last.pt").read_bytes()
    again = Trainer(ToyRecipe(_config(tmp_path, max_steps=4, resume="auto")))
    result = again.fit()
    assert (result.status, result.step, result.losses) == ("max_steps", 4, [])
    assert (tmp_path / "ckpt" / "last.pt").read_bytes() == before
    for name, tensor in _weights(first).items():
        assert torch.equal(tensor, _weights(again)[name]), name


def test_best_is_a_copy_of_last(tmp_path: Path) -> None:
    Trainer(ToyRecipe(_config(tmp_path, epochs=1))).fit()
    last, best = tmp_path / "ckpt" / "last.pt", tmp_path / "ckpt" / "best.pt"
    assert best.read_bytes() == last.read_bytes()
    assert not list((tmp_path / "ckpt").glob("*.tmp"))


def test_crash_never_overwrites_last_good_checkpoint(tmp_path: Path) -> None:
    class Crashing(ToyRecipe):
        def train_step(self, models: Mapping[str, nn.Module], batch: Any, phase: str, info: StepInfo) -> dict[str, Any]:
            if info.step == 5:
                raise RuntimeError("simulated crash")
            return super().train_step(models, batch, phase, info)

    trainer = Trainer(Crashing(_config(tmp_path, checkpoint_every=2)))
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.fit()
    state = load_checkpoint(tmp_path / "ckpt" / "last.pt")
    assert state["step"] == 4


def test_atomic_save_failure_keeps_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    atomic_save({"format": "trainlab-checkpoint", "x": torch.ones(2)}, path)

    class Unpicklable:
        def __reduce__(self) -> Any:
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        atomic_save({"bad": Unpicklable()}, path)
    assert torch.equal(load_checkpoint(path)["x"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_resume_with_other_config_names_the_mismatch(tmp_path: Path) -> None:
    Trainer(ToyRecipe(_config(tmp_path, epochs=1))).fit()
    with pytest.raises(UsageError, match=r"hidden=32 but this run has hidden=64"):
        Trainer(ToyRecipe(_config(tmp_path, epochs=1, hidden=64, resume="auto"))).fit()
    with pytest.raises(UsageError, match="precision"):
        Trainer(ToyRecipe(_config(tmp_path, epochs=1, precision="bf16-amp", resume="auto"))).fit()


def test_foreign_or_corrupt_checkpoint_is_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="could not be read"):
        load_checkpoint(bad)
    torch.save({"weight": torch.ones(1)}, bad)
    with pytest.raises(UsageError, match="not a trainlab training checkpoint"):
        load_checkpoint(bad)
    with pytest.raises(UsageError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")


def test_debug_mode_passes(tmp_path: Path) -> None:
    recipe = ToyRecipe(_config(tmp_path))
    report = run_debug_check(ToyRecipe, recipe, tmp_path / "debug")
    assert report.passed, report.line()
    assert report.line().startswith("debug PASS")
    # both runs of the check use deterministic kernels (cuDNN autotuning and atomics do not repeat to the bit on CUDA)
    for run in ("straight", "resumed"):
        assert "deterministic: true" in (tmp_path / "debug" / run / "config.yaml").read_text().splitlines()


def test_every_save_resumes_cleanly_even_at_an_epoch_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --checkpoint-every 1: a save after every step; the one after an epoch's last step is the end-of-epoch save (with
    # the epoch counted), never one that records "epoch 0, its last step" (the resume refuses that as damaged, so a
    # kill between the two saves lost the run: found by the chaos test)
    seen: list[tuple[int, int, int]] = []
    save = Trainer.save

    def recording(self: Trainer, *, is_best: bool = False) -> None:
        seen.append((self.progress.step, self.progress.epoch, self.progress.step_in_epoch))
        save(self, is_best=is_best)

    monkeypatch.setattr(Trainer, "save", recording)
    trainer = Trainer(ToyRecipe(_config(tmp_path, checkpoint_every=1, grad_accumulation=1)))
    trainer.fit()
    steps_per_epoch = trainer.steps_per_epoch
    assert {step for step, _, _ in seen} == set(range(1, 2 * steps_per_epoch + 1))  # every step saved
    for step, epoch, in_epoch in seen:
        assert in_epoch < steps_per_epoch and step == epoch * steps_per_epoch + in_epoch


def test_seed_fixes_everything(tmp_path: Path) -> None:
    a = Trainer(ToyRecipe(_config(tmp_path / "a", epochs=1))).fit().losses
    b = Trainer(ToyRecipe(_config(tmp_path / "b", epochs=1))).fit().losses
    c = Trainer(ToyRecipe(_config(tmp_path / "c", epochs=1, seed=12))).fit().losses
    assert a == b
    assert a != c


@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")
def test_a_checkpoint_holding_a_tensor_without_values_is_named(tmp_path: Path) -> None:
    """A meta or sparse tensor in a (non-sharded) checkpoint is refused where it is read, naming its place, instead of
    surfacing as a model that "does not fit" the checkpoint."""
    Trainer(ToyRecipe(_config(tmp_path, epochs=1))).fit()
    path = tmp_path / "ckpt" / "last.pt"
    state = load_checkpoint(path)
    damages = ((lambda t: t.to("meta"), "holds no values"), (lambda t: t.to_sparse(), "is a torch.sparse_coo"))
    for damage, words in damages:
        hollow = {**state, "models": {"model": {**state["models"]["model"]}}}
        hollow["models"]["model"]["0.weight"] = damage(state["models"]["model"]["0.weight"])
        torch.save(hollow, tmp_path / "hollow.pt")
        with pytest.raises(UsageError, match=rf"models\.model\.0\.weight {words}"):
            load_checkpoint(tmp_path / "hollow.pt")
