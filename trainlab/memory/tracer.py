"""Record every tensor storage's allocation and free, in order, while code runs (usually on fake tensors).

`StorageTracer` is a `TorchDispatchMode` in the spirit of `torch.distributed._tools.mem_tracker.MemTracker`: after
each ATen op it looks at the output tensors' untyped storages; a storage seen for the first time is an allocation,
and a weak reference callback on it records the free when the storage dies. Each allocation carries the `region`
the driver set when it happened (setup, batch, forward, backward, optimizer, after_step) and whether it is an
autocast copy of a parameter, so that a later pass can say what the bytes at the peak were. Storages no op
allocated are not recorded: `torch.load` rebuilds a weights file's tensors by `set_` onto storages it read itself
(host memory; on CUDA runs they never reach the GPU, and they die once copied into the model). Under fake tensors
the dispatch cache would keep them alive to the end, so counting them would show a second copy of a frozen model.

Under fake tensors nothing has a value. Reads of a value (`.item()`, `float(t)`, `bool(t)`, `.tolist()`,
`.numpy()`) answer a neutral placeholder instead: 0 / 0.0 / False (a finite gradient norm, "no overflow", "no
dead code"), so the real step's control flow takes its common path.

While `in_recipe_hook` is set (the recipe's `after_optimizer_step`), every storage an op writes in place is marked
`written_by_recipe_hook`: a parameter or buffer the recipe updates itself once per optimizer step (a momentum
encoder, an EMA model or codebook) is recipe state, not a trained parameter.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # loaded by `import torch`
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from trainlab.memory.fake_memo import FakeOpMemo

Region = Literal["setup", "batch", "forward", "backward", "optimizer", "after_step"]


@dataclass
class StorageRecord:
    """One storage's life: its bytes, where it was allocated, and what it turned out to be."""

    index: int
    nbytes: int
    region: Region
    step: int  # index of the traced optimizer step (-1: set-up)
    autocast_copy: bool = False
    label: str = ""  # parameter, gradient, optimizer_state, buffer, frozen (set by the driver); '' = by region
    written_by_recipe_hook: bool = False  # written in place by the recipe's after_optimizer_step

    def with_bytes(self, nbytes: int) -> StorageRecord:
        """This record at another size (a fitted trace's; `dataclasses.replace` is ten times slower)."""
        return StorageRecord(
            self.index, nbytes, self.region, self.step, self.autocast_copy, self.label, self.written_by_recipe_hook
        )


@dataclass
class Trace:
    """The ordered events: (+1, record index) allocation, (-1, record index) free."""

    records: list[StorageRecord] = field(default_factory=list)
    events: list[tuple[int, int]] = field(default_factory=list)
    step_starts: list[int] = field(default_factory=list)  # event position where each traced step began
    end: int = -1  # event position after the last traced step (later events: the trace's own clean-up)
    micro_step_starts: list[int] = field(default_factory=list)  # event position where each micro-batch was drawn
    micro_steps_ends: list[int] = field(default_factory=list)  # event position where each step's unscale began
    first_pass: bool = False  # the recipe ran a first pass over the micro-batches (MoCo's keys)


def _placeholder_scalar(dtype: torch.dtype, overflow_flag: bool) -> bool | int | float:
    """False for flags, 1 for counters and scales (Adam's step, the loss scale), 0.0 for a GradScaler `found_inf`."""
    if dtype == torch.bool:
        return False
    if overflow_flag:
        return 0.0
    return 1.0 if (dtype.is_floating_point or dtype.is_complex) else 1


def _dynamic_shape_placeholder(func: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Ops whose output size depends on values: the size when nothing is selected (or `minlength` bins)."""
    aten = torch.ops.aten
    x = args[0]
    if func is aten.bincount.default:
        weights = args[1] if len(args) > 1 else kwargs.get("weights")
        minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
        dtype = torch.int64 if weights is None else torch.promote_types(weights.dtype, torch.float64)
        return torch.zeros(max(int(minlength), 1), dtype=dtype, device=x.device)
    if func is aten.nonzero.default:
        return torch.zeros(0, x.dim(), dtype=torch.int64, device=x.device)
    if func is aten.masked_select.default:
        return torch.zeros(0, dtype=x.dtype, device=x.device)
    return None


_DYNAMIC_SHAPE = frozenset(
    {torch.ops.aten.bincount.default, torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default}
)


def _output_tensors(out: Any) -> list[torch.Tensor] | tuple[torch.Tensor]:
    """The tensors an op returned (most ops return one tensor: no pytree walk for those)."""
    if isinstance(out, torch.Tensor):
        return (out,)
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor) or t.device.type == "meta"


def _is_fake_arg(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and _is_fake(x)


def _fake_tolist(original: Callable[..., Any]) -> Callable[..., Any]:
    def tolist(t: torch.Tensor) -> Any:
        return np.zeros(tuple(t.shape), dtype=np.int64).tolist() if _is_fake(t) else original(t)

    return tolist


def _fake_numpy(original: Callable[..., Any]) -> Callable[..., Any]:
    def numpy(t: torch.Tensor, *, force: bool = False) -> Any:
        return np.zeros(0, dtype=np.uint8) if _is_fake(t) else original(t, force=force)

    return numpy


@contextmanager
def _value_reads() -> Iterator[None]:
    """`.tolist()` / `.numpy()` of a fake tensor: a zero placeholder (no bytes behind it). `Tensor`'s two methods
    are wrapped while tracing, not intercepted by a `TorchFunctionMode`: a mode would see every call and attribute
    read of every tensor (a tenth of a traced step's time) for these two."""
    own = {name: torch.Tensor.__dict__.get(name) for name in ("tolist", "numpy")}  # None: `TensorBase`'s
    torch.Tensor.tolist = _fake_tolist(torch.Tensor.tolist)  # type: ignore[method-assign]
    torch.Tensor.numpy = _fake_numpy(torch.Tensor.numpy)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, method in own.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


_PRIM_DEVICE = torch.ops.prim.device.default


def _fake_device(t: Any) -> torch.device | None:
    """A fake tensor's device, answered as `FakeTensor.__torch_dispatch__` answers `prim.device` (the device it
    poses as; meta inside a kernel), without the fake mode's dispatch: the autograd engine asks it for every input
    of every node, two thirds of a traced step's dispatches. None for anything else (dispatched as usual)."""
    if type(t) is not FakeTensor:
        return None
    return _META if t.fake_mode.in_kernel_invocation else t.fake_device


_META = torch.device("meta")

_SET_STORAGE = (torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset)


class StorageTracer(TorchDispatchMode):
    """Records storage allocations and frees. Use with `tracing()`; set `region` / `step` as the run goes.

    Args:
        memo: answer repeated ops on fake tensors from `memory.fake_memo` (the same outputs, faster); False sends
            every op through the fake mode.
    """

    def __init__(self, memo: bool = True) -> None:
        super().__init__()
        self.memo = FakeOpMemo() if memo else None
        self.trace = Trace()
        self.region: Region = "setup"
        self.step = -1
        self._index_of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._parameter_storages: set[int] = set()  # record indices of parameter storages (autocast copies)
        self.uses_convolution = False  # cuDNN convolution workspace on CUDA
        self.in_recipe_hook = False  # set by the driver around the recipe's after_optimizer_step
        self._overflow_flags: set[int | None] = set()  # GradScaler found_inf storages: read as 0.0 (no overflow)
        # storages no traced op allocated: `torch.load` builds a file's tensors by `set_` onto storages it read
        # itself (host memory, map_location="cpu"; freed once the weights are copied into the model)
        self._external: WeakIdKeyDictionary = WeakIdKeyDictionary()

    # ----------------------------------------------------------------------------------------- recording
    def record_index(self, t: torch.Tensor) -> int | None:
        """The record of `t`'s storage (registered now if the tracer has not seen it yet)."""
        storage = t.untyped_storage()
        index = self._index_of.get(storage)
        if index is None:
            index = self._register(storage, autocast_copy=False)
        return index

    def _register(self, storage: Any, autocast_copy: bool) -> int:
        index = len(self.trace.records)
        record = StorageRecord(index, int(storage.nbytes()), self.region, self.step, autocast_copy)
        self.trace.records.append(record)
        self.trace.events.append((1, index))
        self._index_of[storage] = index
        events = self.trace.events
        refs = self._refs

        def on_free(_: Any, index: int = index) -> None:
            events.append((-1, index))
            refs.pop(index, None)

        self._refs[index] = weakref.ref(storage, on_free)
        return index

    def label(self, t: torch.Tensor, label: str) -> None:
        index = self.record_index(t)
        if index is not None:
            self.trace.records[index].label = label
            if label == "parameter":
                self._parameter_storages.add(index)

    def mark_step_start(self) -> None:
        self.trace.step_starts.append(len(self.trace.events))

    def mark_end(self) -> None:
        self.trace.end = len(self.trace.events)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _PRIM_DEVICE:
            device = _fake_device(args[0])
            if device is not None:
                return device
        # below the dispatcher no torch-function mode applies: the CUDA autocast policy (`memory.cuda_autocast`)
        # would otherwise see every tensor attribute this tracer and the fake mode read, and the fake kernels' calls
        with torch._C.DisableTorchFunction():
            return self._dispatch(func, args, kwargs)

    def _dispatch(self, func: Any, args: Any, kwargs: Any) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and _is_fake(args[0]):
            flag = self._index_of.get(args[0].untyped_storage()) in self._overflow_flags
            return _placeholder_scalar(args[0].dtype, flag)
        if func.overloadpacket is torch.ops.aten.convolution:
            self.uses_convolution = True
        dynamic = func in _DYNAMIC_SHAPE and args and _is_fake_arg(args[0])
        out = _dynamic_shape_placeholder(func, args, kwargs) if dynamic else None
        if out is None:
            out = func(*args, **kwargs) if self.memo is None else self.memo(func, args, kwargs)
        if func in _SET_STORAGE and isinstance(args[1], torch.UntypedStorage) and args[1] not in self._index_of:
            self._external[args[1]] = True
        if self.in_recipe_hook:
            for t in _written_arguments(func, args, kwargs):
                index = self._index_of.get(t.untyped_storage())
                if index is not None:
                    self.trace.records[index].written_by_recipe_hook = True
        if func is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default:
            self._overflow_flags.add(self.record_index(args[1]))
        autocast_copy = False
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            source = self._index_of.get(args[0].untyped_storage())
            autocast_copy = source is not None and source in self._parameter_storages and self.region == "forward"
        for t in _output_tensors(out):
            storage = t.untyped_storage()
            if storage not in self._index_of and storage not in self._external:
                self._register(storage, autocast_copy)
        return out


def _written_arguments(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op writes in place (its schema's `Tensor(a!)` arguments, lists included: `_foreach_*_`)."""
    written: list[torch.Tensor] = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return written


def _apply_keeping_parameters(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
    """`Module._apply` that assigns `.data` instead of swapping: torch swaps fake parameters, and the swap fails
    because the fake mode holds weak references to them. Keeps the Parameter objects, as the real `.to` does."""
    if recurse:
        for module in self.children():
            module._apply(fn)
    for param in self._parameters.values():
        if param is None:
            continue
        with torch.no_grad():
            applied = fn(param)
        if applied is not param:
            param.data = applied
    for key, buffer in self._buffers.items():
        if buffer is not None:
            self._buffers[key] = fn(buffer)
    return self


@contextmanager
def tracing(tracer: StorageTracer) -> Iterator[StorageTracer]:
    """Run under fake tensors (no real memory, no real compute) with `tracer` recording on top."""
    original = nn.Module._apply
    nn.Module._apply = _apply_keeping_parameters  # type: ignore[method-assign]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, tracer, _value_reads():
            if tracer.memo is not None:
                tracer.memo.mode = mode  # factory calls are memoized in it
            yield tracer
    finally:
        nn.Module._apply = original  # type: ignore[method-assign]
