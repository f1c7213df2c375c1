"""The micro-batch fits (affine, then of degree 2) give the traced bytes exactly where they hold, and refuse where they
do not."""

from __future__ import annotations

import dataclasses

import pytest

from trainlab.engine.debug import debug_run_config
from trainlab.memory.batch_fit import _canonical, fit_micro_batch, fit_quadratic
from trainlab.memory.breakdown import breakdown
from trainlab.memory.trace import TracedRun, trace_training
from trainlab.memory.tracer import StorageRecord, Trace
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


@pytest.mark.slow  # about 15 s: MoCo traced at five micro-batches
def test_a_quadratic_size_is_refused_by_the_affine_fit_and_fitted_by_degree_2() -> None:
    """MoCo with micro-batch keys scores each micro-batch's queries against its own keys: (m, m) logits."""
    recipe = _recipe(MocoRecipe, batch_size=64, moco_keys="micro-batch")

    def traced(m: int):  # type: ignore[no-untyped-def]
        return trace_training(recipe, device="cpu", micro_batch=m, grad_accumulation=2)  # type: ignore[arg-type]

    points = [traced(4), traced(6), traced(8)]
    assert fit_micro_batch(points[0], points[2], points[1]) is None
    fit = fit_quadratic(points, traced(12))
    assert fit is not None
    assert breakdown(fit(13)) == breakdown(traced(13))


def _sized(micro_batch: int, nbytes: list[int]) -> TracedRun:
    """A hand-made run: each storage allocated, then all freed."""
    records = [StorageRecord(i, n, "forward", 0) for i, n in enumerate(nbytes)]
    events = [(1, i) for i in range(len(nbytes))] + [(-1, i) for i in range(len(nbytes))]
    return TracedRun(Trace(records, events, [0], len(events)), "cuda", micro_batch, 2, 0, 0, 0, 0, False, ["sgd"])


def _laws(m: int) -> list[int]:
    return [64, 4 * m, 4 * m * m + 8 * m + 16]  # a state, an activation, B x B logits and a bias


def test_a_fit_of_degree_2_gives_every_micro_batch() -> None:
    fit = fit_quadratic([_sized(m, _laws(m)) for m in (4, 6, 8)], _sized(12, _laws(12)))
    assert fit is not None
    for m in (2, 5, 100, 4096):
        assert [r.nbytes for r in fit(m).trace.records] == _laws(m)


def test_a_fit_of_degree_2_is_refused_where_it_does_not_hold() -> None:
    points = [_sized(m, _laws(m)) for m in (4, 6, 8)]
    cubic = _sized(12, [*_laws(12)[:2], 4 * 12**3])
    assert fit_quadratic(points, cubic) is None  # the check disagrees
    halves = [_sized(m, [64, 4 * m, 2 * m * m + m]) for m in (4, 6, 8)]
    assert fit_quadratic(halves, _sized(12, [64, 48, 2 * 144 + 12])) is not None  # whole coefficients: holds
    odd = [_sized(m, [64, 4 * m, m * m // 2]) for m in (4, 6, 9)]  # 8, 18, 40: a law with half-bytes
    assert fit_quadratic(odd, _sized(12, [64, 48, 72])) is None
    assert fit_quadratic([*points[:2], points[0]], points[2]) is None  # two points at one micro-batch
