"""How the Trainer's checkpoints reach the disk: one whole file written by rank 0, or (`--fsdp`) a sharded folder
every rank writes its shards into (`engine.sharded_checkpoint`); now, or in the background (`--async-checkpoint`).

Every form keeps `CheckpointStore`'s guarantees: the files go to temporary names and `last.pt` is replaced last (the
commit point), so a save killed at any moment leaves the previous checkpoint loadable.

In the background: the state is copied to host memory before `write` returns (the next step may change the weights
at once); the files are written by a thread, which commits the checkpoint when every rank's part is on disk. The
next `write` (and the end of the run, `wait`) first waits for the previous one, and a failure of it (a full disk)
stops the run there, on every rank. A kill while a background save is under way loses that save only: every
checkpoint committed before it stays.
"""

# Legend: none (state dicts; no tensor is named by shape here).

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from trainlab import dist
from trainlab.engine import sharded_checkpoint as sharded
from trainlab.engine.checkpoint import CheckpointStore, write_failure
from trainlab.errors import UsageError

log = logging.getLogger(__name__)


class CheckpointWriter:
    """Writes the Trainer's checkpoints into `store` (collective: every rank calls `write` and `wait` at the same
    points).

    Args:
        store: the run's `ckpt/`.
        sharded: a sharded folder per save (every rank writes its shards) instead of one whole file (rank 0).
        background: write in a background thread (`--async-checkpoint`).
    """

    def __init__(self, store: CheckpointStore, *, sharded: bool, background: bool) -> None:
        self.store = store
        self.sharded = sharded
        self.background = background
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[Any] | None = None

    def describe(self) -> str:
        form = "a sharded folder per save (every process writes its shards)" if self.sharded else "one whole file"
        return f"checkpoints: {form}, {'written in the background' if self.background else 'written in the step'}"

    def write(self, state: dict[str, Any], *, is_best: bool) -> None:
        """Save `state` (`engine.resume.training_state`: whole tensors on rank 0, or each rank's live shards when
        `sharded`). In the background: after the previous save finished."""
        self.wait()
        if self.sharded:
            self._write_sharded(state, is_best)
        elif self.background:
            staged = _host_copy(state) if dist.is_main() else None
            self._start(lambda: self._commit_file(staged, is_best) if staged is not None else None)
        else:
            dist.raise_together(lambda: self._commit_file(state, is_best) if dist.is_main() else None)

    def wait(self) -> None:
        """Wait for the save under way in the background (collective); its failure stops every rank here."""
        if not self.background:
            return
        pending, self._pending = self._pending, None
        dist.raise_together(lambda: pending.result() if pending is not None else None)

    def close(self) -> None:
        """After a failure: wait (this rank only) for a background save that was already under way, so that a
        checkpoint complete on disk is committed before the process exits; its own failure is logged."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except Exception as err:  # the run is already failing: say why this save did not land
                log.error("the checkpoint being written in the background did not complete: %s", err)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------------------------------- the forms
    def _start(self, work: Callable[[], Any]) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending = self._executor.submit(work)

    def _commit_file(self, state: dict[str, Any], is_best: bool) -> None:
        self.store.save(state, is_best=is_best)
        log.info("saved %s (step %d%s)", self.store.last, state["step"], _best(is_best))

    def _write_sharded(self, state: dict[str, Any], is_best: bool) -> None:
        folder = self.store.temp_folder(int(state["step"]))
        dist.raise_together(lambda: self.store.prepare_temp_folder(folder) if dist.is_main() else None)
        tensors, index = sharded.split(state)
        needed = sharded.local_bytes(tensors)

        def commit() -> None:
            if dist.is_main():
                final = self.store.commit_folder(folder, index, is_best=is_best)
                log.info("saved %s -> %s (step %d%s)", self.store.last, final.name, index["step"], _best(is_best))

        if self.background:
            written = sharded.write_in_background(tensors, folder, dist.background_group())

            def finish() -> None:
                _translated(written.result, folder, needed)
                commit()

            self._start(finish)
            return
        group = dist.side_group()
        dist.raise_together(lambda: _translated(lambda: sharded.write(tensors, folder, group), folder, needed))
        dist.raise_together(commit)


def _best(is_best: bool) -> str:
    return ", best" if is_best else ""


def _translated(work: Callable[[], Any], folder: Path, needed: int) -> Any:
    """`work` (a sharded write), its failure for want of disk space or permission as the one-line `UsageError`."""
    try:
        return work()
    except sharded.READ_ERRORS as err:
        failure = sharded.failure_of(err)
        reason = write_failure(failure, folder.parent, needed) if isinstance(failure, Exception) else None
        if reason is None:
            raise
        raise UsageError(
            f"could not write the checkpoint folder {folder} ({reason[:160]}); the previous checkpoint is intact: free "
            "disk space or pass another --run-dir, then resume"
        ) from None


def _host_copy(obj: Any) -> Any:
    """A copy of a (nested) state with every tensor copied into host memory: what a background write may read
    while the training step changes the live tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: _host_copy(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_host_copy(value) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_host_copy(value) for value in obj)
    return obj
