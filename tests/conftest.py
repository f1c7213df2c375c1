"""Shared test helpers. Tests run on CPU with tiny models; fixtures from ../shared are optional (skip without)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainlab.engine.compile import CPP_COMPILERS

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TRAINLAB_SHARED", REPO.parent / "shared"))  # reference material
VAR_FIXTURE = SHARED / "fixtures" / "var_official_d4.pt"

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_the_session_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The temporary files of the suite and its subprocesses (torchrun's log folders, wandb's staging folders, compiled
    kernels) go to a folder of this session, which pytest prunes with its others, instead of piling up in /tmp."""
    folder = str(tmp_path_factory.mktemp("tmp"))
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # read TMPDIR again
    yield
    if saved is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved
    tempfile.tempdir = None


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """A test that changes torch's thread count does not change the next test's float sums (reduction order)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# torch.compile on the CPU writes C++ kernels: tests that compile skip where no compiler is on PATH
needs_compiler = pytest.mark.skipif(
    not any(map(shutil.which, CPP_COMPILERS)), reason="torch.compile on the CPU needs a C++ compiler on PATH"
)


def with_fields(config: Any, changes: dict[str, Any]) -> Any:
    """`dataclasses.replace` that also takes dotted names of nested fields (`optim.learning_rate`)."""
    flat = {name: value for name, value in changes.items() if "." not in name}
    nested: dict[str, dict[str, Any]] = {}
    for dotted, value in changes.items():
        if "." in dotted:
            group, rest = dotted.split(".", 1)
            nested.setdefault(group, {})[rest] = value
    for group, values in nested.items():
        flat[group] = with_fields(flat.get(group, getattr(config, group)), values)
    return dataclasses.replace(config, **flat)


@pytest.fixture(scope="session")
def fx() -> dict[str, Any]:
    """The official VAR code's d4 parity fixture (inputs and outputs of every stage); skips the test without it."""
    if not VAR_FIXTURE.is_file():
        pytest.skip(f"official parity fixture {VAR_FIXTURE} absent (set TRAINLAB_SHARED=/path/to/shared)")
    fixture: dict[str, Any] = torch.load(VAR_FIXTURE, map_location="cpu", weights_only=False)  # our own file
    return fixture


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


def pytest_report_header(config: pytest.Config) -> str:
    from golden import machine_fingerprint, native_path

    machine = machine_fingerprint()
    native = native_path()
    return (
        f"golden runs: {machine['cpu'].get('model', '?')}, {machine['aten_cpu_capability']} kernels "
        f"{machine['kernel_env'] or ''}; native goldens {native.name} {'present' if native.is_file() else 'absent'}"
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help=(
            "rewrite the golden runs (tests/assets/golden_reference.json and golden_native/ for this machine) from "
            "this run; say why behaviour changed in the commit"
        ),
    )
