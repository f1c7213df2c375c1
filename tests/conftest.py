"""Shared test helpers. Tests run on CPU with tiny models; fixtures from ../shared are optional (skip without)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TRAINLAB_SHARED", REPO.parent / "shared"))  # reference material

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def run_env() -> dict[str, str]:
    """Environment for subprocesses: this interpreter's package, quiet, 1 thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


@pytest.fixture
def python() -> str:
    return sys.executable
