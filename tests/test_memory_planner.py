"""The planner's accounting of frozen models read from files, and its largest-micro-batch search."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from trainlab.cli import main
from trainlab.engine.debug import debug_run_config
from trainlab.errors import UsageError
from trainlab.memory.allocator import GIB
from trainlab.memory.breakdown import breakdown
from trainlab.memory.gpus import gpu_profile
from trainlab.memory.planner import largest_fitting, overheads
from trainlab.memory.trace import trace_training
from trainlab.models.var.convert import export_official, load_tokenizer
from trainlab.recipes.cifar import CifarConfig, CifarRecipe
from trainlab.recipes.var import VARRecipe


def test_a_tokenizer_read_from_a_file_is_one_frozen_model(tmp_path: Path) -> None:
    base = dataclasses.replace(debug_run_config(VARRecipe(VARRecipe.config_class())), run_dir=tmp_path)
    tokenizer = load_tokenizer("", "vqvae_debug", base.patch_nums, seed=base.seed)
    path = export_official(tokenizer, tmp_path / "tokenizer.pth")
    tokenizer_bytes = sum(t.numel() * t.element_size() for t in [*tokenizer.parameters(), *tokenizer.buffers()])
    from_file = dataclasses.replace(base, tokenizer_weights=str(path), tokenizer_model="auto")
    micro = base.batch_size
    with_file = breakdown(trace_training(VARRecipe(from_file), device="cpu", micro_batch=micro, grad_accumulation=1))
    built = breakdown(trace_training(VARRecipe(base), device="cpu", micro_batch=micro, grad_accumulation=1))
    assert with_file.at_peak["recipe_state"] == 0  # VAR keeps no EMA or momentum copy
    assert with_file.at_peak["frozen"] == tokenizer_bytes == with_file.frozen_bytes
    # the same tokenizer built in memory: reading it from a file costs no training memory
    assert with_file.peak_allocated_bytes == built.peak_allocated_bytes


def _step_total(m: int) -> int:
    """A bent, stepped, non-decreasing curve: activations in 2 MiB segments plus a jump at 100."""
    return 300 + 2 * ((m * 7 + 1) // 2) + (50 if m >= 100 else 0)


@pytest.mark.parametrize("capacity", [299, 302, 303, 500, 993, 1000, 1001, 1050, 1500, 2100, 2109, 2110])
def test_the_search_finds_the_boundary_in_few_traces(capacity: int) -> None:
    calls: list[int] = []

    def total_at(m: int) -> int:
        calls.append(m)
        return _step_total(m)

    upper = 256
    expected = max((m for m in range(1, upper + 1) if _step_total(m) <= capacity), default=0)
    assert largest_fitting(total_at, capacity, upper) == expected
    assert len(calls) == len(set(calls))  # every size traced at most once
    assert len(calls) <= 2 + 2 * 8  # the two ends, then at most one guess and its neighbour per halving


@pytest.mark.parametrize("capacity", [301, 307, 308, 1000, 1791, 2091, 2092])
def test_a_straight_line_takes_four_traces(capacity: int) -> None:
    calls: list[int] = []

    def total_at(m: int) -> int:
        calls.append(m)
        return 300 + 7 * m

    assert largest_fitting(total_at, capacity, 256) == min((capacity - 300) // 7, 256)
    assert len(calls) <= 4  # the two ends, the line's answer and its neighbour


def test_the_largest_micro_batch_fits_and_the_next_does_not(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    batch = 256
    config = dataclasses.replace(CifarConfig(), model="cifar_resnet_debug", run_dir=tmp_path, batch_size=batch)
    recipe = CifarRecipe(config)

    def predicted_total(m: int, capacity_gib: float) -> int:
        b = breakdown(trace_training(recipe, device="cuda", micro_batch=m, grad_accumulation=1 if m == batch else 2))
        gpu = gpu_profile(f"{capacity_gib}GiB")
        return b.peak_reserved_bytes + overheads("cuda", gpu, 1, b.gradients_bytes, b.uses_convolution).total

    ends = predicted_total(1, 1.0), predicted_total(batch, 1.0)
    assert ends[0] < ends[1]
    size_gib = round((ends[0] + ends[1]) / 2 / GIB, 6)  # a GPU between micro-batch 1 and the whole batch
    argv = ["plan", "cifar", "--model", "cifar_resnet_debug", "--batch-size", str(batch), "--gpu", f"{size_gib}GiB"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    m = out["max_micro_batch"]
    assert 1 < m < batch and out["fits"] is False
    assert out["gpu_bytes"] == int(size_gib * GIB)
    assert predicted_total(m, size_gib) <= out["gpu_bytes"] < predicted_total(m + 1, size_gib)
    assert batch % out["suggested_grad_accumulation"] == 0
    assert batch // out["suggested_grad_accumulation"] <= m


def test_weights_read_under_fake_tensors_are_checked_by_shape_only() -> None:
    """A plan reads a weights file under fake tensors: shapes and dtypes exist, values do not. The finite-value check
    must not read placeholders (it called a real file non-finite, depending on what the process had run before)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainlab.user_files import check_state_dict

    with FakeTensorMode():
        weight_OI = torch.randn(3, 4)
        check_state_dict({"weight": weight_OI}, {"weight": weight_OI}, source="weights w.pth")
        with pytest.raises(UsageError, match="has shape"):
            check_state_dict({"weight": torch.randn(4, 3)}, {"weight": weight_OI}, source="weights w.pth")


def test_the_search_starts_at_the_smallest_micro_batch_the_model_trains_on() -> None:
    """BatchNorm refuses a training batch of one: the search never traces m = 1 when told the model needs 2."""
    calls: list[int] = []

    def total_at(m: int) -> int:
        calls.append(m)
        if m < 2:
            raise AssertionError("traced a micro-batch BatchNorm refuses")
        return 100 * m

    assert largest_fitting(total_at, 550, 16, lower=2) == 5
    assert largest_fitting(total_at, 150, 16, lower=2) == 0  # even 2 does not fit
    assert min(calls) == 2


@pytest.mark.parametrize(("capacity", "expected"), [(350, 3), (250, 2), (150, 1), (50, 0)])
def test_the_smallest_micro_batch_is_traced_only_when_the_next_does_not_fit(capacity: int, expected: int) -> None:
    """Micro-batch 1 is traced for real (outside the fit): where 2 fits, 1 does too, and is not traced."""
    calls: list[int] = []

    def total_at(m: int) -> int:
        calls.append(m)
        return 100 * m

    assert largest_fitting(total_at, capacity, 16) == expected
    assert (1 in calls) == (expected < 2)


@pytest.mark.parametrize(("capacity", "smallest", "expected", "asked"), [(550, 2, 5, False), (150, 1, 1, True)])
def test_the_smallest_micro_batch_is_found_only_where_2_does_not_fit(
    capacity: int, smallest: int, expected: int, asked: bool
) -> None:
    """Every model trains on micro-batch 2: the first forward at micro-batch 1 that finds the smallest is run only
    where 2 does not fit."""
    asks: list[bool] = []

    def lower() -> int:
        asks.append(True)
        return smallest

    assert largest_fitting(lambda m: 100 * m, capacity, 16, lower=lower) == expected
    assert bool(asks) == asked
    assert largest_fitting(lambda m: 100 * m, 150, 16, lower=lambda: 2) == 0


def test_a_batchnorm_model_on_a_tiny_gpu_is_planned_down_to_micro_batch_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "moco", "--config", "moco_v3_digits", "--device", "cuda", "--gpu", "0.1"]) == 0
    captured = capsys.readouterr()
    assert "does not fit even at micro-batch 2" in captured.err
