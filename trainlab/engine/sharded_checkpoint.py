"""Sharded checkpoints (`--fsdp`): the tensors in a `torch.distributed.checkpoint` (DCP) folder that every rank writes
its own shards into, everything else in the small file that points at it.

A run's `ckpt/` under `--fsdp`:

    step_000000120.dcp/        .metadata, __<rank>_<i>.distcp (each rank's shards, written in parallel) and
                               trainlab.pt (the index below, pointing at "."): the folder alone is a checkpoint
    last.pt, best.pt, step_000000120.pt   the index: `engine.checkpoint`'s format with every tensor of `models`,
                               `averaged` and `optimizers` replaced by an empty meta-device tensor of its global shape
                               and dtype, and `shards`, the folder's name beside the file

The folder is written under a temporary name (`.step_000000120.dcp.tmp`), renamed when complete, and only then
`last.pt` is replaced (`CheckpointStore.save`, the commit point as for whole files): a save killed at any moment
leaves the previous checkpoint loadable; the start of the next run removes a temporary folder and a folder no index
points at. DCP stores each tensor by its global shape, so a folder written by N processes loads into any number of
processes, sharded or not (`load_sharded`: straight into the live DTensors, each rank reading what its shards need)
and into plain whole tensors (`read_whole`: `trainlab sample`, `eval`, `--init-from`, the tests).

A tensor every rank holds whole (a BatchNorm's running statistics, an optimizer's step count) is written once, by
the lowest rank holding it: rank 0's, as in a whole-tensor checkpoint.
"""

# Legend: none (state dicts of the Trainer's models and optimizers; no tensor is named by shape here).

from __future__ import annotations

import pickle
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from trainlab.errors import UsageError
from trainlab.user_files import SHARDED_INDEX

SHARDS = "shards"
"""The index's key naming its DCP folder, relative to the index file ("." inside the folder)."""
INDEX = SHARDED_INDEX
"""The index's name inside the folder (`user_files` reads a folder given as a weights file through it)."""
SHARDED_KEYS = ("models", "averaged", "optimizers")
"""The checkpoint entries whose tensors live in the folder (the rest, small, stays in the index)."""
SUFFIX = ".dcp"

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
"""What DCP's `.metadata` pickle of tensors names (torch 2.x): nothing else is unpickled."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata, refused")


class SafeReader(FileSystemReader):
    """DCP's file reader without running code from the folder: DCP unpickles `.metadata` with `pickle.load` and
    would `torch.load(weights_only=False)` any entry it declares as Python bytes. Here `.metadata` may name only
    the metadata classes of a folder of tensors (`_METADATA_CLASSES`), and every entry must be a tensor; the tensors
    themselves DCP reads with `torch.load(weights_only=True)`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise ValueError(f".metadata holds a {type(metadata).__name__}, not DCP's Metadata")
        entries = metadata.state_dict_metadata.items()
        other = [key for key, entry in entries if not isinstance(entry, TensorStorageMetadata)]
        if other:
            raise ValueError(f"{other[0]} is stored as a Python object, not a tensor: refused (loading it runs code)")
        storage = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id
        metadata.storage_meta = storage
        return metadata


def split(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A training state (`engine.resume.training_state`, tensors live: DTensors under --fsdp) as (the tensors that go
    into the folder, nested as in `state`; the index: `state` with each of them replaced by a meta-device tensor of
    its global shape and dtype)."""
    tensors: dict[str, Any] = {}
    index = dict(state)
    for key in SHARDED_KEYS:
        if key in state:
            found, index[key] = _split(state[key])
            tensors[key] = found if found is not None else {}
    return tensors, index


def _split(obj: Any) -> tuple[Any, Any]:
    if isinstance(obj, torch.Tensor):
        return obj, torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, Mapping):
        found: dict[Any, Any] = {}
        skeleton: dict[Any, Any] = {}
        for key, value in obj.items():
            inner, skeleton[key] = _split(value)
            if inner is not None:
                found[key] = inner
        return (found or None), skeleton
    if isinstance(obj, (list, tuple)) and any(_holds_tensors(v) for v in obj):
        raise TypeError("a list holding tensors cannot be split into a sharded checkpoint: use a mapping")
    return None, obj


def is_sharded_index(state: Mapping[str, Any]) -> bool:
    """Whether a loaded checkpoint is the index of a sharded checkpoint (its tensors still in the folder)."""
    return isinstance(state.get(SHARDS), str)


def folder_of(state: Mapping[str, Any], path: Path) -> Path:
    """The DCP folder of the index `state` read from the file `path` (`index_path`: a folder's own index names ".")."""
    return path.parent / str(state[SHARDS])


def index_path(path: Path) -> Path:
    """The file to read for a checkpoint given as `path`: a sharded checkpoint's folder is read through its index."""
    return path / INDEX if path.is_dir() and (path / INDEX).is_file() else path


def check_folder(state: Mapping[str, Any], path: Path) -> Path:
    """The index's folder, which must hold a finished save (DCP's `.metadata`, written last).

    Raises:
        UsageError: the folder is missing or was not finished.
    """
    folder = folder_of(state, path)
    if not (folder / ".metadata").is_file():
        raise UsageError(
            f"checkpoint {path} keeps its tensors in {folder}, which is missing or unfinished (no .metadata); resume "
            "from another checkpoint (ckpt/step_*.pt) or start over with --overwrite"
        )
    try:
        SafeReader(folder).read_metadata()
    except Exception as err:
        raise UsageError(
            f"checkpoint {path}: its folder's {folder / '.metadata'} cannot be read ({reason(err)}); pass a checkpoint "
            "trainlab wrote"
        ) from None
    return folder


READ_ERRORS = (Exception, CheckpointException)
"""What a DCP read or write raises (DCP's own exception derives from BaseException): catch these."""


def failure_of(err: BaseException) -> BaseException:
    """The exception behind a DCP failure (a `CheckpointException` wraps each rank's), else `err` itself."""
    if isinstance(err, CheckpointException) and err.failures:
        inner = next(iter(err.failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return err


def reason(err: BaseException) -> str:
    """One line saying why a DCP read or write failed."""
    inner = failure_of(err)
    lines = [line for line in str(inner).splitlines() if line.strip()]
    return (lines[-1] if lines else type(inner).__name__)[:200]


# DCP warns on every call made without a process group; in one process that is what is meant (and said in the log)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _single(group: ProcessGroup | None) -> bool:
    return group is None and not torch.distributed.is_initialized()


def planner() -> DefaultSavePlanner:
    """DCP's planner, with a tensor every rank holds whole written by the lowest rank holding it (rank 0's)."""
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def write(tensors: dict[str, Any], folder: Path, group: ProcessGroup | None) -> None:
    """Every rank writes its shards of `tensors` into `folder` (collective; files fsynced; `.metadata` last)."""
    dcp.save(
        tensors,
        storage_writer=FileSystemWriter(folder, sync_files=True),
        planner=planner(),
        process_group=group,
        no_dist=_single(group),
    )


def write_in_background(tensors: dict[str, Any], folder: Path, group: ProcessGroup | None) -> Future[Any]:
    """`write` in a background thread: the tensors are copied to host memory before this returns (the training
    step may change them at once); the future completes when every rank's shards and `.metadata` are written."""
    response = dcp.async_save(
        tensors,
        storage_writer=FileSystemWriter(folder, sync_files=True),
        planner=planner(),
        process_group=group,
        no_dist=_single(group),
    )
    return response if isinstance(response, Future) else response.upload_completion


def _targets(index: Any, live: Any) -> Any:
    """Tensors to load the folder's `index` entries into: `live`'s where it holds a tensor of the same global shape
    (a DTensor gets its shards only), else a new host tensor of the saved shape and dtype."""
    if isinstance(index, torch.Tensor):
        if isinstance(live, torch.Tensor) and tuple(live.shape) == tuple(index.shape):
            return live if live.dtype == index.dtype else torch.empty_like(live, dtype=index.dtype)
        return torch.empty(index.shape, dtype=index.dtype)
    if isinstance(index, Mapping):
        return {
            key: _targets(value, live.get(key) if isinstance(live, Mapping) else None)
            for key, value in index.items()
            if _holds_tensors(value)
        }
    return None


def _holds_tensors(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensors(v) for v in obj)
    return isinstance(obj, Mapping) and any(_holds_tensors(v) for v in obj.values())


def _merge(index: Any, loaded: Any) -> Any:
    """`index` with its meta tensors replaced by the loaded ones."""
    if isinstance(index, Mapping):
        return {key: _merge(value, loaded.get(key)) if key in loaded else value for key, value in index.items()}
    return loaded


def load_into(
    index: Mapping[str, Any], folder: Path, live: Mapping[str, Any], group: ProcessGroup | None
) -> dict[str, Any]:
    """The sharded entries of `index` read from `folder` into the tensors of `live` (the same entries of this run's
    state: models', averaged copies' and optimizers' state dicts, DTensors under --fsdp), each rank reading the parts
    its tensors hold. Returns `index` with the loaded tensors in place of the meta ones: pass its entries to
    `load_state_dict` as for a whole-tensor checkpoint. Collective when a process group is given."""
    return _read(index, folder, live, SHARDED_KEYS, group, no_dist=_single(group))


def read_whole(index: Mapping[str, Any], folder: Path, keys: tuple[str, ...] = SHARDED_KEYS) -> dict[str, Any]:
    """`index` with the entries `keys` read whole from `folder` into host tensors, in this process alone (no process
    group): what a whole-tensor checkpoint holds.

    Raises:
        UsageError: the folder cannot be read.
    """
    try:
        return _read(index, folder, {}, keys, None, no_dist=True)
    except READ_ERRORS as err:
        raise UsageError(
            f"cannot read the checkpoint folder {folder} ({reason(err)}); pass a finished checkpoint"
        ) from None


def _read(
    index: Mapping[str, Any],
    folder: Path,
    live: Mapping[str, Any],
    keys: tuple[str, ...],
    group: ProcessGroup | None,
    *,
    no_dist: bool,
) -> dict[str, Any]:
    wanted = {key: index[key] for key in keys if key in index}
    targets = {key: _targets(value, live.get(key)) for key, value in wanted.items()}
    targets = {key: value for key, value in targets.items() if value}
    if targets:
        dcp.load(targets, storage_reader=SafeReader(folder), process_group=group, no_dist=no_dist)
    return {**index, **{key: _merge(wanted[key], targets.get(key, {})) for key in wanted}}


def local_bytes(tensors: Any) -> int:
    """Bytes this rank writes for `tensors` (a DTensor's local shard), for the message of a full disk."""
    if isinstance(tensors, DTensor):
        return local_bytes(tensors.to_local())
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, Mapping):
        return sum(local_bytes(v) for v in tensors.values())
    return 0
