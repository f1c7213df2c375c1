"""The affine micro-batch fit gives the traced bytes exactly where it holds, and refuses where it does not."""

from __future__ import annotations

import dataclasses

import pytest

from trainlab.engine.debug import debug_run_config
from trainlab.memory.batch_fit import _canonical, fit_micro_batch
from trainlab.memory.breakdown import breakdown
from trainlab.memory.trace import trace_training
from trainlab.recipes.cifar import CifarRecipe
from trainlab.recipes.moco import MocoRecipe
from trainlab.recipes.var import VARRecipe


def _recipe(cls: type, **changes: object) -> object:
    config = dataclasses.replace(debug_run_config(cls(cls.config_class())), **changes)
    return cls(config)


@pytest.mark.parametrize(
    ("cls", "precision", "accumulation"),
    [
        (VARRecipe, "fp16-amp-scale", 1),
        pytest.param(VARRecipe, "fp32", 2, marks=pytest.mark.slow),  # about 10 s; the fp16 case covers VAR
        (CifarRecipe, "fp32", 2),
    ],
)
def test_the_fit_is_the_trace_at_another_micro_batch(cls: type, precision: str, accumulation: int) -> None:
    recipe = _recipe(cls, batch_size=64, precision=precision)

    def traced(m: int):  # type: ignore[no-untyped-def]
        return trace_training(
            recipe,  # type: ignore[arg-type]
            device="cuda",
            micro_batch=m,
            grad_accumulation=accumulation,
        )

    fit = fit_micro_batch(traced(4), traced(8), traced(6))
    assert fit is not None
    direct, fitted = breakdown(traced(13)), breakdown(fit(13))
    assert fitted == direct


def test_frees_that_happen_together_may_come_in_any_order() -> None:
    events = [(1, 0), (1, 1), (1, 2), (-1, 2), (-1, 0), (1, 3), (-1, 1)]
    assert _canonical(events) == [(1, 0), (1, 1), (1, 2), (-1, 0), (-1, 2), (1, 3), (-1, 1)]


@pytest.mark.slow  # about 9 s: MoCo traced at three micro-batches
def test_a_quadratic_size_is_refused() -> None:
    """MoCo with micro-batch keys scores each micro-batch's queries against its own keys: (m, m) logits."""
    recipe = _recipe(MocoRecipe, batch_size=64, moco_keys="micro-batch")

    def traced(m: int):  # type: ignore[no-untyped-def]
        return trace_training(recipe, device="cpu", micro_batch=m, grad_accumulation=2)  # type: ignore[arg-type]

    assert fit_micro_batch(traced(4), traced(8), traced(6)) is None
