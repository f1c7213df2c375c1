"""The training loader's options (`--pin-memory`, `--persistent-workers`, `--prefetch-factor`): each `auto` decided
for the device, impossible requests refused in one line, the engine's loader built with them, and the same batches
with persistent workers across epochs and a resume."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from trainlab.cli import main
from trainlab.data.loader_options import LoaderOptions, resolve_loader_options
from trainlab.engine.debug import debug_run_config
from trainlab.engine.loop import Trainer
from trainlab.errors import UsageError
from trainlab.recipes.moco import MocoConfig, MocoRecipe


def _resolve(**kw: object) -> LoaderOptions:
    args: dict[str, object] = dict(
        num_workers=0, pin_memory="auto", persistent_workers="auto", prefetch_factor=2, device_type="cpu"
    )
    return resolve_loader_options(**{**args, **kw})  # type: ignore[arg-type]


def test_auto_pins_on_cuda_only_and_keeps_workers_when_there_are_some() -> None:
    assert _resolve() == LoaderOptions(num_workers=0, pin_memory=False, persistent_workers=False, prefetch_factor=None)
    assert _resolve(device_type="cuda").pin_memory
    assert not _resolve(device_type=None).pin_memory  # --device auto before it is resolved
    assert not _resolve(device_type="cuda", pin_memory="off").pin_memory
    workers = _resolve(num_workers=3, prefetch_factor=4)
    assert workers == LoaderOptions(num_workers=3, pin_memory=False, persistent_workers=True, prefetch_factor=4)
    assert not _resolve(num_workers=3, persistent_workers="off").persistent_workers


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"pin_memory": "on"}, "--pin-memory on needs a CUDA device"),
        ({"persistent_workers": "on"}, "--persistent-workers on needs loader workers"),
        ({"prefetch_factor": 4}, "--prefetch-factor 4 needs loader workers"),
    ],
)
def test_impossible_requests_are_refused(kw: dict[str, object], words: str) -> None:
    with pytest.raises(UsageError, match=words):
        _resolve(**kw)


def test_cli_refuses_pinned_memory_on_the_cpu_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "toy", "--device", "cpu", "--pin-memory", "on", "--run-dir", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--pin-memory on needs a CUDA device (the run is on cpu); use auto or off")


def _config(run_dir: Path, **kw: object) -> MocoConfig:
    cfg = debug_run_config(MocoRecipe(MocoConfig()))  # digits, 128 images, batch 16: 8 steps per epoch
    return dataclasses.replace(cfg, run_dir=run_dir, tensorboard=False, progress=False, **kw)  # type: ignore[arg-type]


def test_the_engine_loader_gets_the_options(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="trainlab.engine.loop"):
        trainer = Trainer(MocoRecipe(_config(tmp_path, num_workers=2, prefetch_factor=3)))
    wanted = "training loader: 2 workers (persistent, 3 batches ahead each), pinned memory off"
    assert wanted in caplog.messages
    assert trainer.loader.num_workers == 2
    assert trainer.loader.persistent_workers
    assert trainer.loader.prefetch_factor == 3
    assert not trainer.loader.pin_memory  # the CPU
    trainer.close()
    off = Trainer(MocoRecipe(_config(tmp_path / "off", num_workers=2, persistent_workers="off")))
    assert not off.loader.persistent_workers
    off.close()


def test_persistent_workers_see_every_epoch_and_resume(tmp_path: Path) -> None:
    """Two-view draws are a function of (seed, epoch, index): persistent workers crossing an epoch end, then a resume
    in the second epoch, give the losses of a run without workers."""
    straight = Trainer(MocoRecipe(_config(tmp_path / "a", epochs=2))).fit().losses
    first = Trainer(MocoRecipe(_config(tmp_path / "b", epochs=2, num_workers=2, persistent_workers="on")))
    assert first.loader.persistent_workers
    part1 = first.fit(stop_at_step=11).losses  # epoch 0's 8 steps, then 3 of epoch 1, the same workers
    second = Trainer(MocoRecipe(_config(tmp_path / "b", epochs=2, num_workers=2, prefetch_factor=1)))
    part2 = second.fit().losses
    assert len(straight) == 16
    assert part1 + part2 == straight
