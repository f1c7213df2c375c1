"""No lost work, honest resume rules, one error boundary per command (single process; torchrun cases live in
test_engine_distributed.py).

Relaunch: --overwrite never contradicts --resume silently, a run dir is one recipe's. Resume: the learning rate and
the other settings a diverged run changes are applied, evaluation-only settings may change, another dataset size,
a config-less or a damaged checkpoint are one line. Checkpoints never hold NaN / inf except declared buffers. The
lock comes before any build. OS errors and running out of memory are one line for every command.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from conftest import with_fields
from torch import nn

from trainlab import cli
from trainlab.cli import main
from trainlab.config import to_dict
from trainlab.engine.checkpoint import atomic_save, load_checkpoint, non_finite_weights
from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import Phase, StepInfo, TrainParts
from trainlab.engine.resume import check_config, flatten, may_change
from trainlab.errors import TrainingStopped, UsageError
from trainlab.recipes import get_recipe, list_recipes
from trainlab.recipes.toy import ToyConfig, ToyRecipe


def _config(run_dir: Path, **overrides: Any) -> ToyConfig:
    """The small toy run, with fields changed (`optim.learning_rate`: a field of the optimizer group)."""
    base = ToyConfig(
        run_dir=run_dir, num_samples=64, batch_size=16, epochs=2, log_every=1, tensorboard=False, progress=False
    )
    return with_fields(base, overrides)


def _train_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 2) -> str:
    """Run the CLI in-process: exit `code`, exactly one stderr line without a traceback, starting with the prefix."""
    assert main(argv) == code
    err = [line for line in capsys.readouterr().err.strip().splitlines() if " I trainlab" not in line]
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"trainlab {argv[0]}: error: "), err[0]
    return err[0]


# ------------------------------------------------------------------------------------------------ relaunch
def test_overwrite_with_resume_path_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    Trainer(ToyRecipe(_config(tmp_path, max_steps=4, checkpoint_every=2))).fit()
    named = tmp_path / "ckpt" / "step_000000002.pt"
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    elsewhere = tmp_path.parent / f"{tmp_path.name}-copy.pt"
    elsewhere.write_bytes(named.read_bytes())
    for resume in (str(named), str(elsewhere), "never"):
        with pytest.raises(UsageError, match=rf"--overwrite .* contradicts --resume {resume} .*pass only one"):
            Trainer(ToyRecipe(_config(tmp_path, overwrite=True, resume=resume)))
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before


def _foreign_run_dir(run_dir: Path, recipe: str | None) -> None:
    """What another recipe's run leaves behind once its ckpt/ was moved away: config.yaml and logs."""
    run_dir.mkdir(parents=True)
    header = f"# recipe: {recipe}\n# command: trainlab train {recipe}\n" if recipe else ""
    (run_dir / "config.yaml").write_text(header + "epochs: 5\n")
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n' * 90)
    (run_dir / "tb").mkdir()
    (run_dir / "tb" / "events.out.tfevents.1").write_bytes(b"x")


def test_a_run_dir_of_another_recipe_is_refused_without_overwrite(tmp_path: Path) -> None:
    run_dir = tmp_path / "var-run"
    _foreign_run_dir(run_dir, "var")
    with pytest.raises(UsageError, match=r"holds a 'var' run .* not 'toy'.*--overwrite"):
        Trainer(ToyRecipe(_config(run_dir, max_steps=2)))
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 90
    assert (run_dir / "tb" / "events.out.tfevents.1").exists()
    assert "# recipe: var" in (run_dir / "config.yaml").read_text()
    assert Trainer(ToyRecipe(_config(run_dir, max_steps=2, overwrite=True))).fit().step == 2  # said explicitly
    assert len(_train_rows(run_dir)) == 2 and "# recipe: toy" in (run_dir / "config.yaml").read_text()


def test_logs_without_a_recipe_record_are_refused(tmp_path: Path) -> None:
    _foreign_run_dir(tmp_path / "run", None)
    (tmp_path / "run" / "config.yaml").unlink()
    with pytest.raises(UsageError, match=r"holds logs \(metrics.jsonl\) but no config.yaml"):
        Trainer(ToyRecipe(_config(tmp_path / "run")))


def test_the_same_recipe_without_a_checkpoint_replaces_its_own_logs(tmp_path: Path) -> None:
    _foreign_run_dir(tmp_path / "run", "toy")
    assert Trainer(ToyRecipe(_config(tmp_path / "run", max_steps=3))).fit().step == 3
    assert [r["step"] for r in _train_rows(tmp_path / "run")] == [1, 2, 3]


# ------------------------------------------------------------------------------------------------- resume
class _DivergesAboveOne(ToyRecipe):
    """A NaN loss whenever the learning rate is above 1 (what a too high learning rate does, without the wait)."""

    def train_step(self, models: Mapping[str, nn.Module], batch: Any, phase: str, info: StepInfo) -> dict[str, Any]:
        out = super().train_step(models, batch, phase, info)
        return {**out, "loss": out["loss"] * math.nan} if self.config.optim.learning_rate > 1 else out


def test_a_diverged_run_resumes_with_a_lower_learning_rate_as_the_message_says(tmp_path: Path, caplog: Any) -> None:
    constant = dataclasses.replace(ToyConfig().schedule, kind="constant")
    Trainer(_DivergesAboveOne(_config(tmp_path, max_steps=4, schedule=constant))).fit()
    with pytest.raises(TrainingStopped, match=r"diverged at step 5 .*lower the learning rate"):
        Trainer(_DivergesAboveOne(_config(tmp_path, **{"optim.learning_rate": 5.0, "schedule": constant}))).fit()
    assert load_checkpoint(tmp_path / "ckpt" / "last.pt")["step"] == 4  # the last good checkpoint
    with caplog.at_level("INFO"):
        result = Trainer(
            _DivergesAboveOne(_config(tmp_path, **{"optim.learning_rate": 0.05, "schedule": constant}))
        ).fit()
    assert result.step == 8 and "optim.learning_rate 0.1 -> 0.05" in caplog.text
    rows = _train_rows(tmp_path)
    assert [r["lr"] for r in rows if r["step"] > 4] == [0.05] * 4  # applied from the checkpoint's step on
    assert [r["lr"] for r in rows if r["step"] <= 4] == [0.1] * 4


def test_the_resumed_random_state_is_restored_when_fit_starts(tmp_path: Path) -> None:
    """The checks and the load happen when the Trainer is built; random numbers drawn before fit (the demo trains
    its judge there) must not shift the resumed run's dropout draws."""
    straight = Trainer(ToyRecipe(_config(tmp_path / "a", dropout=0.3))).fit().losses
    Trainer(ToyRecipe(_config(tmp_path / "b", dropout=0.3))).fit(stop_at_step=3)
    second = Trainer(ToyRecipe(_config(tmp_path / "b", dropout=0.3)))
    torch.rand(100)
    assert straight[3:] == second.fit().losses


@pytest.mark.parametrize("name", list_recipes())
def test_every_learning_rate_clipping_and_loss_scale_may_change_and_nothing_else_by_accident(name: str) -> None:
    recipe_cls = get_recipe(name)
    fields = set(flatten(to_dict(recipe_cls.config_class()))) | {
        f.name for f in dataclasses.fields(recipe_cls.config_class)
    }
    assert set(recipe_cls.resume_may_change) <= fields, "resume_may_change names a field the config does not have"
    fixed = ("seed", "epochs", "batch_size", "precision", "grad_accumulation", "schedule", "optim.weight_decay")
    for field in fields:
        changeable = may_change(field, recipe_cls.resume_may_change)
        if field.endswith("learning_rate") or field in ("clip_grad_norm", "static_loss_scale", "max_skipped_steps"):
            assert changeable, field
        if field in fixed or field.startswith("schedule."):
            assert not changeable, field


def test_evaluation_only_settings_may_change() -> None:
    moco = get_recipe("moco").resume_may_change
    assert {"knn_k", "knn_temperature", "data.eval_limit", "eval_batch_size"} <= set(moco)
    assert {"eval_batch_size", "inception_weights"} <= set(get_recipe("tokenizer").resume_may_change)
    assert {"eval_batch_size", "data.eval_limit"} <= set(get_recipe("var").resume_may_change)


def test_a_config_less_checkpoint_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path)
    for saved in (None, {}, {"foo": 1}, "learning_rate: 0.5"):
        with pytest.raises(UsageError, match="records no config"):
            check_config(saved, config, tmp_path / "x.pt", ())
    older = {k: v for k, v in to_dict(config).items() if k != "dropout"}  # a field the writing version did not have
    assert check_config(older, config, tmp_path / "x.pt", ()) == []
    with pytest.raises(UsageError, match=r"does not record dropout .* default --dropout 0.0"):
        check_config(older, dataclasses.replace(config, dropout=0.3), tmp_path / "x.pt", ())


class _MovableData(ToyRecipe):
    """A toy recipe whose data may move (like --data-root): the dataset size is what the check sees."""

    resume_may_change = ("step_sleep_seconds", "num_samples")


def test_another_dataset_size_is_refused_naming_both_sizes(tmp_path: Path) -> None:
    Trainer(_MovableData(_config(tmp_path, max_steps=2))).fit()
    with pytest.raises(UsageError, match=r"dataset of 64 samples \(4 steps per epoch\) .* has 256 samples \(16 steps"):
        Trainer(_MovableData(_config(tmp_path, num_samples=256)))
    state = load_checkpoint(tmp_path / "ckpt" / "last.pt")
    del state["data"]  # written before checkpoints recorded their data: the schedule's horizon tells
    torch.save(state, tmp_path / "old.pt")
    with pytest.raises(UsageError, match=r"schedule of 8 steps .* gives 32"):
        Trainer(_MovableData(_config(tmp_path / "b", num_samples=256, resume=str(tmp_path / "old.pt"))))
    with pytest.raises(UsageError, match=r"64 samples \(4 steps per epoch\) .* has 70 samples \(4 steps"):
        Trainer(_MovableData(_config(tmp_path, num_samples=70)))  # the same steps, but other samples
    assert Trainer(_MovableData(_config(tmp_path))).fit().step == 8  # the same data resumes


def _damage(state: dict[str, Any], how: str) -> None:
    first = next(iter(state["optimizers"]["main"]["state"].values()))
    changes = {
        "rng list empty": lambda: state.update(rng_per_rank=[]),
        "rng entry broken": lambda: state.update(rng_per_rank=[{"python": 1, "numpy": {}, "torch": 3}]),
        "best_score a string": lambda: state.update(best_score="0.9"),
        "step a string": lambda: state.update(step="4"),
        "eval_pending a number": lambda: state.update(eval_pending=3),
        "counters inconsistent": lambda: state.update(step=3),
        "momentum of the wrong shape": lambda: first.update(momentum_buffer=torch.zeros(32, 3)),
        "optimizers a list": lambda: state.update(optimizers=[]),
        "model weights a list": lambda: state["models"].update(model=[1, 2]),
        "a weight not a tensor": lambda: state["models"]["model"].update({"0.weight": "w"}),
        "scheduler without steps": lambda: state["schedulers"].update(main={}),
        "recipe_state a number": lambda: state.update(recipe_state=5),
        "NaN weight": lambda: state["models"]["model"]["0.weight"].fill_(math.nan),
        "missing optimizers": lambda: state.pop("optimizers"),
        "unknown optimizer parameter": lambda: state["optimizers"]["main"]["state"].update({99: {}}),
        "momentum a number": lambda: first.update(momentum_buffer=torch.tensor(0.5)),
        "momentum a string": lambda: first.update(momentum_buffer="0"),
        "momentum of integers": lambda: first.update(momentum_buffer=first["momentum_buffer"].long()),
        "best_score of 400 digits": lambda: state.update(best_score=10**400),
        "best_score NaN": lambda: state.update(best_score=math.nan),
        "best_score inf": lambda: state.update(best_score=math.inf),
    }
    changes[how]()


DAMAGES = [
    "rng list empty",
    "rng entry broken",
    "best_score a string",
    "step a string",
    "eval_pending a number",
    "counters inconsistent",
    "momentum of the wrong shape",
    "optimizers a list",
    "model weights a list",
    "a weight not a tensor",
    "scheduler without steps",
    "recipe_state a number",
    "NaN weight",
    "missing optimizers",
    "unknown optimizer parameter",
    "momentum a number",
    "momentum a string",
    "momentum of integers",
    "best_score of 400 digits",
    "best_score NaN",
    "best_score inf",
]


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("good")
    Trainer(ToyRecipe(_config(run_dir, max_steps=4))).fit()
    return load_checkpoint(run_dir / "ckpt" / "last.pt")


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_checkpoint_is_one_line_naming_the_file(
    how: str, good_checkpoint: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = copy.deepcopy(good_checkpoint)
    _damage(state, how)
    path = tmp_path / "damaged.pt"
    torch.save(state, path)
    argv = ["train", "toy", "--num-samples", "64", "--batch-size", "16", "--epochs", "2", "--tensorboard", "false"]
    line = _one_line(capsys, [*argv, "--run-dir", str(tmp_path / "run"), "--resume", str(path)])
    assert str(path) in line and ("start over with --overwrite" in line or "earlier checkpoint" in line), line


def test_a_damaged_last_falls_back_to_the_kept_step(tmp_path: Path, caplog: Any) -> None:
    Trainer(ToyRecipe(_config(tmp_path, max_steps=4, checkpoint_every=1))).fit()
    state = load_checkpoint(tmp_path / "ckpt" / "last.pt")
    state["rng_per_rank"] = []
    (tmp_path / "ckpt" / "last.pt").unlink()  # a hard link of step_4: replace, not write through
    torch.save(state, tmp_path / "ckpt" / "last.pt")
    (tmp_path / "ckpt" / "step_000000004.pt").unlink()
    with caplog.at_level("WARNING"):
        trainer = Trainer(ToyRecipe(_config(tmp_path)))
    assert trainer.progress.step == 3 and "damaged" in caplog.text


# -------------------------------------------------------------------------------------------- non-finite
class _MaskedNet(nn.Module):
    non_finite_buffers = ("mask_LL",)  # -inf above the diagonal, by design

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("mask_LL", torch.full((3, 3), -math.inf).triu(1))


def test_non_finite_buffers_are_refused_except_the_declared_ones() -> None:
    outer = nn.Sequential(_MaskedNet())
    assert non_finite_weights({"m": outer}) == []  # the declared -inf mask, found in a submodule
    outer[0].norm.running_var.fill_(math.inf)  # what a blown-up BatchNorm keeps
    assert non_finite_weights({"m": outer}) == ["m.0.norm.running_var"]
    outer[0].norm.running_var.fill_(1.0)
    outer[0].mask_LL[0, 0] = math.nan  # by design inf, never NaN
    assert non_finite_weights({"m": outer}) == ["m.0.mask_LL"]
    undeclared = nn.Module()
    undeclared.register_buffer("mask", torch.tensor([-math.inf]))
    assert non_finite_weights({"u": undeclared}) == ["u.mask"]  # not inferred: only declared buffers may be inf


def test_var_declares_its_attention_mask_and_nothing_else_is_inf() -> None:
    from trainlab.models.var.transformer import VAR, VARConfig

    cfg = VARConfig(
        depth=1, embed_dim=32, num_heads=2, patch_nums=(1, 2), vocab_size=16, num_classes=3, vae_embed_dim=8
    )
    var = VAR(cfg)
    assert bool(torch.isinf(var.attn_bias_for_masking).any())
    assert non_finite_weights({"var": var}) == []
    var.blocks[0].attn.zero_k_bias.fill_(math.inf)
    assert non_finite_weights({"var": var}) == ["var.blocks.0.attn.zero_k_bias"]


class _BatchNormToy(ToyRecipe):
    """A BatchNorm model whose running variance overflows to inf at step 3 (as a learning rate of 1e6 does)."""

    def build(self, device: torch.device) -> TrainParts:
        c = self.config
        model = nn.Sequential(nn.Linear(c.num_features, c.hidden), nn.BatchNorm1d(c.hidden), nn.Linear(c.hidden, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=c.optim.learning_rate)
        return TrainParts(models={"model": model}, phases=[Phase("main", optimizer, ["model"])])

    def after_optimizer_step(self, models: Mapping[str, nn.Module], phase: str, info: StepInfo) -> dict[str, float]:
        if info.step == 2:
            models["model"][1].running_var.fill_(math.inf)  # type: ignore[index]
        return {}


def test_a_checkpoint_never_keeps_an_inf_running_var(tmp_path: Path) -> None:
    with pytest.raises(TrainingStopped, match=r"at step 3 .*model.1.running_var.*last finite checkpoint is kept"):
        Trainer(_BatchNormToy(_config(tmp_path, checkpoint_every=1))).fit()
    state = load_checkpoint(tmp_path / "ckpt" / "last.pt")
    assert state["step"] == 2 and all(bool(t.isfinite().all()) for t in state["models"]["model"].values())


def test_fp16_update_overflow_is_the_divergence_path(tmp_path: Path) -> None:
    """lr 1e6 on fp16 weights: SGD's `add_(grad, alpha=-lr)` cannot convert 1e6 to fp16 (largest 65504)."""
    Trainer(ToyRecipe(_config(tmp_path, precision="fp16-scale", max_steps=2))).fit()
    with pytest.raises(TrainingStopped, match=r"diverged at step 3: .*float16 weights.*lower the learning rate"):
        Trainer(ToyRecipe(_config(tmp_path, **{"precision": "fp16-scale", "optim.learning_rate": 1e6}))).fit()
    assert load_checkpoint(tmp_path / "ckpt" / "last.pt")["step"] == 2


# -------------------------------------------------------------------------------------------------- lock
class _Recording(ToyRecipe):
    _built: ClassVar[list[str]] = []  # class-level: read after the Trainer is gone

    def build(self, device: torch.device) -> TrainParts:
        self._built.append("models")
        return super().build(device)

    def build_data(self, parts: TrainParts, device: torch.device) -> Any:
        self._built.append("data")
        return super().build_data(parts, device)


def test_a_second_launch_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from trainlab.engine.run_lock import RunDirLock; "
        "lock = RunDirLock(Path(sys.argv[1])); lock.acquire(); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        start = time.perf_counter()
        with pytest.raises(UsageError, match=rf"in use by pid {holder.pid}"):
            Trainer(_Recording(_config(tmp_path)))
        assert time.perf_counter() - start < 1.0
        assert _Recording._built == []  # neither models nor data (a token cache) were built
    finally:
        holder.kill()
        holder.wait()
    trainer = Trainer(_Recording(_config(tmp_path, max_steps=1)))  # the lock is held from here on ...
    assert _Recording._built == ["models", "data"]
    with pytest.raises(UsageError, match="in use by pid"):
        Trainer(_Recording(_config(tmp_path)))
    trainer.fit()  # ... until fit returns
    Trainer(_Recording(_config(tmp_path, max_steps=1)))


# ------------------------------------------------------------------------------------------- OS errors
def test_a_full_disk_during_torch_save_keeps_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save on a full disk raises RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos')."""
    path = tmp_path / "last.pt"
    atomic_save({"x": torch.ones(3)}, path)

    def full_disk(obj: Any, f: Any) -> None:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 7040 vs 6934") from None

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(UsageError, match=r"No space left on device\); the previous checkpoint is intact"):
        atomic_save({"x": torch.zeros(3)}, path)

    def lost_context(obj: Any, f: Any) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 7040 vs 6934")

    monkeypatch.setattr(torch, "save", lost_context)
    with pytest.raises(RuntimeError, match="unexpected pos"):  # free space is plenty: not the disk, a bug
        atomic_save({"x": torch.zeros(3)}, path)
    monkeypatch.setattr("shutil.disk_usage", lambda p: type("U", (), {"free": 4096})())
    with pytest.raises(UsageError, match=r"4,096 bytes free, the checkpoint needs about"):
        atomic_save({"x": torch.zeros(1 << 20)}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    monkeypatch.undo()
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.ones(3))


def test_a_real_write_failure_is_recognised(tmp_path: Path) -> None:
    """A file-size limit makes the kernel fail the write (EFBIG) inside torch.save, as a full disk does (ENOSPC)."""
    code = (
        "import resource, signal, sys, torch; from pathlib import Path; "
        "from trainlab.engine.checkpoint import atomic_save; from trainlab.errors import UsageError\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); path = Path(sys.argv[1])\n"
        "atomic_save({'x': torch.ones(4)}, path)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
        "try:\n    atomic_save({'x': torch.zeros(100_000)}, path)\n"
        "except UsageError as err:\n    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "last.pt")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "File too large); the previous checkpoint is intact" in out.stdout
    assert torch.equal(torch.load(tmp_path / "last.pt", weights_only=True)["x"], torch.ones(4))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def _fake_command(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    def command(argv: list[str]) -> int:
        raise error

    monkeypatch.setitem(cli._COMMANDS, "sample", ("unused:main", ""))
    monkeypatch.setattr(cli, "_load", lambda target: command)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (OSError(errno.ENOSPC, "No space left on device", "out/000.png"), "No space left on device: out/000.png; free"),
        (OSError(errno.EROFS, "Read-only file system", "ro/x"), "Read-only file system: ro/x; that location is read"),
        (IsADirectoryError(errno.EISDIR, "Is a directory", "m.jsonl"), "Is a directory: m.jsonl; a folder is in the"),
        (NotADirectoryError(errno.ENOTDIR, "Not a directory", "f/x"), "Not a directory: f/x; a file is in the way"),
        (FileExistsError(errno.EEXIST, "File exists", "a.txt"), "File exists: a.txt; something of that name"),
        (PermissionError(errno.EACCES, "Permission denied", "p"), "Permission denied: p; no permission there"),
        (OSError("image file is truncated"), "image file is truncated; check the path"),
        (MemoryError(), "out of memory (MemoryError); lower the batch size"),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "out of memory (CUDA out of memory."),
    ],
)
def test_os_errors_and_out_of_memory_are_one_line(
    error: BaseException, expected: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_command(monkeypatch, error)
    assert expected in _one_line(capsys, ["sample"])


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_command(monkeypatch, RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["sample"])


def test_output_paths_that_are_files_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "afile.txt"
    a_file.write_text("x")
    run = tmp_path / "run"
    assert main(["train", "toy", "--max-steps", "2", "--tensorboard", "false", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    # checked before any work (the command's own check) or by the error boundary: one line naming the path
    assert str(a_file) in _one_line(capsys, ["report", str(run), "--out", str(a_file)])
    assert str(a_file) in _one_line(capsys, ["report", str(run), "--out", str(a_file / "plots")])
    assert str(a_file) in _one_line(capsys, ["demo", "--quick", "--run-dir", str(a_file)])
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()  # relaunched on a run dir whose metrics.jsonl is a directory
    line = _one_line(capsys, ["train", "toy", "--max-steps", "3", "--tensorboard", "false", "--run-dir", str(run)])
    assert f"{run}/metrics.jsonl is a folder, not a regular file: the run writes its own file there" in line


def test_a_folder_at_last_pt_is_refused_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found at the relaunch, not at the first save after minutes of training."""
    run = tmp_path / "run"
    argv = ["train", "toy", "--max-steps", "4", "--checkpoint-every", "2", "--tensorboard", "false"]
    assert main([*argv, "--run-dir", str(run)]) == 0
    capsys.readouterr()
    (run / "ckpt" / "last.pt").unlink()
    (run / "ckpt" / "last.pt").mkdir()
    rows = (run / "metrics.jsonl").read_text()
    line = _one_line(capsys, [*argv[:3], "8", *argv[4:], "--run-dir", str(run)])
    assert line.endswith(
        f"{run}/ckpt/last.pt is a folder where the run keeps a checkpoint file; move it away, then relaunch"
    )
    assert (run / "metrics.jsonl").read_text() == rows  # nothing trained


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGQUIT"])
def test_a_stop_signal_to_the_launcher_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """torchrun passes the signal on to the workers and raises SignalException in the launcher: SIGTERM and SIGHUP
    save (the workers' handler), SIGQUIT does not (its default action), and the line says which."""
    import signal

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    sigval = signal.Signals[name]

    def stopped(args: object) -> None:
        raise SignalException(f"Process 1 got signal: {int(sigval)}", sigval=sigval)

    monkeypatch.setattr(torchrun, "run", stopped)
    code = main(["launch", "--nproc-per-node", "2", "train", "toy"])
    err = capsys.readouterr().err.strip().splitlines()
    if name == "SIGQUIT":
        assert code == 131
        assert err == [
            "trainlab launch: SIGQUIT received: passed on to the workers, which stop at once without saving (SIGTERM "
            "saves); run the same command again to resume from the last checkpoint"
        ]
        return
    assert code == 0
    assert err == [
        f"trainlab launch: {name} received: passed on to the workers, which finish their step, save and stop; run "
        "the same command again to resume"
    ]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["launch", "--bogus", "1", "train", "toy"], "unrecognized arguments: --bogus; see `torchrun --help`"),
        (["launch", "--nproc-per-node", "2"], "no command to launch; name one of: train, plan"),
        (["launch", "-m", "other", "train", "toy"], "-m names the program to run"),
    ],
)
def test_launch_usage_errors_are_one_line(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert expected in _one_line(capsys, argv)


def test_overwrite_never_deletes_a_file_the_run_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`eval linear-probe --moco-weights RUN/ckpt/last.pt --run-dir RUN --overwrite` would delete its own input."""
    from trainlab.recipes.linear_probe import LinearProbeConfig

    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    weights = run / "ckpt" / "last.pt"
    weights.write_bytes(b"pretrained")
    config = LinearProbeConfig(run_dir=run, overwrite=True, moco_weights=str(weights))
    from trainlab.engine.resume import _refuse_deleting_inputs

    with pytest.raises(UsageError, match=r"--overwrite would delete .*last\.pt, which --moco-weights reads"):
        _refuse_deleting_inputs(config, run)
    assert weights.read_bytes() == b"pretrained"
    outside = tmp_path / "weights.pt"
    outside.write_bytes(b"pretrained")
    _refuse_deleting_inputs(LinearProbeConfig(run_dir=run, overwrite=True, moco_weights=str(outside)), run)


def test_a_missing_folder_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file whose folder is gone (a run directory removed or moved mid-run) names the outermost missing folder."""
    gone = tmp_path / "run"
    _fake_command(monkeypatch, FileNotFoundError(errno.ENOENT, "No such file or directory", str(gone / "tb" / "ev")))
    line = _one_line(capsys, ["sample"])
    assert line.endswith(
        f"No such file or directory: {gone}/tb/ev; the folder {gone} does not exist (removed or moved while the "
        "command ran?): check the path"
    )
    _fake_command(monkeypatch, FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "x.pt")))
    assert _one_line(capsys, ["sample"]).endswith("no such file or folder: check the path")  # its folder exists


def test_a_run_directory_removed_mid_run_is_named(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    """Its next save stops the run in one line, rather than writing a checkpoint into a new folder of that name."""
    run = tmp_path / "run"
    argv = [python, "-m", "trainlab", "train", "toy", "--num-samples", "256", "--batch-size", "16", "--epochs", "2"]
    proc = subprocess.Popen(
        [*argv, "--step-sleep-seconds", "0.1", "--device", "cpu", "--run-dir", str(run)],
        env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "metrics.jsonl").exists():
        time.sleep(0.05)
    shutil.rmtree(run)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1] == (
        f"trainlab train: error: the run directory {run} was removed or moved while the run trained (its .lock is not "
        "there any more): step 16 is not saved; the checkpoints saved before went with the folder"
    )
    assert not (run / "ckpt").exists()  # no new, partial run directory with a checkpoint in it


def test_hyperparameters_edited_into_the_optimizer_state_are_not_used(
    good_checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    """The run's config was checked against the checkpoint's: the optimizer's hyperparameters are this run's, not
    values edited into the file's param groups (a `maximize` or a weight decay of 10 would train on silently)."""
    state = copy.deepcopy(good_checkpoint)
    for group in state["optimizers"]["main"]["param_groups"]:
        group.update(maximize=True, weight_decay=10.0, momentum=0.5)
    torch.save(state, tmp_path / "edited.pt")
    trainer = Trainer(ToyRecipe(_config(tmp_path / "run", max_steps=6, resume=str(tmp_path / "edited.pt"))))
    fresh = Trainer(ToyRecipe(_config(tmp_path / "fresh", max_steps=6)))
    for resumed, live in zip(trainer.phases[0].optimizer.param_groups, fresh.phases[0].optimizer.param_groups):
        assert {k: v for k, v in resumed.items() if k not in ("params", "lr")} == {
            k: v for k, v in live.items() if k not in ("params", "lr")
        }


def test_a_run_dir_holding_only_best_is_never_started_afresh(tmp_path: Path) -> None:
    """last.pt and the kept step files removed (to free disk): starting fresh would delete best.pt and the logs."""
    Trainer(ToyRecipe(_config(tmp_path, epochs=2))).fit()
    for path in (tmp_path / "ckpt").glob("*.pt"):
        if path.name != "best.pt":
            path.unlink()
    best = (tmp_path / "ckpt" / "best.pt").read_bytes()
    with pytest.raises(UsageError, match=r"holds .*best\.pt but no last\.pt to resume: continue from it with --resume"):
        Trainer(ToyRecipe(_config(tmp_path, epochs=2)))
    assert (tmp_path / "ckpt" / "best.pt").read_bytes() == best and (tmp_path / "metrics.jsonl").is_file()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "make", "said"),
    [
        ("metrics.jsonl", os.mkfifo, "metrics.jsonl is a FIFO, not a regular file: the run writes its own file there"),
        ("config.yaml", os.mkfifo, "config.yaml is a FIFO"),
        ("environment.yaml", os.mkfifo, "environment.yaml is a FIFO"),
        (".lock", os.mkfifo, ".lock is a FIFO"),
        (".write-test", os.mkfifo, None),  # the writability probe has a name of its own: no wait, no refusal
        ("metrics.jsonl", os.mkdir, "metrics.jsonl is a folder"),
        ("ckpt", lambda path: Path(path).write_text("x"), "ckpt is a file: the run keeps its folder there"),
    ],
)
def test_something_else_in_place_of_a_run_file_is_refused_before_training(
    tmp_path: Path, name: str, make: Any, said: str | None
) -> None:
    """A FIFO where the run writes a file blocked the first write forever (no output at all)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    make(str(run_dir / name))
    if said is None:
        assert Trainer(ToyRecipe(_config(run_dir, max_steps=2))).fit().step == 2
        return
    with pytest.raises(UsageError, match=re.escape(said)):
        Trainer(ToyRecipe(_config(run_dir, max_steps=2))).fit()


def test_a_run_dir_that_is_a_file_or_a_broken_link_says_so(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name, said in (("file", "is a file"), ("dangling", "is a broken symbolic link")):
        with pytest.raises(UsageError, match=f"run directory .*{name} {said}; pass a folder as --run-dir"):
            Trainer(ToyRecipe(_config(tmp_path / name, max_steps=2))).fit()


def test_an_empty_run_dir_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """`--run-dir "$RUN"` with RUN unset would make the current folder the run directory."""
    line = _one_line(capsys, ["train", "toy", "--max-steps", "2", "--run-dir", ""])
    assert "run_dir: an empty path" in line, line


def test_a_closed_stderr_still_trains_and_saves(tmp_path: Path, run_env: dict[str, str]) -> None:
    """`trainlab train ... 2>&-`: Python's sys.stderr is None, which the progress bar's terminal check failed on."""
    command = f"{sys.executable} -m trainlab train toy --max-steps 2 --run-dir {tmp_path / 'run'} 2>&-"
    done = subprocess.run(["bash", "-c", command], env=run_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    assert (tmp_path / "run" / "ckpt" / "last.pt").is_file()


def test_a_read_only_checkpoint_folder_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only mount at ckpt/ (the run dir writable): found at the relaunch, not at the first save an epoch later
    (whose message then advised freeing disk space)."""
    Trainer(ToyRecipe(_config(tmp_path, max_steps=2))).fit()
    real = tempfile.NamedTemporaryFile

    def read_only_ckpt(*args: Any, **kwargs: Any) -> Any:
        if Path(kwargs.get("dir", "")).name == "ckpt":
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only_ckpt)
    with pytest.raises(UsageError, match=r"ckpt is not writable \(Read-only file system\); make it writable"):
        Trainer(ToyRecipe(_config(tmp_path, max_steps=4)))


class _NanFirstEvaluation(ToyRecipe):
    """The toy recipe whose first evaluation is NaN (a diverged epoch, a broken metric)."""

    def evaluate(self, models: Mapping[str, nn.Module], device: torch.device, epoch: int) -> dict[str, float]:
        metrics = super().evaluate(models, device, epoch)
        return {**metrics, "accuracy": math.nan} if epoch == 1 else metrics


def test_a_nan_evaluation_is_never_the_best(tmp_path: Path) -> None:
    """No later score compares better than NaN: taken as the best, it kept best.pt from being written again."""
    Trainer(_NanFirstEvaluation(_config(tmp_path, epochs=3))).fit()
    best = load_checkpoint(tmp_path / "ckpt" / "best.pt")
    assert best["best_score"] is not None and math.isfinite(best["best_score"]) and best["epoch"] > 1
