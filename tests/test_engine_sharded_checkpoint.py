"""Sharded checkpoints (`--fsdp`: a DCP folder per save plus its index, `engine/sharded_checkpoint.py`) and
background saves (`--async-checkpoint`, `engine/checkpoint_writer.py`), in one process: what they hold equals the
whole-file checkpoint of the same run bit for bit, they resume to the bit (sharded or not), a save killed at any
point leaves the previous checkpoint loadable, and `sample` / `eval` / `--init-from` read a folder as well as a file.
The 2-process forms (resharding, async under torchrun, chaos) are in tests/test_engine_fsdp.py."""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from trainlab.engine import sharded_checkpoint as sharded
from trainlab.engine.checkpoint import CheckpointStore, load_checkpoint, weights_in_checkpoint
from trainlab.engine.checkpoint_writer import CheckpointWriter
from trainlab.engine.loop import Trainer
from trainlab.errors import UsageError
from trainlab.recipes.toy import ToyConfig, ToyRecipe
from trainlab.user_files import load_user_file


class Killed(BaseException):
    """Stands for a SIGKILL at the patched point: nothing after it runs."""


def _config(run_dir: Path, **overrides: Any) -> ToyConfig:
    base = ToyConfig(
        run_dir=run_dir, num_samples=64, batch_size=16, epochs=3, tensorboard=False, progress=False, fsdp=True
    )
    return dataclasses.replace(base, **overrides)


def _fit(config: ToyConfig, stop_at_step: int | None = None) -> list[float]:
    return Trainer(ToyRecipe(config)).fit(stop_at_step=stop_at_step).losses


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of the entries a sharded checkpoint keeps in its folder, by path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _tensors(value, f"{prefix}/{key}").items()}
    return {}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    ta = _tensors({key: a[key] for key in sharded.SHARDED_KEYS})
    tb = _tensors({key: b[key] for key in sharded.SHARDED_KEYS})
    assert ta.keys() == tb.keys() and ta
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key
    for key in ("step", "epoch", "step_in_epoch", "best_step", "best_score", "recipe_state", "schedulers"):
        assert a[key] == b[key], key


def test_a_sharded_checkpoint_holds_what_the_whole_file_holds(tmp_path: Path) -> None:
    """The folder + index of a `--fsdp` run (one process: nothing sharded) read back equal the whole file of the
    same run without `--fsdp`, tensor for tensor; the index holds no tensor data, only shapes and dtypes."""
    _fit(_config(tmp_path / "whole", fsdp=False))
    _fit(_config(tmp_path / "sharded"))
    ckpt = tmp_path / "sharded" / "ckpt"
    index = torch.load(ckpt / "last.pt", weights_only=True)
    assert sharded.is_sharded_index(index) and (ckpt / index[sharded.SHARDS] / ".metadata").is_file()
    assert all(t.is_meta for t in _tensors({key: index[key] for key in sharded.SHARDED_KEYS}).values())
    whole = load_checkpoint(tmp_path / "whole" / "ckpt" / "last.pt")
    _same(load_checkpoint(ckpt / "last.pt"), whole)
    _same(load_checkpoint(ckpt / index[sharded.SHARDS]), whole)  # the folder alone is a checkpoint
    # the kept saves each point at their own folder; best.pt at the folder of its step
    kept = {p.name: torch.load(p, weights_only=True)[sharded.SHARDS] for p in ckpt.glob("*.pt")}
    assert sorted(p.name for p in ckpt.glob("*.dcp")) == sorted(set(kept.values()))


def test_sharded_checkpoints_resume_to_the_bit_with_or_without_fsdp(tmp_path: Path) -> None:
    """Stopped at step 5 and resumed: with --fsdp, without it, and from the folder alone (`--resume FOLDER` in a new
    run directory): the losses of the uninterrupted run, and its final checkpoint."""
    straight = _fit(_config(tmp_path / "straight"))
    _fit(_config(tmp_path / "split"), stop_at_step=5)
    ckpt = tmp_path / "split" / "ckpt"
    folder = ckpt / torch.load(ckpt / "last.pt", weights_only=True)[sharded.SHARDS]
    shutil.copytree(folder, tmp_path / "step5.dcp")
    assert _fit(_config(tmp_path / "split")) == straight[5:]
    _fit(_config(tmp_path / "cross"), stop_at_step=5)
    assert _fit(_config(tmp_path / "cross", fsdp=False)) == straight[5:]
    assert _fit(_config(tmp_path / "moved", resume=str(tmp_path / "step5.dcp"))) == straight[5:]
    final = load_checkpoint(tmp_path / "straight" / "ckpt" / "last.pt")
    for name in ("split", "cross", "moved"):
        _same(load_checkpoint(tmp_path / name / "ckpt" / "last.pt"), final)


@pytest.mark.parametrize("fsdp", [True, False], ids=["sharded", "whole-file"])
def test_background_saves_equal_saves_in_the_step(tmp_path: Path, fsdp: bool) -> None:
    """`--async-checkpoint`: the same checkpoint on disk as saving in the step, and it resumes to the bit."""
    straight = _fit(_config(tmp_path / "sync", fsdp=fsdp))
    assert _fit(_config(tmp_path / "async", fsdp=fsdp, async_checkpoint=True), stop_at_step=5) == straight[:5]
    assert _fit(_config(tmp_path / "async", fsdp=fsdp, async_checkpoint=True)) == straight[5:]
    ours, ref = (load_checkpoint(tmp_path / name / "ckpt" / "last.pt") for name in ("async", "sync"))
    _same(ours, ref)


@pytest.mark.parametrize("fsdp", [True, False], ids=["sharded", "whole-file"])
def test_a_background_save_writes_the_state_of_its_step(tmp_path: Path, fsdp: bool) -> None:
    """The weights change right after `write` returns (the next step): the checkpoint holds the values of the
    moment it was asked for (copied to host memory first)."""
    store = CheckpointStore(tmp_path)
    writer = CheckpointWriter(store, sharded=fsdp, background=True)
    weight = torch.arange(6.0).reshape(2, 3)
    state = {"format": "trainlab-checkpoint", "version": 2, "step": 1, "models": {"m": {"w": weight}}}
    writer.write(state, is_best=False)
    weight.add_(100.0)
    writer.wait()
    writer.close()
    saved = load_checkpoint(store.last)["models"]["m"]["w"]
    assert torch.equal(saved, torch.arange(6.0).reshape(2, 3))


def test_a_save_killed_while_the_shards_are_written_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight = _fit(_config(tmp_path / "straight"))
    run = tmp_path / "killed"
    _fit(_config(run), stop_at_step=5)
    ckpt = run / "ckpt"

    write = sharded.write

    def killed(tensors: dict[str, Any], folder: Path, group: Any) -> None:  # the shards written, not .metadata
        write(tensors, folder, group)
        (folder / ".metadata").unlink()
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(sharded, "write", killed)
        with pytest.raises(Killed):
            _fit(_config(run))
    assert list(ckpt.glob(".step_*.dcp.tmp"))  # the unfinished folder is there
    assert load_checkpoint(ckpt / "last.pt")["step"] == 5
    assert _fit(_config(run)) == straight[5:]  # its start removed the unfinished folder
    assert not list(ckpt.glob(".*.tmp"))


def test_a_save_killed_before_its_commit_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the finished folder got its name, before `last.pt` points at it: the folder is an orphan,
    removed by the next start; the run resumes from the previous checkpoint."""
    straight = _fit(_config(tmp_path / "straight"))
    run = tmp_path / "killed"
    _fit(_config(run), stop_at_step=5)
    ckpt = run / "ckpt"

    def killed(self: CheckpointStore, state: dict[str, Any], *, is_best: bool) -> None:
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(CheckpointStore, "save", killed)
        with pytest.raises(Killed):
            _fit(_config(run))
    referenced = torch.load(ckpt / "last.pt", weights_only=True)[sharded.SHARDS]
    orphans = [p for p in ckpt.glob("step_*.dcp") if p.name != referenced and p.name != "step_000000004-2.dcp"]
    assert orphans
    assert load_checkpoint(ckpt / "last.pt")["step"] == 5
    assert _fit(_config(run)) == straight[5:]
    assert not any(p.exists() for p in orphans)


def test_a_missing_folder_falls_back_to_an_older_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fit(_config(run, epochs=2))
    ckpt = run / "ckpt"
    newest = ckpt / torch.load(ckpt / "last.pt", weights_only=True)[sharded.SHARDS]
    for path in newest.iterdir():
        path.unlink()
    newest.rmdir()
    with pytest.raises(UsageError, match=r"keeps its tensors in .*missing or unfinished") as excinfo:
        load_checkpoint(ckpt / "last.pt")
    assert "\n" not in str(excinfo.value)
    state, path = CheckpointStore(ckpt).load_latest()
    assert path.name.startswith("step_") and state["step"] < 8


def test_weight_readers_take_the_folder_or_its_index(tmp_path: Path) -> None:
    """What `trainlab sample` / `eval` / `--init-from` read a trainlab run's weights with: the index file and the
    folder itself give the whole weights of the model."""
    _fit(_config(tmp_path / "run", epochs=1))
    ckpt = tmp_path / "run" / "ckpt"
    folder = ckpt / torch.load(ckpt / "last.pt", weights_only=True)[sharded.SHARDS]
    expected = load_checkpoint(ckpt / "last.pt")["models"]["model"]
    unwrap = weights_in_checkpoint("model")
    for path in (ckpt / "last.pt", folder):
        weights = unwrap(load_user_file(path, "checkpoint", fix="pass a checkpoint"), path)
        assert weights.keys() == expected.keys()
        assert all(torch.equal(weights[k], expected[k]) and not weights[k].is_meta for k in expected)
    with pytest.raises(UsageError, match="is a directory, not a file"):
        load_user_file(tmp_path, "checkpoint", fix="pass a checkpoint")


class _RunsCode:
    """A pickle that runs code when loaded (here: creates a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_a_folder_whose_metadata_runs_code_is_refused(tmp_path: Path) -> None:
    """DCP reads `.metadata` with `pickle.load`: a hostile folder must not run code, and an entry declared as a
    Python object (which DCP would `torch.load(weights_only=False)`) is refused."""
    _fit(_config(tmp_path / "run", epochs=1))
    ckpt = tmp_path / "run" / "ckpt"
    folder = ckpt / torch.load(ckpt / "last.pt", weights_only=True)[sharded.SHARDS]
    marker = tmp_path / "code-ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    for path in (ckpt / "last.pt", folder):
        with pytest.raises(UsageError, match="is not part of a checkpoint's metadata") as excinfo:
            load_checkpoint(path)
        assert "\n" not in str(excinfo.value)
    with pytest.raises(UsageError, match="is not part of a checkpoint's metadata"):
        weights_in_checkpoint("model")(load_user_file(folder, "checkpoint", fix="pass a checkpoint"), folder)
    with pytest.raises(UsageError, match=r"no readable checkpoint .*is not part of a checkpoint's metadata"):
        _fit(_config(tmp_path / "run", epochs=2))
    assert not marker.exists()


def test_an_entry_stored_as_a_python_object_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    folder = store.temp_folder(1)
    store.prepare_temp_folder(folder)
    state = {"format": "trainlab-checkpoint", "version": 2, "step": 1, "models": {"m": {"w": torch.ones(2)}}}
    tensors, index = sharded.split(state)
    tensors["models"]["m"]["w"] = {"not": "a tensor"}  # DCP stores a non-tensor value as pickled bytes
    sharded.write(tensors, folder, None)
    store.commit_folder(folder, index, is_best=False)
    with pytest.raises(UsageError, match="stored as a Python object, not a tensor"):
        load_checkpoint(store.last)


@pytest.mark.parametrize("background", [False, True], ids=["in-step", "background"])
def test_a_real_write_failure_of_the_shards_is_one_line(tmp_path: Path, background: bool) -> None:
    """A file-size limit makes the kernel fail DCP's write (EFBIG), as a full disk does: one line, the previous
    checkpoint intact."""
    code = (
        "import resource, signal, sys, torch; from pathlib import Path\n"
        "from trainlab.engine.checkpoint import CheckpointStore\n"
        "from trainlab.engine.checkpoint_writer import CheckpointWriter\n"
        "from trainlab.errors import UsageError\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "writer = CheckpointWriter(CheckpointStore(Path(sys.argv[1])), sharded=True, background=sys.argv[2] == '1')\n"
        "def state(step, n):\n"
        "    weights = {'m': {'w': torch.ones(n)}}\n"
        "    return {'format': 'trainlab-checkpoint', 'version': 2, 'step': step, 'models': weights}\n"
        "writer.write(state(1, 4), is_best=False); writer.wait()\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
        "try:\n    writer.write(state(2, 100_000), is_best=False); writer.wait()\n"
        "except UsageError as err:\n    print(err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), "1" if background else "0"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "File too large); the previous checkpoint is intact" in out.stdout, out.stdout + out.stderr[-2000:]
    state = load_checkpoint(tmp_path / "last.pt")
    assert state["step"] == 1 and torch.equal(state["models"]["m"]["w"], torch.ones(4))
