"""What a run directory records about itself: the resolved config, the command line, git SHA and library versions
(the paths are `engine.run_dir`'s)."""

from __future__ import annotations

import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from trainlab.engine.run_dir import RunDir


def git_sha() -> str:
    """The commit of the trainlab checkout (with '-dirty' for local changes), or 'unknown' outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that started this process (`sys.argv` joined with `shlex.join`), written so it can be pasted:
    the console script as `trainlab`, `.../trainlab/__main__.py` (what `python -m trainlab` and `torchrun -m
    trainlab` put in argv[0]) as `python -m trainlab`."""
    args = list(sys.argv if argv is None else argv)
    if args:
        program = Path(args[0])
        if program.name == "trainlab":
            args[:1] = ["trainlab"]
        elif program.name == "__main__.py" and program.parent.name == "trainlab":
            args[:1] = ["python", "-m", "trainlab"]
    return shlex.join(args)


def environment() -> dict[str, Any]:
    """Provenance of this process: trainlab version, git SHA, Python / torch / torchvision versions, platform, GPU."""
    import torchvision

    import trainlab

    env: dict[str, Any] = {
        "trainlab": trainlab.__version__,
        "git_sha": git_sha(),
        "python": sys.version.split()[0],
        "torch": str(torch.__version__),
        "torchvision": str(torchvision.__version__),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        env["cuda"] = str(torch.version.cuda)
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def _one_line(value: Any) -> str:
    """A header comment must stay on its line: a newline (possible inside a quoted argument) is written as `\\n`."""
    return str(value).replace("\n", "\\n")


def write_config(run_dir: Path, recipe: str, config: dict[str, Any]) -> None:
    """`config.yaml`: the resolved config (re-runnable with --config) under a provenance header of YAML comments
    (recipe, command line, versions; comments, so `--config` reads the file back unchanged). `environment.yaml`: the
    same provenance as YAML keys."""
    text = yaml.safe_dump(config, sort_keys=False)
    provenance = {"recipe": recipe, "command": command_line(), **environment()}
    header = "".join(f"# {k}: {_one_line(v)}\n" for k, v in provenance.items())
    files = RunDir(run_dir)
    files.config.write_text(header + text)
    files.environment.write_text(yaml.safe_dump(provenance, sort_keys=False))
