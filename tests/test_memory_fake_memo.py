"""The fake-op memo gives what the fake mode gives: every recipe's trace with it is the trace without it, and its
rebuilt outputs alias what the fake mode's alias."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from trainlab.engine.debug import debug_run_config
from trainlab.memory import trace as trace_module
from trainlab.memory.batch_fit import _canonical
from trainlab.memory.breakdown import breakdown
from trainlab.memory.fake_memo import FakeOpMemo
from trainlab.memory.trace import TracedRun, trace_training
from trainlab.memory.tracer import StorageTracer
from trainlab.recipes import get_recipe, list_recipes


def _recipe(name: str, **changes: Any) -> Any:
    cls = get_recipe(name)
    return cls(dataclasses.replace(debug_run_config(cls(cls.config_class())), **changes))


def _traced(recipe: Any, memo: bool, monkeypatch: pytest.MonkeyPatch, accumulation: int = 2) -> TracedRun:
    with monkeypatch.context() as patch:
        patch.setattr(trace_module, "StorageTracer", functools.partial(StorageTracer, memo=memo))
        return trace_training(recipe, device="cuda", micro_batch=4, grad_accumulation=accumulation)


SLOW = {"tokenizer", "cifar", "var"}  # about 12, 5 and 5 s; the cases below cover cifar and var
CASES = [pytest.param(name, {}, marks=pytest.mark.slow) if name in SLOW else (name, {}) for name in list_recipes()] + [
    ("var", {"activation_checkpointing": True}),  # recomputation inside the backward
    ("cifar", {"precision": "bf16"}),  # pure 16-bit weights
    ("cifar", {"precision": "fp16-amp-scale"}),  # loss scaling: unscale, the overflow check
]


@pytest.mark.parametrize(("name", "changes"), CASES)
def test_a_trace_with_the_memo_is_the_trace_without_it(
    name: str, changes: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _recipe(name, **changes)
    plain, memoized = (_traced(recipe, memo, monkeypatch) for memo in (False, True))
    a, b = plain.trace, memoized.trace
    assert b.records == a.records
    assert _canonical(b.events) == _canonical(a.events)  # storages freed together may die in another order
    assert (b.step_starts, b.end, b.micro_step_starts, b.micro_steps_ends) == (
        a.step_starts,
        a.end,
        a.micro_step_starts,
        a.micro_steps_ends,
    )
    assert breakdown(memoized) == breakdown(plain)


def test_the_memo_answers_repeated_ops_with_the_fake_modes_aliasing() -> None:
    memo = FakeOpMemo()
    aten = torch.ops.aten
    with FakeTensorMode():
        x = torch.empty(4, 6)
        y = torch.empty(4, 6)
    for _ in range(2):  # the first call asks the fake mode, the second is rebuilt
        added = memo(aten.add.Tensor, (x, y), {})
        viewed = memo(aten.view.default, (x, [24]), {})
        transposed = memo(aten.t.default, (x,), {})
        inplace = memo(aten.mul_.Tensor, (x, y), {})
    assert memo.hits == 4 and memo.misses == 4
    assert type(added) is FakeTensor and added.shape == (4, 6) and added.fake_device == torch.device("cpu")
    assert added.untyped_storage()._cdata not in {x.untyped_storage()._cdata, y.untyped_storage()._cdata}
    assert added.untyped_storage().nbytes() == 4 * 6 * 4
    assert viewed.untyped_storage()._cdata == x.untyped_storage()._cdata and viewed.shape == (24,)
    assert transposed.untyped_storage()._cdata == x.untyped_storage()._cdata and transposed.stride() == (1, 6)
    assert inplace is x


def test_outputs_that_are_none_and_tuples_are_rebuilt() -> None:
    memo = FakeOpMemo()
    aten = torch.ops.aten
    with FakeTensorMode():
        x = torch.empty(2, 3, 8)
        weight, bias = torch.empty(8), torch.empty(8)
        mean, rstd = torch.empty(2, 3, 1), torch.empty(2, 3, 1)
    args = (x, x, [8], mean, rstd, weight, bias, [True, False, False])
    first = memo(aten.native_layer_norm_backward.default, args, {})
    second = memo(aten.native_layer_norm_backward.default, args, {})
    assert memo.hits == 1
    assert type(second) is tuple and second[1] is None and second[2] is None
    assert second[0].shape == first[0].shape and second[0].stride() == first[0].stride()


def test_value_dependent_ops_and_inference_views_go_to_the_fake_mode() -> None:
    memo = FakeOpMemo()
    aten = torch.ops.aten
    with FakeTensorMode():
        x = torch.empty(4, 6)
        with torch.inference_mode():
            for _ in range(2):
                memo(aten.view.default, (x, [24]), {})
        for _ in range(2):
            memo(aten.resize_.default, (torch.empty(3), [5]), {})
    assert memo.hits == 0 and memo.misses == 0


def test_factory_calls_are_memoized_in_the_mode_they_are_given() -> None:
    aten = torch.ops.aten
    calls = [
        (aten.empty.memory_format, ([4, 6],), {"dtype": torch.float16, "device": torch.device("cpu")}),
        (aten.zeros.default, ([3, 5],), {}),
        (aten.full.default, ([2, 2], 1.5), {}),
        (aten.empty_strided.default, ([4, 6], [1, 4]), {}),
    ]
    with FakeTensorMode() as mode:
        expected = [func(*args, **kwargs) for func, args, kwargs in calls]
        without_mode = FakeOpMemo()
        for func, args, kwargs in calls:
            without_mode(func, args, kwargs)
        assert without_mode.hits == 0 and without_mode.misses == 0  # no mode to build them in: the fake mode answers
        memo = FakeOpMemo()
        memo.mode = mode
        for _ in range(2):  # the first call asks the fake mode, the second is rebuilt
            outputs = [memo(func, args, kwargs) for func, args, kwargs in calls]
    assert memo.hits == len(calls) and memo.misses == len(calls)
    for got, want in zip(outputs, expected, strict=True):
        assert type(got) is FakeTensor and got.fake_mode is mode
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        assert got.fake_device == want.device
        assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes()
    assert len({t.untyped_storage()._cdata for t in outputs}) == len(outputs)  # each on a storage of its own
