"""Gradient accumulation is exactly the large batch: 4 x 8 gives the gradients and the update of 32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainlab.engine.loop import Trainer
from trainlab.recipes.toy import ToyConfig, ToyRecipe


def _first_step(tmp_path: Path, accumulation: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    cfg = ToyConfig(
        run_dir=tmp_path / f"acc{accumulation}",
        num_samples=64,
        batch_size=32,
        grad_accumulation=accumulation,
        epochs=1,
        seed=3,
        tensorboard=False,
        progress=False,
    )
    trainer = Trainer(ToyRecipe(cfg))
    model = trainer.parts.models["model"]
    optimizer = trainer.phases[0].optimizer
    grads: dict[str, torch.Tensor] = {}
    original_step = optimizer.step

    def spy_step(*args: Any, **kwargs: Any) -> Any:
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        return original_step(*args, **kwargs)

    optimizer.step = spy_step  # type: ignore[method-assign]
    trainer.fit(stop_at_step=1)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return grads, params


def test_accumulation_equals_large_batch(tmp_path: Path) -> None:
    grads_big, params_big = _first_step(tmp_path, 1)
    grads_acc, params_acc = _first_step(tmp_path, 4)
    for name in grads_big:
        rel = (grads_acc[name] - grads_big[name]).norm() / grads_big[name].norm()
        assert rel <= 1e-6, (name, float(rel))
        torch.testing.assert_close(params_acc[name], params_big[name], rtol=1e-6, atol=1e-7)


def test_micro_batches_partition_the_global_batch() -> None:
    from trainlab.engine.sampler import StepBatchSampler

    big = StepBatchSampler(64, batch_size=32, accumulation=1, rank=0, world=1, seed=5)
    big_batches = list(big)
    for world, accumulation in [(1, 4), (2, 1), (2, 2)]:
        per_rank = [
            list(StepBatchSampler(64, batch_size=32, accumulation=accumulation, rank=r, world=world, seed=5))
            for r in range(world)
        ]
        for step in range(2):
            seen = sorted(
                i for r in range(world) for a in range(accumulation) for i in per_rank[r][step * accumulation + a]
            )
            assert seen == sorted(big_batches[step])


def test_bad_split_is_usage_error() -> None:
    import pytest

    from trainlab.engine.sampler import micro_batch_size
    from trainlab.errors import UsageError

    with pytest.raises(UsageError, match="multiple of 6"):
        micro_batch_size(32, 3, 2)
    with pytest.raises(UsageError, match="positive"):
        micro_batch_size(0, 1, 1)
