"""Weight files a user hands in: one safe loader, and one check of a state dict against the model it is read into.

- `load_user_file(path, what, fix=...)` reads a `torch.save` file (`.pt`, `.pth`, `.pth.tar`, ...) with
  `torch.load(map_location="cpu", weights_only=True)` (memory-mapped where the format allows) or a `.safetensors`
  file; a missing file or any read failure is one `UsageError` naming the file, the reason and the fix.
- `shapes_only()` / `weights_needed()`: the memory planner builds recipes for their shapes only; inside it, a
  frozen model may be made from its registered architecture without its file, and a given file is read for its
  names and shapes only (no value is needed on fake tensors).
- `check_state_dict(found, expected, source=...)` compares a state dict with the model's own: the same keys, each
  tensor with the model's shape, a floating-point dtype where the model holds floats (an integer or bool one where it
  holds those), and only finite values (`neg_inf_ok` names buffers that are -inf by design, e.g. an attention mask).
  The first problem is one `UsageError` naming the file, the key and the fix, before `load_state_dict` can fail with
  a multi-line message or non-finite weights reach a forward pass (where they surface much later, as NaN
  probabilities in a sampler or a chance-level accuracy printed as a result).

Both are leaves of the package (torch and safetensors only), so models, the engine and commands can share them.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from trainlab.errors import UsageError, first_line, missing_file

SHARDED_INDEX = "trainlab.pt"
"""The index file inside a sharded trainlab checkpoint's folder (`engine.sharded_checkpoint.INDEX`): such a folder is
read through it."""

_SHAPES_ONLY: ContextVar[bool] = ContextVar("shapes_only", default=False)


@contextmanager
def shapes_only() -> Iterator[None]:
    """Within: models are built for their shapes; weight values are neither needed nor read."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def weights_needed() -> bool:
    """False inside `shapes_only()` (the memory planner)."""
    return not _SHAPES_ONLY.get()


def load_error_reason(err: BaseException) -> str:
    """Why a weights or checkpoint file could not be read, in a few words. The weights-only unpickler's own text
    advises turning the safety off, which is never the fix: say what it refused instead, and tell a file that names
    code (a GLOBAL the unpickler blocks) from one that is no pickle at all (damaged, or another format)."""
    text = str(err)
    if isinstance(err, pickle.UnpicklingError) and "weights only" in text.lower():
        if "GLOBAL" in text or "Unsupported global" in text:
            return "it names Python code to run, not only tensors and plain containers: refused, never run"
        detail = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        what = f": {detail[0].strip()}" if detail and "WeightsUnpickler error" in text else ""
        return f"not a torch weights file (damaged, or another format{what})"
    return first_line(err)


def load_user_file(path: str | os.PathLike[str], what: str, *, fix: str) -> Any:
    """Read a weights or checkpoint file on the CPU without running any code it may contain.

    Args:
        path: a `torch.save` file (`weights_only=True`: tensors, numbers, strings and plain containers only), a
            `.safetensors` file (a dict of tensors), or a sharded trainlab checkpoint's folder (its index is read;
            the caller's unwrap reads the tensors: `engine.checkpoint.weights_in_checkpoint`).
        what: what the file is, for messages ("VAR checkpoint", "MoCo checkpoint").
        fix: what the user should do instead, ending the message ("pass the file main_moco.py saved").

    Returns:
        The loaded object (tensors on the CPU; memory-mapped for zip-format torch files).

    Raises:
        UsageError: missing path, a folder, or a file that cannot be read (truncated, not a weights file, or one that
            holds arbitrary Python objects).
    """
    path = Path(path)
    if path.is_dir() and (path / SHARDED_INDEX).is_file():  # a sharded trainlab checkpoint (`--fsdp`): its index
        path = path / SHARDED_INDEX
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory, not a file; {fix}")
    if not path.is_file():
        raise UsageError(f"{what} {path} {missing_file(path)}; {fix}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device="cpu")
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped: read them whole
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any failure to read is about the user's file: one line
        if path.suffix == ".safetensors" and _starts_with(path, b"PK\x03\x04"):  # a torch.save zip, misnamed
            raise UsageError(
                f"{what} {path} is a torch.save file (a zip archive), not safetensors; rename it to .pth"
            ) from None
        raise UsageError(f"cannot read {what} {path} ({load_error_reason(err)}); {fix}") from None


def _starts_with(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def hollow_tensor(obj: Any, prefix: str = "") -> tuple[str, str] | None:
    """(where, what) of the first tensor in a loaded file (nested dicts, lists, tuples) that holds no values to read:
    a meta tensor (`torch.save` keeps its shape only) or a sparse / non-strided one; None when there is none. A file
    of weights or a checkpoint holds dense tensors only; the planner's fake tensors are not hollow."""
    if isinstance(obj, torch.Tensor):
        if obj.is_meta and not is_fake(obj):
            return prefix or "the file", "holds no values (a meta tensor)"
        if obj.layout != torch.strided:
            return prefix or "the file", f"is a {obj.layout} tensor"
        return None
    items: Any = obj.items() if isinstance(obj, Mapping) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    for key, value in items:
        found = hollow_tensor(value, f"{prefix}.{key}" if prefix else str(key))
        if found is not None:
            return found
    return None


def refuse_hollow_tensors(obj: Any, source: str, fix: str) -> None:
    """`hollow_tensor` as one `UsageError` naming `source`, the tensor and `fix`."""
    found = hollow_tensor(obj)
    if found is not None:
        where, what = found
        raise UsageError(f"{source}: {where} {what}, not dense weights: a damaged or edited file; {fix}")


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating-point" if dtype.is_floating_point else "integer"


def _shape(tensor: torch.Tensor) -> str:
    return str(tuple(int(s) for s in tensor.shape))


def _more(count: int) -> str:
    return f" (and {count - 1} more)" if count > 1 else ""


def check_state_dict(
    found: Mapping[str, Any],
    expected: Mapping[str, torch.Tensor],
    *,
    source: str,
    neg_inf_ok: Collection[str] = (),
) -> None:
    """Refuse a state dict that does not fit `expected` (a model's `state_dict()`, possibly on the meta device).

    Checked in this order, the first problem reported: keys (missing, then extra), shapes, dense tensors with values
    (no sparse or meta tensor), dtype kinds, finiteness.

    Args:
        found: the state dict read from the user's file.
        expected: the model's state dict (only keys, shapes and dtypes are read).
        source: the file as the message names it, e.g. "VAR checkpoint runs/var/var_export.pth".
        neg_inf_ok: keys whose floating values may be -inf by design (never NaN or +inf), named by the model.

    Raises:
        UsageError: one line naming `source`, the first offending key and the fix.
    """
    not_tensors = [k for k, v in found.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        kind = type(found[not_tensors[0]]).__name__
        raise UsageError(
            f"{source}: {not_tensors[0]} holds a {kind}, not a tensor{_more(len(not_tensors))}; pass a weights file "
            "whose state dict maps names to tensors"
        )
    missing = [k for k in expected if k not in found]
    if missing:
        raise UsageError(
            f"{source} lacks {missing[0]}{_more(len(missing))} of the model's {len(expected)} tensors: an incomplete "
            "file or another architecture; pass the complete weights of this model"
        )
    extra = [k for k in found if k not in expected]
    if extra:
        raise UsageError(
            f"{source} holds {extra[0]}{_more(len(extra))}, which the model it describes does not have: another "
            "architecture or a damaged file; pass weights of this model"
        )
    wrong = [k for k in expected if tuple(found[k].shape) != tuple(expected[k].shape)]
    if wrong:
        k = wrong[0]
        raise UsageError(
            f"{source}: {k} has shape {_shape(found[k])} where the model has {_shape(expected[k])}"
            f"{_more(len(wrong))}; its shapes match no known configuration: pass weights of this model"
        )
    odd = [k for k in expected if found[k].layout != torch.strided or (found[k].is_meta and not is_fake(found[k]))]
    if odd:
        k = odd[0]
        kind = "holds no values (a meta tensor)" if found[k].is_meta else f"is a {found[k].layout} tensor"
        raise UsageError(
            f"{source}: {k} {kind}, not dense weights: a damaged or edited file; pass the original weights"
        )
    for k, want in expected.items():
        have = found[k].dtype
        if _kind(have) != _kind(want.dtype):
            raise UsageError(
                f"{source}: {k} holds {_kind(have)} values ({have}) where the model keeps {_kind(want.dtype)} ones "
                f"({want.dtype}): not a weights file of this model (damaged or edited); pass the original weights"
            )
    bad: list[str] = []
    for k, tensor in found.items():
        if not tensor.is_floating_point() or is_fake(tensor):  # the memory planner's fake tensors have no values
            continue
        values = tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()  # fp8 has no isfinite
        ok = torch.isfinite(values) | (values == -torch.inf) if k in neg_inf_ok else torch.isfinite(values)
        if not bool(ok.all()):
            bad.append(k)
    if bad:
        values = found[bad[0]].float()
        nans, infs = int(values.isnan().sum()), int(values.isinf().sum())
        raise UsageError(
            f"{source}: {bad[0]} holds {nans} NaN and {infs} inf values ({len(bad)} non-finite tensor"
            f"{'s' if len(bad) > 1 else ''} in all: a diverged run or a damaged file); pass finite weights (an "
            "earlier checkpoint of the run)"
        )
