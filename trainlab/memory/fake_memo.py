"""A memo of fake-tensor ops by their inputs' metadata, in front of the fake mode's own dispatch.

On fake tensors an op's output is a function of the op and its inputs' metadata (dtype, sizes, strides, storage
offset, device, flags) and non-tensor arguments: there are no values. `FakeTensorMode` caches outputs on that
key itself, but building its key (a full metadata record per tensor argument, memory format included) and an
output from its cache is most of a traced training step's time (about 200 us per op on the benchmarks' CPU).
`FakeOpMemo` keeps its own, leaner key and rebuilds an output the way the fake mode's cache does (a meta tensor of
the cached sizes and strides wrapped as a `FakeTensor`; a view on its input's storage; an in-place op's own
argument), so a step that runs the same ops again (every micro-batch, every traced step) pays a few tens of
microseconds per op. The first call of each key goes through the fake mode, which says what the output is, except
for the few ops whose fake implementation is a Python decomposition of hundreds of ops (`memory.fake_shape_rules`:
their output from the kernel's own shape rule). Factory calls (`torch.empty`, `torch.zeros`, ...: no tensor
argument) are memoized too, in the fake mode the tracer runs under (`FakeOpMemo.mode`).

Not memoized (they go through the fake mode every time): ops whose outputs depend on values or change an
argument's metadata (torch's `data_dependent_output`, `dynamic_output_shape`, `inplace_view` tags; `set_`,
`resize_`), ops outside `aten` and `prims`, calls with a real tensor, a constant-carrying fake tensor, another
fake mode's tensor or a non-strided layout among the arguments, factory calls with no fake mode set, calls inside a
fake kernel, view ops under inference mode (autograd cannot share an inference tensor's version counter), and
outputs the rebuild would not reproduce (a fresh output on a storage larger than it needs, two outputs sharing a
fresh storage, non-tensor outputs other than None).

The outputs are new `FakeTensor`s with the same metadata and storage aliasing as the fake mode's; storages may die
in another order within a run of frees that happen together (an autograd graph released at once), which the
allocator replay does not depend on (`memory.batch_fit._canonical`). `tests/test_memory_fake_memo.py` checks each
recipe's trace with the memo against the trace without it.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from trainlab.memory.fake_shape_rules import SHAPE_RULES

_aten = torch.ops.aten
_BYPASS_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape, torch.Tag.inplace_view)
_BYPASS_PACKETS = frozenset({_aten.set_, _aten.resize_, _aten.resize_as_, _aten._local_scalar_dense})
_layout = torch._C.TensorBase.layout.__get__  # type: ignore[attr-defined]  # `FakeTensor.layout`'s C getter
_PLAIN = (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format, type(None))


class _NotMemoized(Exception):
    """An argument the key does not describe (see the module docstring)."""


@dataclass(frozen=True)
class _Fresh:
    """An output on a storage of its own, exactly as large as its sizes and strides need."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


@dataclass(frozen=True)
class _View:
    """An output on the storage of the `source`-th tensor argument."""

    source: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


@dataclass(frozen=True)
class _Argument:
    """The `source`-th tensor argument itself (an in-place op's, an `out=` argument)."""

    source: int


_Output = _Fresh | _View | _Argument | None


@dataclass(frozen=True)
class _Entry:
    container: type | None  # None: one output; else the tuple or list type of several
    outputs: tuple[_Output, ...]


_UNSEEN: Any = object()


class FakeOpMemo:
    """Call `memo(func, args, kwargs)` where a `TorchDispatchMode` above `FakeTensorMode` would call
    `func(*args, **kwargs)`: the same outputs (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, _Entry | None] = {}  # None: the fake mode's output cannot be rebuilt
        self._eligible: dict[Any, bool] = {}
        self.mode: FakeTensorMode | None = None  # where factory calls (no tensor argument) build their outputs
        self.hits = 0
        self.misses = 0

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        eligible = self._eligible.get(func)
        if eligible is None:
            eligible = self._eligible[func] = _eligible(func)
        if not eligible:
            return func(*args, **kwargs)
        tensors: list[FakeTensor] = []
        try:
            key = _key(func, args, kwargs, tensors, self.mode)
        except _NotMemoized:
            return func(*args, **kwargs)
        mode = tensors[0].fake_mode if tensors else self.mode
        assert mode is not None  # `_key` refuses a factory call without a mode
        if mode.in_kernel_invocation or (func.is_view and torch.is_inference_mode_enabled()):
            return func(*args, **kwargs)
        entry = self._entries.get(key, _UNSEEN)  # one lookup: a key's tuple hash is not cached
        if entry is _UNSEEN:
            self.misses += 1
            rule = SHAPE_RULES.get(func)
            out = NotImplemented if rule is None else rule(mode, *args, **kwargs)
            if out is NotImplemented:
                out = func(*args, **kwargs)
            self._entries[key] = _entry(out, tensors)
            return out
        if entry is None:
            return func(*args, **kwargs)
        self.hits += 1
        return _rebuild(entry, tensors, mode)


def _eligible(func: Any) -> bool:
    return (
        isinstance(func, torch._ops.OpOverload)
        and func.namespace in ("aten", "prims")
        and func.overloadpacket not in _BYPASS_PACKETS
        and not any(tag in func.tags for tag in _BYPASS_TAGS)
    )


def _key(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[FakeTensor], mode: FakeTensorMode | None
) -> Hashable:
    """The call's key; its fake tensor arguments are appended to `tensors` in order. A call without one is keyed only
    where it is a factory (`_is_factory`) and `mode` is the fake mode to build it in. Raises `_NotMemoized`."""
    parts: list[Any] = [func, torch.get_default_dtype(), torch.is_inference_mode_enabled()]
    for value in args:
        _describe(value, parts, tensors)
    for name, value in kwargs.items():
        parts.append(name)
        _describe(value, parts, tensors)
    if not tensors:
        if mode is None or not _is_factory(func):
            raise _NotMemoized
        return tuple(parts)
    mode = tensors[0].fake_mode
    if any(t.fake_mode is not mode for t in tensors):
        raise _NotMemoized
    return tuple(parts)


@functools.cache
def _is_factory(func: Any) -> bool:
    """No tensor among the schema's arguments, one tensor returned (`torch.empty`, `zeros`, `full`, `rand`, ...)."""
    tensor = torch._C.TensorType.get()

    def holds_tensor(kind: Any) -> bool:
        return bool(kind.isSubtypeOf(tensor)) or any(holds_tensor(k) for k in kind.containedTypes())

    schema = func._schema
    return not any(holds_tensor(a.type) for a in schema.arguments) and [r.type for r in schema.returns] == [tensor]


def _describe(value: Any, parts: list[Any], tensors: list[FakeTensor]) -> None:
    kind = type(value)
    if kind is FakeTensor:
        if value.constant is not None or _layout(value) is not torch.strided:
            raise _NotMemoized
        tensors.append(value)
        parts.append(
            (
                value.dtype,
                value.shape,
                value.stride(),
                value.storage_offset(),
                value.fake_device,
                value.requires_grad,
                value.is_conj(),
                value.is_neg(),
                value.is_inference(),
            )
        )
    elif kind is list or kind is tuple:
        parts.append((kind, len(value)))
        for item in value:
            _describe(item, parts, tensors)
    elif isinstance(value, _PLAIN) and not isinstance(value, torch.Tensor):
        parts.append((kind, value))
    else:
        raise _NotMemoized  # a real tensor, a subclass, a SymInt, a callable, ...


def _entry(out: Any, tensors: list[FakeTensor]) -> _Entry | None:
    """How to rebuild `out` from the arguments, or None where the rebuild would not reproduce it."""
    single = isinstance(out, torch.Tensor)
    if not single and type(out) not in (tuple, list):
        return None
    storages: dict[int, int] = {}  # storage -> the first tensor argument on it
    for position, t in enumerate(tensors):
        storages.setdefault(t.untyped_storage()._cdata, position)
    fresh_storages: set[int] = set()
    outputs: list[_Output] = []
    for o in (out,) if single else out:
        if o is None:
            outputs.append(None)
            continue
        if type(o) is not FakeTensor or o.constant is not None or _layout(o) is not torch.strided:
            return None
        same = next((i for i, t in enumerate(tensors) if t is o), None)
        if same is not None:
            outputs.append(_Argument(same))
            continue
        if o.is_conj() or o.is_neg():
            return None
        storage = o.untyped_storage()
        source = storages.get(storage._cdata)
        if source is not None:
            offset = int(o.storage_offset())
            outputs.append(_View(source, tuple(o.shape), o.stride(), offset, o.dtype, o.fake_device, o.requires_grad))
            continue
        needed = _storage_bytes(o)
        if o.storage_offset() != 0 or storage.nbytes() != needed or storage._cdata in fresh_storages:
            return None
        fresh_storages.add(storage._cdata)
        outputs.append(_Fresh(tuple(o.shape), o.stride(), o.dtype, o.fake_device, o.requires_grad))
    return _Entry(None if single else type(out), tuple(outputs))


def _storage_bytes(t: torch.Tensor) -> int:
    """The bytes `torch.empty_strided(t.shape, t.stride())` allocates."""
    if t.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return extent * t.element_size()


def _rebuild(entry: _Entry, tensors: list[FakeTensor], mode: FakeTensorMode) -> Any:
    outputs: list[Any] = []
    for spec in entry.outputs:
        if spec is None or isinstance(spec, _Argument):
            outputs.append(None if spec is None else tensors[spec.source])
            continue
        with torch._C._DisableTorchDispatch():  # a plain meta tensor, not one more trip through the modes
            meta = torch.empty_strided(
                spec.shape, spec.stride, dtype=spec.dtype, device="meta", requires_grad=spec.requires_grad
            )
            if isinstance(spec, _View):
                meta.set_(tensors[spec.source].untyped_storage(), spec.storage_offset, spec.shape, spec.stride)
        outputs.append(FakeTensor(mode, meta, spec.device))
    if entry.container is None:
        return outputs[0]
    return entry.container(outputs)
