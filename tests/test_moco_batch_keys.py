"""Full-batch keys (`--moco-keys full-batch`): accumulation k x B/k is the loss and the gradients of one batch B.

What is compared, and why it is well defined: the engine's first optimizer step of the MoCo recipe (resnet_debug on
the bundled digits, global batch 16) with every BatchNorm held in eval mode, so each sample's features depend on that
sample only and not on how the batch is split (in train mode each micro-batch is normalised by its own statistics:
a different computation, which the official code avoids with SyncBatchNorm over one large batch). Accumulation 4 x 4
with full-batch keys must give the loss and the gradients of 1 x 16 (1e-6 relative); with micro-batch keys each query
sees 3 negatives instead of 15, and the loss must differ (the control: the test fails if the keys of the other
micro-batches or the labels' offsets are lost). The momentum update runs once per optimizer step, before the keys,
and a run resumed between optimizer steps is bit-exact.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainlab.engine.debug import run_debug_check
from trainlab.engine.loop import Trainer
from trainlab.models.moco import MoCo
from trainlab.recipes.moco import MocoConfig, MocoRecipe, log_keys

BATCH = 16


def _config(run_dir: Path, **kw: Any) -> MocoConfig:
    cfg = MocoRecipe(MocoConfig()).debug_config()
    return dataclasses.replace(cfg, run_dir=run_dir, tensorboard=False, progress=False, batch_size=BATCH, **kw)


def _hold_eval_mode(model: nn.Module) -> None:
    """BatchNorm on its running statistics for the whole run: the engine's `model.train()` is made a no-op."""
    model.eval()
    model.train = lambda mode=True: model  # type: ignore[method-assign,assignment,misc]


def _first_step(run_dir: Path, accumulation: int, keys: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and the gradients of the first optimizer step."""
    trainer = Trainer(MocoRecipe(_config(run_dir, grad_accumulation=accumulation, moco_keys=keys)))
    model = trainer.parts.models["moco"]
    _hold_eval_mode(model)
    optimizer = trainer.phases[0].optimizer
    grads: dict[str, torch.Tensor] = {}
    original_step = optimizer.step

    def spy_step(*args: Any, **kwargs: Any) -> Any:
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return original_step(*args, **kwargs)

    optimizer.step = spy_step  # type: ignore[method-assign]
    result = trainer.fit(stop_at_step=1)
    return result.losses[0], grads


def test_full_batch_keys_under_accumulation_equal_the_large_batch(tmp_path: Path) -> None:
    loss_big, grads_big = _first_step(tmp_path / "big", 1, "full-batch")
    loss_full, grads_full = _first_step(tmp_path / "full", 4, "full-batch")
    loss_micro, _ = _first_step(tmp_path / "micro", 4, "micro-batch")
    assert abs(loss_full - loss_big) <= 1e-6 * abs(loss_big), (loss_full, loss_big)
    assert abs(loss_micro - loss_big) > 1e-2, (loss_micro, loss_big)  # 3 negatives per query instead of 15
    assert grads_big.keys() == grads_full.keys() and len(grads_big) > 10
    nonzero = 0
    for name, grad in grads_big.items():
        if grad.norm() == 0:  # a residual branch behind a zero-initialised BatchNorm weight: no gradient at step 1
            assert grads_full[name].norm() == 0, name
            continue
        nonzero += 1
        rel = (grads_full[name] - grad).norm() / grad.norm()
        assert rel <= 1e-6, (name, float(rel))
    assert nonzero > len(grads_big) // 2, nonzero  # the comparison is not between zeros


def test_momentum_update_once_per_optimizer_step_before_the_keys(tmp_path: Path) -> None:
    """Accumulation 4 over 3 optimizer steps: 4 updates (iteration 0's, then one after each step), none between the
    micro-steps of a step, and each step's keys computed after its update."""
    trainer = Trainer(MocoRecipe(_config(tmp_path, grad_accumulation=4)))
    model = trainer.parts.models["moco"]
    assert isinstance(model, MoCo)
    events: list[str] = []
    update, forward = model.update_momentum_encoder, model.momentum_encoder.forward
    model.update_momentum_encoder = lambda m: (events.append("update"), update(m))[1]  # type: ignore[method-assign]
    model.momentum_encoder.forward = lambda x: (events.append("key"), forward(x))[1]  # type: ignore[method-assign]
    trainer.fit(stop_at_step=3)
    one_step = ["key"] * 8  # 4 micro-batches x 2 views, each once
    assert events == ["update", *one_step, "update", *one_step, "update", *one_step, "update"]


def test_resume_between_optimizer_steps_is_bit_exact(tmp_path: Path) -> None:
    """--debug's check (train, stop between optimizer steps, resume, compare) with the two-pass step."""
    recipe = MocoRecipe(_config(tmp_path / "run", grad_accumulation=4))
    report = run_debug_check(MocoRecipe, recipe, tmp_path / "run" / "debug")
    assert report.passed and report.max_loss_difference == 0.0 and report.weights_identical


def test_the_log_says_what_a_query_sees_and_what_batchnorm_normalises_by(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainlab.recipes.moco")
    log_keys(_config(Path("unused"), grad_accumulation=4), world=1, sync_batchnorm=False)
    assert "--moco-keys full-batch: each query against 16 keys" in caplog.text
    assert "BatchNorm statistics of 4 images (the logits are the large batch's up to BatchNorm)" in caplog.text
    caplog.clear()
    log_keys(_config(Path("unused"), moco_keys="micro-batch"), world=2, sync_batchnorm=True)
    assert "--moco-keys micro-batch: each query against 8 keys" in caplog.text
    assert "BatchNorm statistics of 16 images" in caplog.text and "up to BatchNorm" not in caplog.text


def test_a_checkpoint_from_before_the_keys_setting_resumes_only_as_it_trained(tmp_path: Path) -> None:
    """A split batch trained before `moco_keys` existed scored micro-batch keys: resuming it with full-batch keys would
    change the loss mid-run, so it is refused naming the flag; unsplit runs (nothing differed) resume as before."""
    from trainlab.config import to_dict
    from trainlab.engine.resume import check_config
    from trainlab.errors import UsageError

    for accumulation, refused in ((2, True), (1, False)):
        config = MocoConfig(grad_accumulation=accumulation, batch_size=8)
        stored = {k: v for k, v in to_dict(config).items() if k != "moco_keys"}
        if refused:
            with pytest.raises(UsageError, match=r"moco_keys='micro-batch'.*--moco-keys"):
                check_config(stored, config, tmp_path / "last.pt", ())
            same = MocoConfig(grad_accumulation=accumulation, batch_size=8, moco_keys="micro-batch")
            assert check_config(stored, same, tmp_path / "last.pt", ()) == []
        else:
            assert check_config(stored, config, tmp_path / "last.pt", ()) == []
