"""The affine micro-batch fit gives the traced bytes exactly where it holds, and refuses where it does not."""

from __future__ import annotations

import dataclasses

import pytest

from trainlab.engine.debug import debug_run_config
from trainlab.memory.batch_fit import fit_micro_batch
from trainlab.memory.breakdown import breakdown
from trainlab.memory.trace import trace_training
from trainlab.recipes.cifar import CifarRecipe
from trainlab.recipes.moco import MocoRecipe
from trainlab.recipes.var import VARRecipe


def _recipe(cls: type, **changes: object) -> object:
    config = dataclasses.replace(debug_run_config(cls(cls.config_class())), **changes)
    return cls(config)


@pytest.mark.parametrize("cls", [VARRecipe, CifarRecipe])
def test_the_fit_is_the_trace_at_another_micro_batch(cls: type) -> None:
    recipe = _recipe(cls, batch_size=64)

    def traced(m: int, k: int = 2):  # type: ignore[no-untyped-def]
        return trace_training(recipe, device="cuda", micro_batch=m, grad_accumulation=k)  # type: ignore[arg-type]

    fit = fit_micro_batch(traced(4), traced(8), traced(6))
    assert fit is not None
    direct, fitted = breakdown(traced(13)), breakdown(fit(13))
    assert fitted == direct


def test_a_quadratic_size_is_refused() -> None:
    """MoCo with micro-batch keys scores each micro-batch's queries against its own keys: (m, m) logits."""
    recipe = _recipe(MocoRecipe, batch_size=64, moco_keys="micro-batch")

    def traced(m: int):  # type: ignore[no-untyped-def]
        return trace_training(recipe, device="cpu", micro_batch=m, grad_accumulation=2)  # type: ignore[arg-type]

    assert fit_micro_batch(traced(4), traced(8), traced(6)) is None
