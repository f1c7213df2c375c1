"""Each shape rule gives the output the fake mode's own (Python decomposition) path gives, and leaves the calls it
does not cover, errors included, to the fake mode."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from trainlab.memory.fake_memo import FakeOpMemo
from trainlab.memory.fake_shape_rules import SHAPE_RULES

aten = torch.ops.aten


def _input(mode: FakeTensorMode, shape: tuple[int, ...], dtype: torch.dtype, channels_last: bool) -> FakeTensor:
    with mode:
        x = torch.empty(shape, dtype=dtype)
        return x.contiguous(memory_format=torch.channels_last) if channels_last else x


CASES: list[tuple[Any, tuple[Any, ...]]] = [
    (aten.upsample_bicubic2d.default, ([16, 16], False, None, None)),
    (aten.upsample_bicubic2d.default, ([5, 7], True, None, None)),
    (aten.upsample_bicubic2d.default, ([32, 24], False, 2.0, 1.5)),
    (aten.upsample_bicubic2d.vec, ([16, 16], False, None)),
    (aten.upsample_bicubic2d.vec, (None, False, [1.5, 2.7])),  # floor(H x scale)
    (aten.upsample_bicubic2d.vec, (None, True, [0.5, 0.34])),
]


@pytest.mark.parametrize(("func", "rest"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_rule_gives_what_the_fake_mode_gives(
    func: Any, rest: tuple[Any, ...], dtype: torch.dtype, channels_last: bool
) -> None:
    mode = FakeTensorMode()
    x = _input(mode, (3, 4, 10, 12), dtype, channels_last)
    with mode:
        want = func(x, *rest)
    got = SHAPE_RULES[func](mode, x, *rest)
    assert type(got) is FakeTensor and got.fake_mode is mode and not got.requires_grad
    assert (got.shape, got.stride(), got.dtype, got.fake_device) == (want.shape, want.stride(), want.dtype, want.device)
    assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes()


def _outcome(call: Any) -> tuple[Any, ...]:
    try:
        out = call()
    except Exception as err:  # whatever the fake mode raises
        return (type(err), str(err))
    return (out.shape, out.stride(), out.dtype)


def test_calls_a_rule_does_not_cover_go_to_the_fake_mode() -> None:
    """An empty output size, a 3-d input: the rule declines, and the memo gives what the fake mode gives (its error,
    or its output where the decomposition makes one)."""
    mode = FakeTensorMode()
    x = _input(mode, (3, 4, 10, 12), torch.float32, False)
    flat = _input(mode, (3, 4, 10), torch.float32, False)
    memo = FakeOpMemo()
    memo.mode = mode
    for func, args in [
        (aten.upsample_bicubic2d.default, (x, [0, 16], False, None, None)),
        (aten.upsample_bicubic2d.default, (flat, [16, 16], False, None, None)),
        (aten.upsample_bicubic2d.vec, (x, None, False, [0.01, 2.0])),
    ]:
        assert SHAPE_RULES[func](mode, *args) is NotImplemented
        with mode:
            plain = _outcome(lambda: func(*args))  # noqa: B023  (called at once)
            memoized = _outcome(lambda: memo(func, args, {}))  # noqa: B023
        assert memoized == plain
