"""What a run directory records about itself: the resolved config, git SHA and library versions."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
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


def environment() -> dict[str, Any]:
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


def write_config(run_dir: Path, recipe: str, config: dict[str, Any]) -> None:
    """`config.yaml`: the resolved config (re-runnable with --config) plus a provenance header."""
    text = yaml.safe_dump(config, sort_keys=False)
    env = environment()
    header = "".join(f"# {k}: {v}\n" for k, v in {"recipe": recipe, **env}.items())
    (run_dir / "config.yaml").write_text(header + text)
    (run_dir / "environment.yaml").write_text(yaml.safe_dump({"recipe": recipe, **env}, sort_keys=False))
