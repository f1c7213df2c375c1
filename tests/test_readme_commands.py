"""Every `trainlab` command in the README runs as written: parsed and validated by the command's own parser.

Each command of the README's bash blocks (continuation lines joined, `torchrun ... -m trainlab` and `python -m
trainlab` included) runs through `trainlab.cli.main` with `--print-config` appended, which parses every flag,
converts and range-checks every value and runs the config's `validate()`, then exits 0 without training. `--help`
and `--debug` commands run as they are (`--debug` trains the tiny variant). Commands fail the test on any error and
on a deprecated spelling: the README must use the current vocabulary. Input images the commands name are created as
small stand-ins, run directories as
started ones; weights files need not exist to be parsed.
"""

from __future__ import annotations

import logging
import re
import shlex
from pathlib import Path

import pytest
from conftest import REPO
from PIL import Image

from trainlab.cli import main


def readme_commands(text: str) -> list[str]:
    """The `trainlab ...` command lines of the README's bash blocks (comments dropped, continuations joined)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.split(r"\s+#", line, maxsplit=1)[0].strip()
            if line and "trainlab " in line and not line.startswith(("make", "#")):
                commands.append(line)
    return commands


COMMANDS = readme_commands((REPO / "README.md").read_text())
STAND_IN_IMAGES = {"in.png": 256, "mask.png": 256, "seven.png": 64}
STAND_IN_RUNS = ("runs/cifar",)  # `trainlab report runs/cifar`, `trainlab runs runs/`


def _argv(command: str) -> list[str]:
    words = shlex.split(command.replace("[", "").replace("]", ""))  # `trainlab demo [--quick]`: the option shown
    argv = words[words.index("trainlab") + 1 :]
    if not {"--help", "--debug", "--print-config"} & set(argv):
        argv.append("--print-config")
    return argv


def test_the_readme_has_commands() -> None:
    assert len(COMMANDS) > 20


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_parses_as_written(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    for name, side in STAND_IN_IMAGES.items():
        Image.new("RGB", (side, side), (128, 64, 32)).save(name)
    for run in STAND_IN_RUNS:  # a run directory that has started: its metrics.jsonl holds the start event
        Path(run).mkdir(parents=True)
        (Path(run) / "metrics.jsonl").write_text('{"kind": "event", "step": 0, "epoch": 0, "event": "start"}\n')
    with caplog.at_level(logging.WARNING):
        try:
            code = main(_argv(command))
        except SystemExit as stop:  # --help and --print-config exit 0 after printing
            code = stop.code if isinstance(stop.code, int) else 1
    assert code == 0, f"`{command}` failed (exit {code})"
    former = [r.getMessage() for r in caplog.records if "former" in r.getMessage()]
    assert not former, f"`{command}` uses a former spelling: {former[0]}"
