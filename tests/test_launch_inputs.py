"""`trainlab launch` with hostile input: torchrun's options are checked before anything starts.

A bad value is one line naming the option and the fix (exit code 2) instead of torchrun's traceback; a contradiction
that would wait forever (`--standalone --nnodes 2`, a `--node-rank` beyond `--nnodes`, a host that does not resolve)
is refused the same way; the first word after the options is always a trainlab command, never another program. No
test here starts a worker: torchrun's `run` is replaced by a recorder, so a check that lets bad input through shows
up as a launch instead of a hang.
"""

from __future__ import annotations

import argparse
import socket

import pytest
from torch.distributed import run as torchrun

from trainlab.cli import _COMMANDS, main


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """The arguments torchrun's `run` was called with (it starts nothing here)."""
    calls: list[argparse.Namespace] = []
    monkeypatch.setattr(torchrun, "run", calls.append)
    for name in ("PET_NPROC_PER_NODE", "PET_NNODES", "PET_NODE_RANK", "PET_MODULE", "PET_STANDALONE"):
        monkeypatch.delenv(name, raising=False)
    return calls


def _refused(capsys: pytest.CaptureFixture[str], launched: list[argparse.Namespace], argv: list[str]) -> str:
    """Run `trainlab launch ARGV`: it must exit 2 with one line on stderr and start nothing; the line."""
    code = main(["launch", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(err) == 1 and err[0].startswith("trainlab launch: error: "), err
    assert launched == []
    return err[0]


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--nproc-per-node", "0"], ["--nproc-per-node 0", "starts no worker", "1 or more"]),
        (["--nproc-per-node", "-1"], ["--nproc-per-node -1", "1 or more"]),
        (["--nproc-per-node", "abc"], ["--nproc-per-node abc", "1 or more"]),
        (["--nproc_per_node", "abc"], ["--nproc-per-node abc", "1 or more"]),
        (["--master-port", "99999"], ["--master-port 99999", "not a port", "below 65536"]),
        (["--master-port", "-1"], ["--master-port -1", "not a port"]),
        (["--nnodes", "0"], ["--nnodes 0", "not a node count", "MIN:MAX"]),
        (["--nnodes", "2:1"], ["--nnodes 2:1", "not a node count", "MIN:MAX"]),
        (["--nnodes", "1:2:3"], ["--nnodes 1:2:3", "not a node count"]),
        (["--nnodes", "a"], ["--nnodes a", "not a node count"]),
        (["--max-restarts", "-1"], ["--max-restarts -1", "negative", "0 (the default) or more"]),
        (["--redirects", "9"], ["--redirects 9", "not a choice of streams", "3 (both)"]),
        (["--tee", "abc"], ["--tee abc", "not a choice of streams"]),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", ":::::"], ["--rdzv-endpoint :::::", "pass HOST:PORT"]),
        (["--rdzv-conf", "a=b=c,,="], ["--rdzv-conf", "not KEY=VALUE", "join_timeout=900"]),
        (["--rdzv-conf", "join_timeout=-1"], ["join_timeout must be a whole number above 0"]),
        (["--rdzv-conf", "keep_alive_interval=0"], ["keep_alive_interval must be a whole number above 0"]),
        (["--rdzv-conf", "is_host=maybe"], ["is_host must be true or false"]),
        (["--rdzv-conf", "store_type=xyz"], ["store_type must be tcp or file"]),
        (["--rdzv-backend", "abc", "--nnodes", "2"], ["--rdzv-backend abc", "not a rendezvous backend", "c10d"]),
        (["--rdzv-backend", "", "--nnodes", "2"], ["--rdzv-backend ''", "not a rendezvous backend"]),
        (["--monitor-interval", "-1"], ["--monitor-interval -1.0", "seconds above 0"]),
        (["--monitor-interval", "nan"], ["--monitor-interval nan", "seconds above 0"]),
        (["--shutdown-timeout", "-5"], ["--shutdown-timeout -5", "negative", "0 or more"]),
        (["--event-log-handler", "abc"], ["--event-log-handler abc", "console"]),
        (["--local-ranks-filter", "x"], ["--local-ranks-filter x", "below 1", "0,1"]),
        (["--nproc-per-node", "2", "--local-ranks-filter", "0,5"], ["--local-ranks-filter 0,5", "below 2"]),
        (["--logs-specs", "abc"], ["--logs-specs abc", "entry point", "drop it"]),
        (["--master-addr", "a b", "--master-port", "29562"], ["--master-addr 'a b'", "host name or address"]),
    ],
)
def test_a_bad_torchrun_option_is_one_line(
    options: list[str], words: list[str], capsys: pytest.CaptureFixture[str], launched: list[argparse.Namespace]
) -> None:
    line = _refused(capsys, launched, [*options, "runs", "/tmp/x"])
    assert all(word in line for word in words), line


def test_gpu_workers_without_a_gpu_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], launched: list[argparse.Namespace]
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _refused(capsys, launched, ["--nproc-per-node", "gpu", "runs", "/tmp/x"])
    assert "--nproc-per-node gpu cannot be used (Cuda is not available)" in line and "cpu" in line, line


def test_numa_binding_without_a_gpu_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], launched: list[argparse.Namespace]
) -> None:
    import torch

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    line = _refused(capsys, launched, ["--numa-binding", "node", "runs", "/tmp/x"])
    assert "--numa-binding node" in line and "0 GPU(s) for 1 worker(s)" in line and "drop --numa-binding" in line


@pytest.mark.parametrize("nnodes", ["2", "1:2"])
def test_standalone_with_several_nodes_is_refused(
    nnodes: str, capsys: pytest.CaptureFixture[str], launched: list[argparse.Namespace]
) -> None:
    """`--standalone` is one node: with `--nnodes 2` torchrun would wait forever for the second one."""
    line = _refused(capsys, launched, ["--standalone", "--nnodes", nnodes, "runs", "/tmp/x"])
    assert f"--standalone runs on this one node, but --nnodes {nnodes} asks for 2" in line, line
    assert "drop --nnodes" in line and "--rdzv-endpoint" in line, line


@pytest.mark.parametrize(("node_rank", "nnodes"), [("5", "2"), ("2", "2"), ("-1", "1")])
def test_a_node_rank_outside_the_nodes_is_refused(
    node_rank: str, nnodes: str, capsys: pytest.CaptureFixture[str], launched: list[argparse.Namespace]
) -> None:
    """Node 5 of 2 would wait forever for a rendezvous that never includes it."""
    argv = ["--nnodes", nnodes, "--node-rank", node_rank, "--master-port", "29563", "runs", "/tmp/x"]
    line = _refused(capsys, launched, argv)
    assert f"--node-rank {node_rank} is not a node of the run" in line and f"0 to {int(nnodes) - 1}" in line, line


@pytest.mark.parametrize(
    "options",
    [
        ["--nnodes", "2", "--master-addr", "no-such-host.invalid"],
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "no-such-host.invalid:29400"],
        ["--local-addr", "no-such-host.invalid"],
    ],
)
def test_a_host_that_does_not_resolve_is_refused(
    options: list[str], capsys: pytest.CaptureFixture[str], launched: list[argparse.Namespace]
) -> None:
    """torchrun retries a name it cannot resolve for minutes (c10d: forever) instead of saying so."""
    line = _refused(capsys, launched, [*options, "runs", "/tmp/x"])
    assert f"{options[-2]} {options[-1]}" in line and "'no-such-host.invalid' cannot be found" in line, line


def test_a_rendezvous_port_in_use_is_refused(
    capsys: pytest.CaptureFixture[str], launched: list[argparse.Namespace]
) -> None:
    """Node 0 serves the static rendezvous on --master-port: torchrun's DistNetworkError traceback when it is taken."""
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        line = _refused(capsys, launched, ["--master-port", str(port), "runs", "/tmp/x"])
    assert f"--master-port: node 0 cannot serve the rendezvous on port {port}" in line and "free port" in line, line


@pytest.mark.parametrize("first", ["/tmp/evil.py", "launch", "python", "-"])
def test_the_first_word_after_the_options_must_be_a_trainlab_command(
    first: str, capsys: pytest.CaptureFixture[str], launched: list[argparse.Namespace]
) -> None:
    """torchrun runs its first positional argument as the training script: here it is always a trainlab command."""
    line = _refused(capsys, launched, ["--nproc-per-node", "2", first, "runs", "/tmp/x"])
    assert f"{first!r} is not a trainlab command" in line and ", ".join(_COMMANDS) in line, line


@pytest.mark.parametrize(
    ("options", "env", "words"),
    [
        (["--mod"], {}, "-m names the program to run"),  # an abbreviation argparse accepts
        (["--no-py"], {}, "--no-python names the program to run"),
        (["--run-path"], {}, "--run-path names the program to run"),
        ([], {"PET_MODULE": "1"}, "PET_MODULE=1 (-m) names the program to run"),
        ([], {"PET_NO_PYTHON": "1"}, "PET_NO_PYTHON=1 (--no-python) names the program to run"),
    ],
)
def test_an_option_that_names_another_program_is_refused_however_given(
    options: list[str],
    env: dict[str, str],
    words: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    launched: list[argparse.Namespace],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert words in _refused(capsys, launched, [*options, "runs", "/tmp/x"])


def test_an_option_from_torchruns_environment_is_named_as_such(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], launched: list[argparse.Namespace]
) -> None:
    """torchrun reads its options' defaults from PET_* variables (set by cluster operators): the line names it."""
    monkeypatch.setenv("PET_NPROC_PER_NODE", "0")
    assert "PET_NPROC_PER_NODE=0 (--nproc-per-node) starts no worker" in _refused(capsys, launched, ["runs", "/x"])
    monkeypatch.setenv("PET_STANDALONE", "abc")  # read with int() when torchrun's parser is built
    line = _refused(capsys, launched, ["runs", "/tmp/x"])
    assert "PET_STANDALONE=abc in the environment" in line and "0 or 1" in line, line


@pytest.mark.parametrize(
    "argv",
    [["--nproc-per-node", "2"], ["--rdzv-id", "train"]],  # a command's name as an option's value is no command
)
def test_no_command_after_the_options_is_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str], launched: list[argparse.Namespace]
) -> None:
    assert "no command to launch; name one of: train, plan" in _refused(capsys, launched, argv)


@pytest.mark.parametrize(
    ("argv", "nproc", "command"),
    [
        (["--standalone", "--nproc-per-node", "2", "train", "toy", "--epochs", "1"], "2", ["train", "toy"]),
        (["--rdzv-id", "runs", "runs", "/tmp/x"], "1", ["runs", "/tmp/x"]),  # the option's value is not the command
        (["--nproc-per-node=2", "--", "runs", "--nnodes", "3"], "2", ["runs", "--nnodes", "3"]),  # the command's own
    ],
)
def test_a_good_launch_runs_trainlab_with_the_command(
    argv: list[str], nproc: str, command: list[str], launched: list[argparse.Namespace]
) -> None:
    assert main(["launch", *argv]) == 0
    (args,) = launched
    assert args.module and args.training_script == "trainlab" and not args.no_python and not args.run_path
    assert args.training_script_args[: len(command)] == command and args.nproc_per_node == nproc
    assert args.nnodes == "1:1"
