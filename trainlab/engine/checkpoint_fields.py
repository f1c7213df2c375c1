"""The top-level fields of a checkpoint (step, epoch, recipe, ...), read without torch and without its tensors.

`torch.save` writes a zip archive: `<name>/data.pkl` pickles the saved object, in which every tensor is a reference to
a storage record stored elsewhere in the archive. Listing runs (`trainlab runs`) needs a few numbers and names at the
top of each checkpoint, so it reads `data.pkl` alone with an unpickler that turns every torch object (tensor, dtype,
storage) into an inert placeholder and never reads a storage: no torch import (seconds), no weights read (gigabytes
for a large model), and nothing a file names is executed (the only classes built are `collections.OrderedDict`, a
few builtin containers and the placeholder). Its memory is bounded too: `data.pkl` is read up to `MAX_PICKLE_BYTES`
(a zip member that inflates to gigabytes is refused) and no container is built from a size alone.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainlab.errors import first_line

MAX_PICKLE_BYTES = 64 * 2**20  # a checkpoint's data.pkl holds fields and tensor references: kilobytes to megabytes


def _bytearray(source: Any = b"", encoding: str = "latin-1") -> bytearray:
    """`bytearray` as pickle protocols 2-4 rebuild one (from its bytes or their latin-1 text), never from a size: a
    180-byte file asking for `bytearray(2**31)` would allocate 2 GiB."""
    if isinstance(source, str):
        return bytearray(source, encoding)
    if isinstance(source, (bytes, bytearray)):
        return bytearray(source)
    raise pickle.UnpicklingError("bytearray from anything but its bytes has no place in a checkpoint")


_BUILTINS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
}


class UnreadableCheckpoint(ValueError):
    """The file is not a `torch.save` archive this reader can read (cut by a kill, another format, foreign)."""


class TorchObject:
    """What a torch object of the checkpoint (a tensor, a dtype, a storage) reads as: nothing of it is kept."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def __setstate__(self, state: Any) -> None:
        del state

    def __repr__(self) -> str:
        return "<torch object>"


class _FieldsUnpickler(pickle.Unpickler):
    """Builds containers and scalars; every torch global is `TorchObject`, every storage reference None."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" or module.startswith("torch."):
            return TorchObject
        module = "builtins" if module == "__builtin__" else module  # pickle protocol 2 names Python 2's module
        if (module, name) in _BUILTINS:
            return _BUILTINS[(module, name)]
        if (module, name) == ("_codecs", "encode"):  # how pickle protocol 2 writes bytes
            return lambda text, encoding="utf-8": str(text).encode(encoding)
        raise pickle.UnpicklingError(f"{module}.{name} has no place in a checkpoint")

    def persistent_load(self, pid: Any) -> None:
        return None  # a tensor's storage: never read


def read_fields(path: str | Path, keys: Iterable[str]) -> dict[str, Any]:
    """The values of `keys` at the top of the checkpoint `path` (missing keys are left out; tensors read as
    `TorchObject`).

    Raises:
        UnreadableCheckpoint: not a zip archive `torch.save` wrote, no pickle in it, a pickle naming anything but
            torch objects and plain containers, or a top level that is not a mapping (one line, with the reason).
        OSError: the file cannot be opened.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if not names:
                raise UnreadableCheckpoint(f"{path}: no data.pkl in the archive (not a torch.save file)")
            with archive.open(names[0]) as member:  # read at most the limit, whatever the header claims
                data = member.read(MAX_PICKLE_BYTES + 1)
            if len(data) > MAX_PICKLE_BYTES:
                raise UnreadableCheckpoint(
                    f"{path}: its data.pkl is over {MAX_PICKLE_BYTES // 2**20} MiB, more than any checkpoint's fields"
                )
        obj = _FieldsUnpickler(io.BytesIO(data)).load()
    except (UnreadableCheckpoint, OSError):
        raise
    except Exception as err:  # whatever a damaged or foreign file makes the zip or pickle reader raise
        raise UnreadableCheckpoint(f"{path}: {first_line(err)}") from None
    if not isinstance(obj, dict):
        raise UnreadableCheckpoint(f"{path}: holds a {type(obj).__name__}, not a mapping")
    return {key: obj[key] for key in keys if key in obj}
