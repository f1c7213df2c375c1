"""Device resolution in one place (`trainlab.engine.device.resolve_device`), used by every command: `auto` picks
CUDA when available, else the CPU; a device this machine lacks is one line naming the flag and the fix."""

from __future__ import annotations

import ast
import dataclasses

import pytest
import torch
from conftest import REPO

from trainlab.commands.eval import FidConfig, JudgeConfig, KnnConfig
from trainlab.engine.device import resolve_device
from trainlab.errors import UsageError

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a machine without CUDA")


def test_auto_and_cpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_one_line(name: str) -> None:
    with pytest.raises(
        UsageError, match=rf"^--device {name}: CUDA is not available here; use --device cpu \(or auto\)$"
    ):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
def test_a_gpu_index_beyond_the_machine_is_refused() -> None:
    count = torch.cuda.device_count()
    with pytest.raises(UsageError, match=rf"only {count} CUDA device\(s\) here"):
        resolve_device(f"cuda:{count}")


def test_unknown_and_absent_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match=r"unknown --device 'gpu0'; use auto, cpu, cuda, cuda:N or mps"):
        resolve_device("gpu0")
    with pytest.raises(UsageError, match=r"unknown --sample-device 'xla'"):
        resolve_device("xla", flag="--sample-device")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(UsageError, match="MPS is not available here"):
        resolve_device("mps")


def test_every_command_default_is_auto_but_the_demos() -> None:
    for config in (KnnConfig, FidConfig, JudgeConfig):
        assert {f.name: f.default for f in dataclasses.fields(config)}["device"] == "auto", config


def test_no_module_resolves_a_device_setting_on_its_own() -> None:
    """No `torch.device(config.device)` and no second resolver outside engine/device.py (the planner reads the
    device *kind* a plan is for, where `auto` means a GPU: not this machine's device)."""
    found = []
    for path in sorted((REPO / "trainlab").rglob("*.py")):
        rel = str(path.relative_to(REPO / "trainlab"))
        if rel in ("engine/device.py", "commands/plan.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ("resolve_device", "torch_device"):
                found.append(f"{rel}:{node.lineno} defines {node.name}")
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "torch.device"
                and any(isinstance(a, ast.Attribute) and a.attr == "device" for a in node.args)
            ):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert found == []
