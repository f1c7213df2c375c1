"""`trainlab runs`: every run under a folder with its status (running / finished / interrupted / failed), step/total,
last metrics and the command that resumes it; a table and --json."""

from __future__ import annotations

import collections
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from trainlab.cli import main
from trainlab.commands.runs import resume_command, run_state
from trainlab.engine.checkpoint_fields import TorchObject, UnreadableCheckpoint, read_fields
from trainlab.engine.run_dir import RunDir


def _run_dir(
    root: Path,
    name: str,
    *,
    rows: list[dict[str, Any]],
    ckpt_step: int | None = None,
    epochs: int = 2,
    command: str = "",
    recipe: str = "toy",
) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    command = command or f"trainlab train {recipe} --run-dir {run_dir} --epochs {epochs}"
    header = f"# recipe: {recipe}\n# command: {command}\n# trainlab: 0.1.0\n"
    (run_dir / "config.yaml").write_text(header + f"run_dir: {run_dir}\nepochs: {epochs}\nmax_steps: -1\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if ckpt_step is not None:
        (run_dir / "ckpt").mkdir()
        state = {"format": "trainlab-checkpoint", "recipe": recipe, "step": ckpt_step, "epoch": ckpt_step // 8}
        state |= {"step_in_epoch": ckpt_step % 8, "best_score": 0.5, "models": {"m": {"w": torch.zeros(2)}}}
        torch.save(state, run_dir / "ckpt" / "last.pt")
    return run_dir


def _train(step: int, loss: float) -> dict[str, Any]:
    return {"kind": "train", "step": step, "epoch": (step - 1) // 8, "loss": loss, "lr": 0.1}


@pytest.fixture
def runs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # where the runs were launched: their recorded --run-dir runs/NAME names them
    root = tmp_path / "runs"
    evals = [{"kind": "eval", "step": 8, "epoch": 0, "accuracy": 0.75, "loss": 0.6}]
    _run_dir(
        root,
        "done",
        rows=[_train(1, 2.0), _train(8, 1.0), *evals, _train(16, 0.5), {"kind": "summary", "step": 16, "epoch": 2}],
        ckpt_step=16,
    )
    _run_dir(  # SIGTERM at step 12: saved there, then a summary row (the engine writes one on interruption too)
        root,
        "sigterm",
        rows=[_train(1, 2.0), _train(8, 1.0), *evals, {"kind": "summary", "step": 12, "epoch": 1}],
        ckpt_step=12,
        command="trainlab train toy --run-dir runs/sigterm --overwrite --epochs 2",
    )
    _run_dir(root, "killed", rows=[_train(1, 2.0), _train(8, 1.0), *evals, _train(14, "nan")], ckpt_step=8)
    _run_dir(root, "crashed/early", rows=[_train(1, 3.0)])  # nested; never saved
    (root / "not-a-run" / "tb").mkdir(parents=True)
    return root


def test_statuses_steps_metrics_and_resume_commands(runs_root: Path) -> None:
    dirs = [run.path for run in RunDir.find(runs_root)]
    assert [d.relative_to(runs_root).as_posix() for d in dirs] == ["crashed/early", "done", "killed", "sigterm"]
    states = {Path(s.run_dir).name: s for s in map(run_state, dirs)}
    assert {k: s.status for k, s in states.items()} == {
        "early": "failed",
        "done": "finished",
        "killed": "failed",  # steps 9..14 were logged after the step-8 checkpoint: they are lost
        "sigterm": "interrupted",
    }
    done, sigterm, killed = states["done"], states["sigterm"], states["killed"]
    assert (done.step, done.total_steps, done.loss, done.eval) == (16, 16, 0.5, {"accuracy": 0.75, "loss": 0.6})
    assert done.command is None
    assert (sigterm.step, sigterm.total_steps, sigterm.checkpoint_step) == (12, 16, 12)
    assert sigterm.command == "trainlab train toy --run-dir runs/sigterm --epochs 2"  # --overwrite would start over
    assert killed.step == 14 and killed.loss is not None and killed.loss != killed.loss  # nan stays visible
    assert states["early"].total_steps is None and states["early"].checkpoint_step is None


def test_a_moved_run_is_resumed_where_it_is_now(runs_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorded --run-dir names where the run was; relaunched from there, the command would start a new run."""
    (runs_root / "sigterm").rename(runs_root / "moved")
    assert run_state(runs_root / "moved").command == (f"trainlab train toy --run-dir {runs_root / 'moved'} --epochs 2")
    monkeypatch.chdir(runs_root)  # launched elsewhere: the relative path would name another folder
    (runs_root / "moved").rename(runs_root / "sigterm")
    assert run_state(runs_root / "sigterm").command == (
        f"trainlab train toy --run-dir {runs_root / 'sigterm'} --epochs 2"
    )


def test_a_locked_run_dir_is_running(runs_root: Path) -> None:
    run_dir = runs_root / "killed"
    with open(run_dir / ".lock", "a+") as lock:
        lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        lock.flush()
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        state = run_state(run_dir)
        assert state.status == "running" and state.owner == f"pid {os.getpid()} on {socket.gethostname()}"
        assert state.command is None
    assert run_state(run_dir).status == "failed"  # the lock file stays, but nobody holds it


def test_table_and_json(runs_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", str(runs_root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["RUN", "RECIPE", "STATUS", "STEP", "LOSS", "EVAL", "UPDATED"]
    done = next(line for line in out if line.startswith("done "))
    assert done.split()[:7] == ["done", "toy", "finished", "16/16", "0.5", "accuracy", "0.75"]
    assert "  sigterm: trainlab train toy --run-dir runs/sigterm --epochs 2" in out
    assert any(line.startswith("  crashed/early: trainlab train toy") for line in out)
    assert main(["runs", str(runs_root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(Path(r["run_dir"]).name, r["status"]) for r in listed] == [
        ("early", "failed"),
        ("done", "finished"),
        ("killed", "failed"),
        ("sigterm", "interrupted"),
    ]
    assert main(["runs", str(runs_root / "missing")]) == 2


def test_resume_command_drops_overwrite_only() -> None:
    assert resume_command("trainlab train var --config var_d16 --overwrite true --seed 1") == (
        "trainlab train var --config var_d16 --seed 1"
    )
    assert resume_command("trainlab train toy --overwrite=1 --run-dir 'my runs/a'") == (
        "trainlab train toy --run-dir 'my runs/a'"
    )


def test_a_real_toy_run_is_listed_finished(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "toy"
    assert main(["train", "toy", "--run-dir", str(run_dir), "--epochs", "1", "--num-samples", "64"]) == 0
    capsys.readouterr()
    state = run_state(run_dir)
    assert (state.recipe, state.status, state.step) == ("toy", "finished", state.total_steps)
    assert state.step and state.loss is not None and "accuracy" in state.eval
    assert state.eval_metric == "accuracy" and state.checkpoint_step == state.step


# ------------------------------------------------------------------------------- checkpoint fields without torch
def test_checkpoint_fields_read_without_torch_equal_torch_load(tmp_path: Path) -> None:
    weights = collections.OrderedDict(w=torch.nn.Parameter(torch.randn(3, 2)), b=torch.zeros(2, dtype=torch.float16))
    state = {"format": "trainlab-checkpoint", "recipe": "var", "step": 7, "epoch": 1, "step_in_epoch": 3}
    state |= {"best_score": -1.25, "config": {"patch_nums": [1, 2], "tokenizer_weights": "t.pth", "lr": 1e-4}}
    state |= {"models": {"var": weights}, "rng": {"python": (3, (1, 2, 3), None), "torch": torch.get_rng_state()}}
    state |= {"dtype": torch.bfloat16, "names": {"a", "b"}, "blob": b"\x00\xff"}
    path = tmp_path / "last.pt"
    torch.save(state, path)
    keys = ("recipe", "step", "epoch", "step_in_epoch", "best_score", "config", "names", "blob", "missing")
    fields = read_fields(path, keys)
    loaded = torch.load(path, weights_only=True)
    assert fields == {k: loaded[k] for k in keys if k in loaded}
    assert isinstance(read_fields(path, ["models"])["models"]["var"]["w"], TorchObject)  # never read


def test_checkpoint_fields_refuse_damaged_and_foreign_files(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    torch.save({"step": 1, "w": torch.zeros(1000)}, good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:300])
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    for path in (cut, text):
        with pytest.raises(UnreadableCheckpoint, match=str(path)):
            read_fields(path, ["step"])
    evil = tmp_path / "evil.pt"
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    torch.save({"step": Payload()}, evil)  # torch.save pickles whatever it is given
    with pytest.raises(UnreadableCheckpoint, match="has no place in a checkpoint"):
        read_fields(evil, ["step"])
    assert not marker.exists()


def test_a_demo_stage_keeps_the_demo_command(tmp_path: Path) -> None:
    """A demo stage records the demo's command, whose --run-dir is the folder of all its stages: never the stage's."""
    command = f"trainlab demo --quick --run-dir {tmp_path / 'demo'}"
    assert resume_command(command, tmp_path / "demo" / "var") == command


def test_checkpoint_fields_read_in_bounded_memory(tmp_path: Path) -> None:
    """A 180-byte file asking for bytearray(2**31), or a zip member that inflates to gigabytes: refused, not built."""
    import zipfile

    asks = b"\x80\x02}q\x00X\x04\x00\x00\x00stepq\x01c__builtin__\nbytearray\nJ\x00\x00\x00\x80\x85Rs."
    with zipfile.ZipFile(tmp_path / "asks.pt", "w") as archive:
        archive.writestr("x/data.pkl", asks)
    with pytest.raises(UnreadableCheckpoint, match="bytearray from anything but its bytes"):
        read_fields(tmp_path / "asks.pt", ["step"])
    with zipfile.ZipFile(tmp_path / "bomb.pt", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("x/data.pkl", b"\0" * (65 * 2**20))
    with pytest.raises(UnreadableCheckpoint, match=r"data\.pkl is over 64 MiB"):
        read_fields(tmp_path / "bomb.pt", ["step"])


@pytest.mark.timeout(60)
def test_a_fifo_lock_or_a_deeply_nested_metrics_line_never_stops_the_listing(
    runs_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(runs_root / "done" / ".lock")  # no writer: a plain open() would block forever
    with open(runs_root / "killed" / "metrics.jsonl", "a") as f:
        f.write("[" * 100_000 + "\n")
    with open(runs_root / "sigterm" / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": ' + "9" * 5000 + "}\n")  # over Python's 4300-digit int limit
    assert main(["runs", str(runs_root)]) == 0
    out = capsys.readouterr().out
    assert "done " in out and "killed " in out and "sigterm " in out


def test_counts_of_thousands_of_digits_in_a_config_or_checkpoint_are_no_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 5000-digit epochs in config.yaml, or step in the checkpoint, cannot be printed (Python's 4300-digit limit):
    the run is listed without them, as with any other damaged value."""
    huge = _run_dir(tmp_path, "huge_ckpt", rows=[_train(1, 2.0)], ckpt_step=10**5000)
    assert run_state(huge).checkpoint_step is None and run_state(huge).epoch is None
    config = _run_dir(tmp_path, "huge_config", rows=[_train(1, 2.0)])
    text = (config / "config.yaml").read_text().replace("epochs: 2", "epochs: " + "9" * 5000)
    (config / "config.yaml").write_text(text)
    assert run_state(config).epochs is None
    assert main(["runs", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(Path(run["run_dir"]).name for run in listed) == ["huge_ckpt", "huge_config"]


def test_a_diverged_run_or_a_damaged_command_still_lists_as_valid_json(
    runs_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """JSON has no NaN: a diverged run's loss is "nan", as metrics.jsonl stores it; a recorded command with an
    unclosed quote (a damaged header) lists the run without a resume line."""
    killed = runs_root / "killed" / "config.yaml"
    killed.write_text(killed.read_text().replace("# command: trainlab train toy", "# command: trainlab train 'toy"))
    assert main(["runs", str(runs_root), "--json"]) == 0
    listed = {Path(run["run_dir"]).name: run for run in json.loads(capsys.readouterr().out, parse_constant=pytest.fail)}
    assert listed["killed"]["loss"] == "nan" and listed["killed"]["command"] is None
    assert listed["sigterm"]["command"] is not None


def test_a_damaged_recipe_name_cannot_swamp_the_table(runs_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = runs_root / "done" / "config.yaml"
    config.write_text(config.read_text().replace("# recipe: toy", "# recipe: " + "t" * 200_000))
    assert main(["runs", str(runs_root)]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) < 300
