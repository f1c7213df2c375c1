"""The CLI: bad input is one line on stderr and exit code 2; --help documents every field; YAML + flags."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from trainlab.cli import main
from trainlab.config import parse
from trainlab.errors import UsageError
from trainlab.recipes.toy import ToyConfig

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # a worker's


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) >= 1
    line = err[-1]
    assert "Traceback" not in "\n".join(err)
    command = argv[0]
    if command in ("train", "sample", "report", "bench", "demo"):  # the dispatcher's prefix, exactly once
        assert line.startswith(f"trainlab {command}: error: ") and line.count("error:") == 1, line
    return line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "nope"], "unknown recipe 'nope'"),
        (["train", "toy", "--precision", "fp32-scale"], "argument --precision: invalid choice: 'fp32-scale'"),
        (["train", "toy", "--precision", "fp12"], "invalid choice: 'fp12' (choose from 'fp32', 'fp16',"),
        (["train", "toy", "--wandb", "maybe"], "invalid choice: 'maybe' (choose from 'off', 'online', 'offline')"),
        (["train", "toy", "--schedule.kind", "steps"], "argument --schedule.kind: invalid choice: 'steps'"),
        (["train", "toy", "--batch-size", "0"], "--batch-size must be positive"),
        (["train", "toy", "--batch-size", "-4"], "--batch-size must be positive"),
        (["train", "toy", "--batch-size", "x"], "expected int"),
        (["train", "toy", "--no-such-flag", "1"], "unrecognized arguments"),
        (["train", "toy", "--config", "/nonexistent.yaml"], "config file /nonexistent.yaml not found"),
        (["train", "toy", "--resume", "/nonexistent.pt"], "not found"),
        (["frobnicate"], "unknown command"),
        (["sample"], "missing required --tokenizer-weights, --var-weights, --classes"),
        (["sample", "--tokenizer-weights", "v.pth", "--var-weights", "w.pth", "--classes", "1"], "nothing to write"),
        (["sample", "--classes", "1", "--guidance"], "argument --guidance: expected one argument"),
        (
            ["sample", "--tokenizer-weights", "v", "--var-weights", "w", "--classes", "1", "--top-k", "many"],
            "expected int, got 'many'",
        ),
        (["sample", "--no-such-flag"], "unrecognized arguments: --no-such-flag; see `trainlab sample --help`"),
        (["report"], "missing required RUN_DIR"),
        (["report", "/nonexistent-run"], "run directory /nonexistent-run does not exist"),
        (["bench", "precision", "--modes", "fp32", "fp32-amp"], "argument --modes: invalid choice: 'fp32-amp'"),
        (["bench", "precision", "--model", "resnet99"], "argument --model: invalid choice: 'resnet99'"),
        (["demo", "--samples-per-class", "0"], "--samples-per-class must be >= 1"),
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
    yaml_file.write_text("batch_size: 64\noptim: {learning_rate: 0.5}\nschedule: {kind: linear, warmup_fraction: 0.1}")
    flags = ["--optim.learning-rate", "0.25", "--schedule.kind", "constant"]
    cfg = parse(ToyConfig, ["--config", str(yaml_file), *flags], prog="t")
    assert (cfg.batch_size, cfg.optim.learning_rate, cfg.schedule.kind, cfg.schedule.warmup_fraction) == (
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


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "toy", "--seed", "3", "--schedule.kind", "linear"], {"seed": 3, "precision": "fp32"}),
        (["sample", "--tokenizer-weights", "v.pth", "--var-weights", "w.pth", "--classes", "1", "2", "--guidance", "3",
          "--out", "g.png"], {"tokenizer_weights": "v.pth", "classes": ["1", "2"], "guidance": 3.0, "out_dir": None}),
        (["bench", "precision", "--modes", "fp32", "bf16-amp"], {"modes": ["fp32", "bf16-amp"]}),
        (["demo", "--quick"], {"quick": True}),
    ],
)  # fmt: skip
def test_print_config_prints_yaml_and_runs_nothing(
    argv: list[str], expected: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--print-config`: the resolved config as YAML on stdout, exit 0 (like --help), nothing run or written.
    (`report` is covered in test_report_plots.py: it needs real run directories.)"""
    if argv[0] in ("train", "demo"):
        argv = [*argv, "--run-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--print-config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert {key: printed[key] for key in expected} == expected
    if argv[0] == "train":
        assert printed["schedule"]["kind"] == "linear"
    assert not (tmp_path / "run").exists()


def test_print_config_output_loads_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--seed", "7", "--wandb", "offline", "--schedule.warmup-fraction", "0.2", "--run-dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        parse(ToyConfig, [*argv, "--print-config"], prog="t")
    (tmp_path / "printed.yaml").write_text(capsys.readouterr().out)
    assert parse(ToyConfig, ["--config", str(tmp_path / "printed.yaml")], prog="t") == parse(ToyConfig, argv, prog="t")


def test_print_config_exits_0_from_the_command_line(python: str, run_env: dict[str, str], tmp_path: Path) -> None:
    proc = subprocess.run(
        [python, "-m", "trainlab", "train", "toy", "--run-dir", str(tmp_path / "run"), "--print-config"],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["run_dir"] == str(tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_help_lists_literal_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "toy", "--help"])
    out = capsys.readouterr().out
    assert "--wandb {off,online,offline}" in out and "--schedule.kind {constant,cosine,linear,var-lin0}" in out
    with pytest.raises(SystemExit):
        main(["bench", "precision", "--help"])
    assert "--modes {fp32,fp16,fp16-scale,bf16," in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-workers", "-1"], "--num-workers must be >= 0"),
        (["--seed", "-1"], "--seed must be in"),
        (["--seed", str(2**64)], "--seed must be in"),
        (["--precision", "fp16-scale", "--static-loss-scale", "0"], "--static-loss-scale must be positive"),
        (["--eval-every-epochs", "0"], "--eval-every-epochs must be >= 1"),
        (["--clip-grad-norm", "-1"], "--clip-grad-norm must be >= 0"),
        (["--checkpoint-every", "-3"], "--checkpoint-every must be >= 0"),
        (["--optim.learning-rate", "-2"], "--optim.learning-rate must be > 0 or -1, got -2"),
        (["--optim.learning-rate", "nan"], "--optim.learning-rate must be a finite number"),
        (["--device", "mps"], "unknown --device 'mps'; use auto, cpu, cuda or cuda:N"),
        (["--device", "cuda:-1"], "unknown --device 'cuda:-1'; use auto, cpu, cuda or cuda:N"),
        (["--device", "cpu:1"], "unknown --device 'cpu:1'"),
        (["--device", "cuda:18446744073709551616"], "unknown --device 'cuda:18446744073709551616'"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1"),
        (["--optim.learning-rate", "-inf"], "--optim.learning-rate must be a finite number > 0 or -1, got -inf"),
        (["--optim.learning-rate", "-1e-3"], "--optim.learning-rate must be > 0 or -1, got -0.001"),
    ],
)
def test_bad_engine_settings_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["train", "toy", *flags, "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_checkpoint_with_missing_fields_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    assert main(["train", "toy", "--epochs", "1", "--run-dir", str(tmp_path / "a")]) == 0
    state = torch.load(tmp_path / "a" / "ckpt" / "last.pt", weights_only=True)
    del state["optimizers"]
    torch.save(state, tmp_path / "broken.pt")
    capsys.readouterr()
    code = main(
        ["train", "toy", "--epochs", "1", "--run-dir", str(tmp_path / "b"), "--resume", str(tmp_path / "broken.pt")]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "incomplete or damaged" in err[0], err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "trainlab: error: no command given; choose one of: train"),
        (["train"], "trainlab train: error: name a recipe: cifar"),
        (["plan"], "trainlab plan: error: name a recipe: cifar"),
        (["bench"], "trainlab bench: error: name a benchmark: precision or data"),
        (["bench", "data"], "trainlab bench: error: name a recipe: cifar"),
        (["eval"], "trainlab eval: error: name an evaluation: knn, linear-probe, fid or judge"),
        (["launch"], "trainlab launch: error: no command to launch"),
    ],
)
def test_a_missing_command_or_recipe_is_an_error_line_on_stderr(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines()[-1].startswith(message), captured.err


def _command(monkeypatch: pytest.MonkeyPatch, body: Callable[[list[str]], int]) -> None:
    import trainlab.cli as cli

    monkeypatch.setattr(cli, "_load", lambda target: body)


def test_sigterm_outside_the_training_loop_ends_like_ctrl_c(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Imports, building, an evaluation command: no save to make, one line instead of a silent death (exit 143)."""

    def building(argv: list[str]) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        return 0

    _command(monkeypatch, building)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["doctor"]) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == "trainlab doctor: terminated (SIGTERM)"
    assert signal.getsignal(signal.SIGTERM) is before  # an in-process caller gets its handler back


@pytest.mark.parametrize(
    ("error", "torchrun", "code", "line"),
    [
        (
            RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 3840000000"),
            False,
            2,
            "trainlab doctor: error: out of memory ([enforce fail",
        ),
        (
            RuntimeError("[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:4711"),
            True,
            1,
            "trainlab doctor: error: another process of the run is gone",
        ),
    ],
)
def test_host_memory_and_a_lost_peer_are_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: RuntimeError,
    torchrun: bool,
    code: int,
    line: str,
) -> None:
    def failing(argv: list[str]) -> int:
        raise error

    _command(monkeypatch, failing)
    if torchrun:
        for name, value in TORCHRUN_ENV.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr("trainlab.launcher.record_error_for_launcher", lambda line: None)
    assert main(["doctor"]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="Connection closed"):  # outside torchrun it is no peer's: a bug
        _command(monkeypatch, lambda argv: (_ for _ in ()).throw(RuntimeError("Connection closed by peer")))
        main(["doctor"])


def test_a_library_that_cannot_be_mapped_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The loader failing to map torch's library (an address-space limit) is out of memory; a missing module is a bad
    install and keeps its traceback."""
    unmapped = ImportError("libtorch_cpu.so: failed to map segment from shared object")
    _command(monkeypatch, lambda argv: (_ for _ in ()).throw(unmapped))
    assert main(["doctor"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out of memory while loading a library (libtorch_cpu.so" in err[0], err
    assert "ulimit -v" in err[0]
    with pytest.raises(ModuleNotFoundError):
        _command(monkeypatch, lambda argv: (_ for _ in ()).throw(ModuleNotFoundError("No module named 'torch'")))
        main(["doctor"])


def test_an_address_space_too_small_for_torch_is_one_line(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    """A real limit (ulimit -v 400 MiB): the import of torch fails inside the command, which says so in one line."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (400 * 2**20, resource.RLIM_INFINITY))

    done = subprocess.run(
        [python, "-m", "trainlab", "plan", "toy", "--json"],
        env=run_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr[-2000:]
    assert err[0].startswith("trainlab plan: error: out of memory"), err


def test_nothing_follows_the_error_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What fails in a finaliser as the command's objects are let go (a half-started DataLoader iterator's __del__)
    is a consequence of the error: the line stays the last thing on stderr."""

    class HalfBuilt:
        def __del__(self) -> None:
            raise AttributeError("no attribute '_workers_status'")

    def failing(argv: list[str]) -> int:
        held = HalfBuilt()  # freed with the traceback, after the line is printed
        raise UsageError(f"too many open files ({held is not None})")

    _command(monkeypatch, failing)
    reported: list[str] = []  # what the interpreter would print as "Exception ignored in ..."
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(repr(unraisable.exc_value)))
    assert main(["doctor"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["trainlab doctor: error: too many open files (True)"] and reported == [], (err, reported)
    HalfBuilt()  # after the command: the caller's hook is back
    assert reported == ["AttributeError(\"no attribute '_workers_status'\")"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({**TORCHRUN_ENV, "RANK": "abc"}, "RANK='abc' is not a rank"),
        ({**TORCHRUN_ENV, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a rank"),
        ({**TORCHRUN_ENV, "RANK": "3"}, "RANK=3 of WORLD_SIZE=2"),
        # left exported in a shell: no launcher started the process (which printed nothing as "rank 1", then waited)
        ({"RANK": "1", "WORLD_SIZE": "2"}, "RANK=1 and WORLD_SIZE=2 are set, but not MASTER_ADDR / MASTER_PORT"),
    ],
)
def test_a_damaged_launch_environment_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    env: dict[str, str],
    message: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("trainlab.launcher.record_error_for_launcher", lambda line: None)
    assert main(["train", "toy", "--device", "cpu", "--max-steps", "1", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_stray_rank_never_silences_a_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """RANK=1 WORLD_SIZE=2 left in a shell: the command is one process and prints its own error line at once."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    started = time.monotonic()
    assert main(["runs", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("trainlab runs: error: ") and time.monotonic() - started < 5


def test_a_junk_rank_outside_torchrun_is_ignored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "abc")  # no WORLD_SIZE: one process, as before
    assert main(["train", "toy", "--device", "cpu", "--max-steps", "1", "--run-dir", str(tmp_path / "r")]) == 0


@pytest.mark.parametrize("argv", [["--help"], ["runs", "RUNS"]])
def test_a_reader_that_leaves_the_pipe_ends_the_command_quietly(
    argv: list[str], tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    """`trainlab runs | head -1`: stdout's reader is gone before the output is written. No traceback and no "Broken
    pipe; check the path" line: the exit code a shell shows for a program its pipe's reader left (141)."""
    assert main(["train", "toy", "--device", "cpu", "--max-steps", "1", "--run-dir", str(tmp_path / "r")]) == 0
    command = [python, "-m", "trainlab", *[str(tmp_path) if word == "RUNS" else word for word in argv]]
    child = subprocess.Popen(command, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()  # before the interpreter has started: its first write finds no reader
    err = child.stderr.read().decode()
    assert child.wait(timeout=120) == 141 and err.strip() == "", err[-2000:]


def test_text_the_terminal_cannot_encode_is_written_escaped(
    tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    folder = tmp_path / "ünï"
    assert main(["train", "toy", "--device", "cpu", "--max-steps", "1", "--run-dir", str(folder / "rün")]) == 0
    done = subprocess.run(
        [python, "-m", "trainlab", "runs", str(folder)],
        env={**run_env, "PYTHONIOENCODING": "ascii"},
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0 and b"r\\xfcn" in done.stdout, done.stderr[-2000:]
