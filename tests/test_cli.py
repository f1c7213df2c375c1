"""The CLI: bad input is one line on stderr and exit code 2; --help documents every field; YAML + flags."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from trainlab.cli import main
from trainlab.config import parse
from trainlab.errors import UsageError
from trainlab.recipes.toy import ToyConfig


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) >= 1
    line = err[-1]
    assert "Traceback" not in "\n".join(err)
    return line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "nope"], "unknown recipe 'nope'"),
        (["train", "toy", "--precision", "fp32-scale"], "not a valid combination"),
        (["train", "toy", "--precision", "fp12"], "unknown precision"),
        (["train", "toy", "--batch-size", "0"], "--batch-size must be positive"),
        (["train", "toy", "--batch-size", "-4"], "--batch-size must be positive"),
        (["train", "toy", "--batch-size", "x"], "expected int"),
        (["train", "toy", "--no-such-flag", "1"], "unrecognized arguments"),
        (["train", "toy", "--config", "/nonexistent.yaml"], "config file /nonexistent.yaml not found"),
        (["train", "toy", "--resume", "/nonexistent.pt"], "not found"),
        (["frobnicate"], "unknown command"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str, tmp_path: Path
) -> None:
    argv = [*argv, "--run-dir", str(tmp_path)] if argv[0] == "train" and len(argv) > 2 else argv
    assert expected in _error_line(capsys, argv)


def test_unwritable_run_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    if os.geteuid() == 0:
        target = Path("/proc/trainlab-cannot-write-here")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        target = locked / "run"
    assert "not writable" in _error_line(capsys, ["train", "toy", "--run-dir", str(target)])


def test_yaml_then_flags(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("batch_size: 64\nlearning_rate: 0.5\nschedule:\n  kind: linear\n  warmup_fraction: 0.1\n")
    cfg = parse(
        ToyConfig, ["--config", str(yaml_file), "--learning-rate", "0.25", "--schedule.kind", "constant"], prog="t"
    )
    assert (cfg.batch_size, cfg.learning_rate, cfg.schedule.kind, cfg.schedule.warmup_fraction) == (
        64,
        0.25,
        "constant",
        0.1,
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_sise: 3\n")
    with pytest.raises(UsageError, match="unknown key"):
        parse(ToyConfig, ["--config", str(bad)], prog="t")


def test_help_documents_every_field(python: str, run_env: dict[str, str]) -> None:
    out = subprocess.run(
        [python, "-m", "trainlab", "train", "toy", "--help"],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    import dataclasses

    for f in dataclasses.fields(ToyConfig):
        if f.name == "schedule":
            continue
        assert "--" + f.name.replace("_", "-") in out, f.name
    assert "--schedule.warmup-fraction" in out


def test_debug_flag_prints_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "toy", "--debug", "--run-dir", str(tmp_path)]) == 0
    assert "debug PASS" in capsys.readouterr().out
