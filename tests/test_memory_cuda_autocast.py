"""CUDA autocast's cast policy substituted into CPU traces: op-level dtypes, and what it does to a VAR plan."""

# Shape legend: B batch, C channels.

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainlab.memory.breakdown import breakdown
from trainlab.memory.cuda_autocast import CudaAutocastPolicy
from trainlab.memory.trace import trace_training
from trainlab.recipes.var import VARRecipe

OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "layer_norm": lambda x: F.layer_norm(x, (x.shape[-1],)),
    "LayerNorm module": lambda x: torch.nn.LayerNorm(x.shape[-1])(x),
    "group_norm": lambda x: F.group_norm(x.unsqueeze(-1), 2),
    "softmax": lambda x: F.softmax(x, dim=-1),
    "Tensor.log_softmax": lambda x: x.log_softmax(-1),
    "Tensor.sum": lambda x: x.sum(),
    "torch.cumsum": lambda x: torch.cumsum(x, 0),
    "exp": torch.exp,
    "rsqrt": lambda x: x.rsqrt(),
    "x ** 2": lambda x: x**2,
    "logsumexp": lambda x: x.logsumexp(-1),
}


def _bf16_activation() -> tuple[torch.Tensor, torch.Tensor]:
    x_BC = torch.randn(4, 8, requires_grad=True)
    w_CC = torch.randn(8, 8)
    return x_BC, F.linear(x_BC, w_CC)  # call under autocast: a bf16 activation, as a linear layer's output


@pytest.mark.parametrize("op", list(OPS))
def test_cuda_policy_runs_in_fp32_what_cpu_autocast_leaves_in_bf16(op: str) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, h_BC = _bf16_activation()
        assert h_BC.dtype == torch.bfloat16
        assert OPS[op](h_BC).dtype == torch.bfloat16  # CPU autocast's own policy: the input's dtype
    with CudaAutocastPolicy(), torch.autocast("cpu", dtype=torch.bfloat16):
        x_BC, h_BC = _bf16_activation()
        out = OPS[op](h_BC)
        assert out.dtype == torch.float32  # CUDA's fp32 / fp32_set_opt_dtype policy
        out.float().sum().backward()
        assert x_BC.grad is not None and x_BC.grad.dtype == torch.float32


def test_cuda_policy_leaves_the_rest_alone() -> None:
    with CudaAutocastPolicy(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, h_BC = _bf16_activation()
        assert h_BC.dtype == torch.bfloat16  # lower-precision ops stay 16-bit
        assert h_BC.mean().dtype == torch.bfloat16  # mean is on neither list
        assert h_BC.softmax(-1, dtype=torch.bfloat16).dtype == torch.bfloat16  # an explicit dtype wins
        assert torch.ones(3, dtype=torch.long).sum().dtype == torch.int64  # not a float: not eligible
        y_BC = F.linear(F.layer_norm(h_BC, (8,)), torch.randn(8, 8))
        assert y_BC.dtype == torch.bfloat16  # the fp32 layer_norm output is cast back by the next linear
    with CudaAutocastPolicy():  # autocast off: nothing changes
        assert F.layer_norm(torch.randn(2, 8).bfloat16(), (8,)).dtype == torch.bfloat16
    with CudaAutocastPolicy(enabled=False), torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.softmax(torch.randn(2, 8).bfloat16(), -1).dtype == torch.bfloat16


def _var(tmp_path: Path, precision: str) -> VARRecipe:
    config = dataclasses.replace(VARRecipe(VARRecipe.config_class()).debug_config(), run_dir=tmp_path)
    return VARRecipe(dataclasses.replace(config, precision=precision))


def test_cuda_policy_in_a_var_plan(tmp_path: Path) -> None:
    """bf16 VAR on CUDA keeps fp32 layer-norm / softmax tensors for backward: more activation bytes than CPU rules.
    fp32 runs have no autocast, so the policy changes nothing."""
    amp = _var(tmp_path, "bf16-amp")
    micro = amp.config.batch_size

    def plan(recipe: VARRecipe, cuda_autocast: bool) -> tuple[int, int]:
        run = trace_training(recipe, device="cuda", micro_batch=micro, grad_accumulation=1, cuda_autocast=cuda_autocast)
        b = breakdown(run)
        return b.activations_bytes, b.peak_allocated_bytes

    cuda_rules, cpu_rules = plan(amp, True), plan(amp, False)
    assert cuda_rules[0] > cpu_rules[0] and cuda_rules[1] > cpu_rules[1]
    fp32 = _var(tmp_path, "fp32")
    assert plan(fp32, True) == plan(fp32, False)


def test_checkpoint_recomputation_casts_as_the_forward_did(tmp_path: Path) -> None:
    """Activation checkpointing recomputes the block in backward: the policy must be active there too (otherwise
    the recomputed tensors are 16-bit where the forward's were fp32, and checkpoint refuses the mismatch)."""
    recipe = _var(tmp_path, "bf16-amp")
    ckpt = VARRecipe(dataclasses.replace(recipe.config, activation_checkpointing=True))
    micro = recipe.config.batch_size
    with_ckpt = breakdown(trace_training(ckpt, device="cuda", micro_batch=micro, grad_accumulation=1))
    without = breakdown(trace_training(recipe, device="cuda", micro_batch=micro, grad_accumulation=1))
    assert with_ckpt.activations_bytes < without.activations_bytes


def test_plain_python_backward_keeps_the_policy() -> None:
    w_CC = torch.randn(8, 8, requires_grad=True)
    dtypes: list[torch.dtype] = []

    def block(x_BC: torch.Tensor) -> torch.Tensor:
        y_BC = F.layer_norm(F.linear(x_BC, w_CC), (8,))
        dtypes.append(y_BC.dtype)
        return y_BC

    with CudaAutocastPolicy(), torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute all of block
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.utils.checkpoint.checkpoint(block, torch.randn(4, 8), use_reentrant=False)
        out.float().sum().backward()
    assert dtypes == [torch.float32, torch.float32]  # forward, then the recomputation in backward
    assert w_CC.grad is not None


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("toy", {}), ("cifar", {}), ("tokenizer", {}), ("moco", {}), ("moco", {"model": "moco_vit_debug"})],
)
def test_every_recipe_traces_under_the_cuda_policy(name: str, overrides: dict[str, str], tmp_path: Path) -> None:
    """The policy only moves tensors up to fp32: a bf16 plan under it is not expected to need fewer bytes than under
    CPU's rules (and it must trace every recipe without error)."""
    from trainlab.recipes import get_recipe

    cls = get_recipe(name)
    config = dataclasses.replace(cls(cls.config_class()).debug_config(), run_dir=tmp_path, precision="bf16-amp")
    recipe = cls(dataclasses.replace(config, **overrides))
    micro = recipe.config.batch_size

    def plan(cuda_autocast: bool) -> tuple[int, int]:
        run = trace_training(recipe, device="cuda", micro_batch=micro, grad_accumulation=1, cuda_autocast=cuda_autocast)
        b = breakdown(run)
        return b.activations_bytes, b.peak_allocated_bytes

    cuda_rules, cpu_rules = plan(True), plan(False)
    assert cuda_rules[0] >= cpu_rules[0] and cuda_rules[1] >= cpu_rules[1]
