"""Training checkpoints: the one home of their format (what a checkpoint holds and where) and of their files.

The format (`FORMAT`, `FORMAT_VERSION`): a dict of tensors, containers and primitives, written by the Trainer
(`engine.resume.training_state`) and read back through this module's readers, never by spelling its keys elsewhere:

    format, version        FORMAT, FORMAT_VERSION (1: the first; 2: adds `averaged`)
    recipe, config         the recipe's name and the run's config (`to_dict`; read back with `stored_config`, which
                           applies the renames of settings since, `trainlab.config.upgrade_keys`)
    data                   {dataset_size, steps_per_epoch}
    models                 {name: state_dict} of the trained models (`model_weights`)
    averaged               {name: {follows, decay, weights}}: the averaged copies the engine keeps
                           (`TrainParts.averaged`; `averaged_weights`); absent before version 2
    optimizers, scalers, schedulers   {phase: state_dict}
    step, epoch, step_in_epoch, best_score, best_step, eval_pending, last_eval, last_eval_epoch   `Progress`
                           (top-level keys)
    rng_per_rank           every rank's RNG state
    recipe_state           `Recipe.state_dict()` (`recipe_state`)

Atomic files: write a temp file, fsync, rename. `best` is a copy of `last`, not a second save.

A crash mid-write leaves the previous `last.pt` intact: the rename is the commit point. Everything a user hands
in is read with `torch.load(weights_only=True)`, so checkpoints hold only tensors, containers and primitives.

Under `--fsdp` each of `last.pt`, `best.pt`, `step_*.pt` is the index of a sharded checkpoint: the same format with
the tensors of `models`, `averaged` and `optimizers` replaced by meta-device tensors of their shapes, and `shards`
naming the folder (`step_<step>.dcp/`) every rank wrote its shards into (`engine.sharded_checkpoint`);
`load_checkpoint` reads such a one whole, or as its index for the engine's resume.

`CheckpointStore` keeps a run's `ckpt/` consistent after any crash: the last K saves stay as `step_*.pt` (hard
links, so the newest costs no extra disk) and a corrupt `last.pt` falls back to them; temp files of killed saves
are removed at start; a `best.pt` left behind by a kill between the two renames is repaired from `last.pt`; weights
with NaN / inf are never written over a finite checkpoint; a full disk is one line, the old checkpoint intact.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainlab.config import upgrade_keys
from trainlab.engine import sharded_checkpoint as sharded
from trainlab.errors import TrainingStopped, UsageError, missing_file
from trainlab.user_files import load_error_reason, refuse_hollow_tensors

log = logging.getLogger(__name__)

FORMAT = "trainlab-checkpoint"
FORMAT_VERSION = 2
"""1: the first format; 2: adds `averaged` (a version-1 checkpoint holds no averaged weights)."""


@dataclass
class Progress:
    """Where the run stands; saved in every checkpoint (each field a top-level key)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    step_in_epoch: int = 0
    best_score: float | None = None
    best_step: int | None = None  # the step best.pt holds
    eval_pending: bool = False  # saved at an epoch end before its evaluation ran
    last_eval: dict[str, float] = field(default_factory=dict)  # the latest evaluation's metrics
    last_eval_epoch: int | None = None  # epochs completed when it ran

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Progress:
        """The progress a checkpoint records (validated by `engine.resume.check_structure`; absent optional keys
        take their defaults)."""
        progress = cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})
        if progress.best_score is not None:
            progress.best_score = float(progress.best_score)
        progress.eval_pending = bool(progress.eval_pending)
        progress.last_eval = {str(k): float(v) for k, v in dict(progress.last_eval).items()}
        return progress


def is_trainlab_checkpoint(obj: Any) -> bool:
    """Whether `obj` (a loaded file) is a trainlab training checkpoint."""
    return isinstance(obj, Mapping) and obj.get("format") == FORMAT


def saved_position(state: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe and `Progress` fields a checkpoint records, as stored (unchecked: for status overviews)."""
    return {key: state.get(key) for key in ("recipe", *(f.name for f in fields(Progress)))}


def model_weights(state: Mapping[str, Any], name: str, *, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The state_dict of the trained model `name` in a trainlab checkpoint.

    Raises:
        UsageError: the checkpoint holds no model of that name (the message lists the ones it holds).
    """
    models = state.get("models")
    weights = models.get(name) if isinstance(models, Mapping) else None
    if not isinstance(weights, Mapping):
        held = ", ".join(sorted(map(str, models))) if isinstance(models, Mapping) else "none"
        raise UsageError(
            f"{where} is a trainlab checkpoint of recipe {state.get('recipe')!r} holding no model {name!r} "
            f"(models: {held}); pass a checkpoint of a run that trained one"
        )
    return dict(weights)


def averaged_weights(state: Mapping[str, Any], follows: str) -> tuple[str, dict[str, torch.Tensor]] | None:
    """The name and state_dict of the averaged copy (`TrainParts.averaged`) that follows the trained model
    `follows` in a trainlab checkpoint; None when the run kept none."""
    averaged = state.get("averaged")
    if not isinstance(averaged, Mapping):
        return None
    for name, entry in averaged.items():
        if isinstance(entry, Mapping) and entry.get("follows") == follows and isinstance(entry.get("weights"), Mapping):
            return str(name), dict(entry["weights"])
    return None


def weights_in_checkpoint(model: str, *, averaged: bool = True) -> Callable[[Any, Path], Any]:
    """For a model loader's `unwrap=`: a trainlab training checkpoint becomes the state_dict of its model `model`, or
    of the averaged copy following it when the run kept one and `averaged` (what its evaluation and export used;
    logged); any other loaded file passes unchanged (the loader reads official formats itself).

    The function raises UsageError when a trainlab checkpoint holds no model `model`.
    """

    def unwrap(obj: Any, path: Path) -> Any:
        if not is_trainlab_checkpoint(obj):
            return obj
        if sharded.is_sharded_index(obj):  # `--fsdp`: the weights are read whole from the checkpoint's folder
            index = sharded.index_path(path)
            obj = sharded.read_whole(obj, sharded.check_folder(obj, index), keys=("models", "averaged"))
        found = averaged_weights(obj, model) if averaged else None
        if found is not None:
            log.info("%s: reading the averaged weights %r of its model %r", path, found[0], model)
            return found[1]
        return model_weights(obj, model, where=f"checkpoint {path}")

    return unwrap


def recipe_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """What `Recipe.state_dict()` returned when the checkpoint was written ({} when it records none)."""
    saved = state.get("recipe_state")
    return dict(saved) if isinstance(saved, Mapping) else {}


def stored_config(state: Mapping[str, Any], config_class: type, *, where: str = "checkpoint") -> dict[str, Any] | None:
    """The config a checkpoint records, with the settings renamed since it was written moved to their current names
    (`trainlab.config.upgrade_keys`, each with a warning); None when it records none."""
    saved = state.get("config")
    if not isinstance(saved, Mapping):
        return None
    return upgrade_keys(config_class, dict(saved), where)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bytes_of(obj: Any) -> int:
    """Bytes of the tensors in a (nested) checkpoint: about what `torch.save` must write."""
    if isinstance(obj, torch.Tensor):
        return 0 if obj.is_meta else obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(_bytes_of(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_bytes_of(v) for v in obj)
    return 0


def write_failure(err: BaseException, directory: Path, needed: int) -> str | None:
    """Why writing `needed` bytes into `directory` failed, when the cause is the disk rather than a bug, else None.

    `torch.save` reports a failed write of its zip container as a RuntimeError ("unexpected pos ...") whose
    context holds the OSError of the write; some paths lose that context. So: an OSError in the exception's chain
    (its errno names the cause: no space, quota, read-only, I/O error ...), else the free space of the file system
    measured now, against the bytes the save needed.
    """
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno)
        cause = cause.__cause__ or cause.__context__
    if not isinstance(err, RuntimeError):
        return None
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    if free < needed + (1 << 20):  # a zip container and file-system blocks take a little more than the tensors
        return f"No space left on device: {free:,} bytes free, the checkpoint needs about {needed:,}"
    if not os.access(directory, os.W_OK):
        return "the folder is not writable"
    return None


def atomic_save(obj: Any, path: Path, *, fix: str | None = None) -> None:
    """`torch.save` to a temp file in the same directory, fsync it, then `os.replace` onto `path`.

    Args:
        fix: the end of the error message (default: a checkpoint's: the previous one is intact, free disk space or
            pass another --run-dir).

    Raises:
        UsageError: the disk is full or not writable (the previous file at `path` is untouched).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise _write_error(path, os.strerror(err.errno) if err.errno else str(err), fix) from None
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
        _fsync_dir(path.parent)
    except BaseException as err:
        Path(tmp_name).unlink(missing_ok=True)
        reason = write_failure(err, path.parent, _bytes_of(obj)) if isinstance(err, Exception) else None
        if reason is not None:
            raise _write_error(path, reason, fix) from None
        raise


def _write_error(path: Path, reason: str, fix: str | None = None) -> UsageError:
    unwritable = any(words in reason for words in ("Read-only", "Permission denied", "not writable"))
    room = "make the folder writable" if unwritable else "free disk space"
    fix = fix or f"the previous checkpoint is intact: {room} or pass another --run-dir, then resume"
    return UsageError(f"could not write {path} ({reason[:160]}); {fix}")


def atomic_copy(src: Path, dst: Path) -> None:
    """Copy a finished checkpoint (e.g. last -> best) with the same temp + fsync + rename protocol.

    Raises:
        UsageError: the disk is full or not writable (the previous file at `dst` is untouched).
    """
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    except OSError as err:
        raise _write_error(dst, os.strerror(err.errno) if err.errno else str(err)) from None
    os.close(fd)
    try:
        shutil.copyfile(src, tmp_name)
        with open(tmp_name, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_name, dst)
        _fsync_dir(dst.parent)
    except BaseException as err:
        Path(tmp_name).unlink(missing_ok=True)
        reason = write_failure(err, dst.parent, src.stat().st_size) if isinstance(err, Exception) else None
        if reason is not None:
            raise _write_error(dst, reason) from None
        raise


def load_checkpoint(path: Path, *, mmap: bool = False, whole: bool = True) -> dict[str, Any]:
    """Read a checkpoint safely (`weights_only=True`; `mmap`: tensors memory-mapped, for reading a few fields).

    `path` is a checkpoint file, or a sharded checkpoint's folder (`--fsdp`: `engine.sharded_checkpoint`); a sharded
    one comes back with its tensors read whole into host memory (`whole`), or as its index (meta-device tensors of
    the saved shapes: the engine's resume reads the tensors into the live shards itself).

    Raises:
        UsageError: missing or unreadable file, not a trainlab checkpoint, or one written by a newer trainlab; a
            sharded checkpoint whose folder is missing or unfinished.
    """
    path = sharded.index_path(path)
    if not path.is_file():
        raise UsageError(
            f"checkpoint {path} {missing_file(path)}; pass an existing file (e.g. runs/<name>/ckpt/last.pt)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:
        raise UsageError(
            f"checkpoint {path} could not be read ({load_error_reason(err)}); pass a trainlab checkpoint"
        ) from None
    if not is_trainlab_checkpoint(state):
        raise UsageError(f"{path} is not a trainlab training checkpoint (no 'format' marker); pass ckpt/last.pt")
    version = state.get("version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise UsageError(
            f"checkpoint {path} has format version {version}, this trainlab reads up to {FORMAT_VERSION}; update "
            "trainlab to resume it"
        )
    if sharded.is_sharded_index(state):  # its index holds meta tensors of the saved shapes, by design
        folder = sharded.check_folder(state, path)
        return sharded.read_whole(state, folder) if whole else dict(state)
    refuse_hollow_tensors(state, f"checkpoint {path}", "resume from an earlier checkpoint of the run")
    return dict(state)


class NonFiniteWeightsError(TrainingStopped):
    """Weights or buffers hold NaN / inf: such a state is never saved over a finite checkpoint."""


NON_FINITE_BUFFERS_ATTR = "non_finite_buffers"
"""A module's class attribute naming its own buffers that hold -inf / inf by design (an attention mask's -inf):
`non_finite_weights` admits inf there (never NaN). Declared where the buffer is registered, never inferred."""


def declared_non_finite_buffers(model: nn.Module) -> set[str]:
    """Qualified names ("blocks.0.mask") of the buffers `model`'s modules declare as inf by design."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        for name in getattr(module, NON_FINITE_BUFFERS_ATTR, ()):
            names.add(f"{prefix}.{name}" if prefix else name)
    return names


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a `--fsdp` parameter (checked on every rank: no gather); any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def non_finite_weights(models: dict[str, nn.Module]) -> list[str]:
    """Names ("model.name") of floating parameters and buffers holding NaN or inf (a BatchNorm's running_var after a
    blow-up is as unusable as a weight). Buffers declared inf by design (`non_finite_buffers`) may hold inf, not NaN."""
    bad = []
    for model_name, model in models.items():
        by_design = declared_non_finite_buffers(model)
        for name, p in model.named_parameters():
            if p.is_floating_point() and not bool(_local(p.detach()).isfinite().all()):
                bad.append(f"{model_name}.{name}")
        for name, b in model.named_buffers():
            if not b.is_floating_point():
                continue
            broken = b.isnan().any() if name in by_design else ~b.isfinite().all()
            if bool(broken):
                bad.append(f"{model_name}.{name}")
    return bad


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class CheckpointStore:
    """A run's `ckpt/`: `last.pt`, `best.pt` and the last `keep` saves as `step_<step>.pt`; under `--fsdp` each of
    them is the index of a sharded checkpoint's folder `step_<step>.dcp/` (`engine.sharded_checkpoint`)."""

    def __init__(self, directory: Path, keep: int = 2) -> None:
        self.directory, self.keep = directory, keep
        self.last, self.best = directory / "last.pt", directory / "best.pt"

    def history(self) -> list[Path]:
        """The kept saves, oldest first."""
        return sorted(self.directory.glob("step_*.pt"))

    def candidates(self) -> list[Path]:
        """The files a resume tries, in order: `last.pt`, then the kept saves newest first (those that exist)."""
        return [path for path in [self.last, *reversed(self.history())] if path.is_file()]

    def exists(self) -> bool:
        """Whether there is anything to resume from."""
        return self.last.is_file() or bool(self.history())

    def clean_temp_files(self) -> int:
        """Remove temp files and folders of saves that were killed mid-write, and sharded checkpoints' folders no
        checkpoint file points at (a save killed between the folder's rename and the commit); returns how many."""
        stale = list(self.directory.glob(".*.tmp")) if self.directory.is_dir() else []
        for path in stale:
            _remove(path)
        orphans = self._unreferenced_folders()
        for path in orphans:
            _remove(path)
        if stale or orphans:
            log.warning(
                "removed %d temp file(s) or folder(s) of interrupted checkpoint writes in %s",
                len(stale) + len(orphans),
                self.directory,
            )
        return len(stale) + len(orphans)

    def clear(self) -> None:
        """Delete every checkpoint (--overwrite)."""
        for path in [self.last, self.best, *self.history(), *self._folders()]:
            _remove(path)

    def save(self, state: dict[str, Any], *, is_best: bool) -> None:
        """Write `last.pt` (the commit point), link it as `step_<step>.pt`, prune old steps (and the folders of
        sharded checkpoints no file points at any more), copy to `best.pt`."""
        atomic_save(state, self.last)
        if self.keep > 1:
            self._link(self.last, self.directory / f"step_{int(state['step']):09d}.pt")
            for old in self.history()[: -self.keep]:
                old.unlink(missing_ok=True)
        if is_best:
            atomic_copy(self.last, self.best)
        for unused in self._unreferenced_folders():
            _remove(unused)

    # ------------------------------------------------------------------- sharded checkpoints (--fsdp)
    def temp_folder(self, step: int) -> Path:
        """Where every rank writes a sharded checkpoint's shards before `commit_folder` (a fresh, empty folder: call
        `prepare_temp_folder` on rank 0 first)."""
        return self.directory / f".step_{step:09d}{sharded.SUFFIX}.tmp"

    def prepare_temp_folder(self, folder: Path) -> None:
        """Rank 0: an empty `folder` (what a failed write left there is removed)."""
        _remove(folder)
        try:
            folder.mkdir(parents=True)
        except OSError as err:
            raise _write_error(folder, os.strerror(err.errno) if err.errno else str(err)) from None

    def commit_folder(self, folder: Path, index: dict[str, Any], *, is_best: bool) -> Path:
        """Rank 0, once every rank's shards are in `folder`: the index into the folder, the folder renamed to its
        step's name, then `save` of the index pointing at it (the commit point). Returns the folder's new path."""
        atomic_save({**index, sharded.SHARDS: "."}, folder / sharded.INDEX)
        step = int(index["step"])
        final = self.directory / f"step_{step:09d}{sharded.SUFFIX}"
        repeat = 1
        while final.exists():  # the same step saved again (before and after its evaluation): a new name
            repeat += 1
            final = self.directory / f"step_{step:09d}-{repeat}{sharded.SUFFIX}"
        os.replace(folder, final)
        _fsync_dir(self.directory)
        self.save({**index, sharded.SHARDS: final.name}, is_best=is_best)
        return final

    def _folders(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return [path for path in self.directory.glob(f"step_*{sharded.SUFFIX}") if path.is_dir()]

    def _unreferenced_folders(self) -> list[Path]:
        """Sharded checkpoints' folders that no checkpoint file (last, best, kept steps) points at; none while a
        checkpoint file cannot be read (the folder it pointed at may be the one to keep: it holds its own index)."""
        folders = self._folders()
        if not folders:
            return []
        used: set[str] = set()
        for path in [self.last, self.best, *self.history()]:
            if not path.is_file():
                continue
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception:
                return []
            if isinstance(state, Mapping) and sharded.is_sharded_index(state):
                used.add(str(state[sharded.SHARDS]))
        return [path for path in folders if path.name not in used]

    def _link(self, src: Path, dst: Path) -> None:
        tmp = dst.with_name(f".{dst.name}.link.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except OSError:  # no hard links on this file system: a copy
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)

    def load_latest(self, check: Callable[[dict[str, Any], Path], None] | None = None) -> tuple[dict[str, Any], Path]:
        """The newest readable checkpoint (a sharded one as its index: `load_checkpoint(whole=False)`): `last.pt`,
        else the kept saves newest first (with a warning). `check`
        (raising UsageError) tells a damaged one, which is skipped like an unreadable one.

        Raises:
            UsageError: nothing readable.
        """
        errors = []
        for path in self.candidates():
            try:
                state = load_checkpoint(path, whole=False)
                if check is not None:
                    check(state, path)
            except UsageError as err:
                errors.append(str(err))
                log.warning("%s is unreadable or damaged (%s); trying an older checkpoint", path, str(err)[:200])
                continue
            if path != self.last:
                log.warning("resuming from the fallback %s (last.pt was unreadable or damaged)", path)
            return state, path
        raise UsageError(f"no readable checkpoint in {self.directory} ({errors[0] if errors else 'none found'})")

    def repair_best(self, state: dict[str, Any], source: Path) -> None:
        """A kill between the `last.pt` rename and the `best.pt` copy leaves `best.pt` behind: copy it again."""
        if state.get("best_step") != state["step"]:
            return
        if self.best.is_file():
            try:
                best_step = torch.load(self.best, map_location="cpu", weights_only=True, mmap=True).get("step")
            except Exception:
                best_step = None
            if best_step == state["step"]:
                return
        log.warning("best.pt is behind the best step %d recorded in %s: restoring it", state["step"], source.name)
        atomic_copy(source, self.best)
