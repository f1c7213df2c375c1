"""Metamorphic properties of traced plans (debug CIFAR ResNet on fake tensors)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trainlab.memory.breakdown import Breakdown, breakdown
from trainlab.memory.trace import PlanDevice, trace_training
from trainlab.recipes.cifar import CifarConfig, CifarRecipe


def _plan(
    tmp_path: Path, micro: int, accumulation: int = 1, precision: str = "fp32", device: PlanDevice = "cpu"
) -> Breakdown:
    config = dataclasses.replace(CifarConfig(), model="cifar_resnet_debug", run_dir=tmp_path, precision=precision)
    run = trace_training(CifarRecipe(config), device=device, micro_batch=micro, grad_accumulation=accumulation)
    return breakdown(run)


def test_activations_grow_with_the_batch(tmp_path: Path) -> None:
    small, large = _plan(tmp_path, 8), _plan(tmp_path, 32)
    assert large.activations_bytes > 3 * small.activations_bytes
    assert large.peak_allocated_bytes > small.peak_allocated_bytes
    assert large.parameters_bytes == small.parameters_bytes


def test_bf16_autocast_needs_no_more_than_fp32(tmp_path: Path) -> None:
    fp32, bf16 = _plan(tmp_path, 16), _plan(tmp_path, 16, precision="bf16-amp")
    assert bf16.activations_bytes < fp32.activations_bytes
    assert bf16.peak_allocated_bytes <= fp32.peak_allocated_bytes


def test_accumulation_keeps_the_activation_peak_of_its_micro_batch(tmp_path: Path) -> None:
    one, two = _plan(tmp_path, 8), _plan(tmp_path, 8, accumulation=2)
    # equal up to the few bytes of per-micro-batch metric scalars kept for the step's average
    assert abs(one.activations_bytes - two.activations_bytes) <= 1e-3 * one.activations_bytes
    assert one.gradients_bytes == two.gradients_bytes


def test_cuda_plan_rounds_blocks_and_reserves_at_least_what_it_allocates(tmp_path: Path) -> None:
    cpu, cuda = _plan(tmp_path, 16), _plan(tmp_path, 16, device="cuda")
    assert cuda.peak_allocated_bytes >= cpu.peak_allocated_bytes
    assert cuda.peak_reserved_bytes >= cuda.peak_allocated_bytes
    assert cuda.peak_reserved_bytes % (2 * 1024 * 1024) == 0
