"""What a run directory records about itself: the resolved config, the command line, git SHA and library versions."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from trainlab.errors import UsageError


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


def prepare_run_dir(run_dir: Path) -> None:
    """Create the run directory or fail with a one-line error if it cannot be written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise UsageError(
            f"run directory {run_dir} is not writable ({err.strerror}); pass a writable --run-dir"
        ) from None
    if not os.access(run_dir, os.W_OK):
        raise UsageError(f"run directory {run_dir} is not writable; pass a writable --run-dir")


def _one_line(value: Any) -> str:
    """A header comment must stay on its line: a newline (possible inside a quoted argument) is written as `\\n`."""
    return str(value).replace("\n", "\\n")


def recorded_recipe(run_dir: Path) -> str | None:
    """The recipe a run directory holds, from the `# recipe: NAME` line of its config.yaml header; None without one.

    Raises:
        UsageError: config.yaml exists but cannot be read.
    """
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.startswith("#"):
                    break
                key, sep, value = line[1:].strip().partition(": ")
                if sep and key == "recipe":
                    return value.strip()
    except OSError as err:
        raise UsageError(
            f"cannot read {path} ({err.strerror}); fix its permissions, or pass another --run-dir"
        ) from None
    return None


def write_config(run_dir: Path, recipe: str, config: dict[str, Any]) -> None:
    """`config.yaml`: the resolved config (re-runnable with --config) under a provenance header of YAML comments
    (recipe, command line, versions; comments, so `--config` reads the file back unchanged). `environment.yaml`: the
    same provenance as YAML keys."""
    text = yaml.safe_dump(config, sort_keys=False)
    provenance = {"recipe": recipe, "command": command_line(), **environment()}
    header = "".join(f"# {k}: {_one_line(v)}\n" for k, v in provenance.items())
    (run_dir / "config.yaml").write_text(header + text)
    (run_dir / "environment.yaml").write_text(yaml.safe_dump(provenance, sort_keys=False))
