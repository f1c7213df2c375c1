"""Atomic checkpoints: write a temp file, fsync, rename. `best` is a copy of `last`, not a second save.

A crash mid-write leaves the previous `last.pt` intact: the rename is the commit point. Everything a user hands
in is read with `torch.load(weights_only=True)`, so checkpoints hold only tensors, containers and primitives.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainlab.errors import UsageError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path) -> None:
    """`torch.save` to a temp file in the same directory, fsync it, then `os.replace` onto `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def atomic_copy(src: Path, dst: Path) -> None:
    """Copy a finished checkpoint (e.g. last -> best) with the same temp + fsync + rename protocol."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp_name)
        with open(tmp_name, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_name, dst)
        _fsync_dir(dst.parent)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint safely (`weights_only=True`); unreadable files give a one-line UsageError."""
    if not path.is_file():
        raise UsageError(f"checkpoint {path} not found; pass an existing file (e.g. runs/<name>/ckpt/last.pt)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        first = (str(err).splitlines() or ["unreadable"])[0][:200]
        raise UsageError(f"checkpoint {path} could not be read ({first}); pass a trainlab checkpoint") from None
    if not isinstance(state, dict) or state.get("format") != "trainlab-checkpoint":
        raise UsageError(f"{path} is not a trainlab training checkpoint (no 'format' marker); pass ckpt/last.pt")
    return state


def check_compatible(saved_config: dict[str, Any], config: dict[str, Any], keys: tuple[str, ...], path: Path) -> None:
    """Refuse to resume when a field that changes the computation differs; name the first mismatch."""

    def lookup(d: dict[str, Any], dotted: str) -> Any:
        for part in dotted.split("."):
            if not isinstance(d, dict) or part not in d:
                return "<absent>"
            d = d[part]
        return d

    for key in keys:
        a, b = lookup(saved_config, key), lookup(config, key)
        if a != b:
            raise UsageError(
                f"checkpoint {path} was trained with {key}={a!r} but this run has {key}={b!r}; "
                f"use the same {key} or start a new run directory"
            )
