"""`--activation-checkpointing` for VAR: per-block recomputation gives the same loss and gradients, and less memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import golden
import pytest
import torch

from trainlab.cli import main
from trainlab.engine.recipe import StepInfo, apply_activation_checkpointing
from trainlab.engine.seeding import seed_everything
from trainlab.memory.breakdown import breakdown
from trainlab.memory.gpus import gpu_profile
from trainlab.memory.planner import PlanRequest, overheads, plan
from trainlab.memory.trace import trace_training
from trainlab.recipes.var import VARRecipe


def _recipe(tmp_path: Path, checkpointing: bool, **overrides: object) -> VARRecipe:
    base = VARRecipe(VARRecipe.config_class()).debug_config()
    config = dataclasses.replace(base, run_dir=tmp_path, activation_checkpointing=checkpointing, **overrides)
    return VARRecipe(config)


def _loss_and_gradients(recipe: VARRecipe) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    seed_everything(recipe.config.seed)
    parts = recipe.build(torch.device("cpu"))
    assert apply_activation_checkpointing(recipe, parts) == ["var"]  # what the engine does after building
    var = parts.models["var"].train()
    assert var.grad_checkpointing == recipe.config.activation_checkpointing
    batch = recipe.example_batch(4)
    info = StepInfo(step=0, total_steps=10, steps_per_epoch=10, epoch=0, log_now=True)
    torch.manual_seed(1)  # class dropout and drop path draw from the global RNG
    loss = recipe.train_step({**parts.models, **parts.frozen}, batch, "main", info)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in var.named_parameters() if p.grad is not None}


def test_checkpointing_gives_the_same_loss_and_gradients(tmp_path: Path) -> None:
    # drop path on: the recomputed forward must draw the same stochastic-depth masks
    loss, grads = _loss_and_gradients(_recipe(tmp_path, False, drop_path_rate=0.2))
    loss_ckpt, grads_ckpt = _loss_and_gradients(_recipe(tmp_path, True, drop_path_rate=0.2))
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys() and len(grads) > 10
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=0, atol=0, msg=name)


def test_training_with_checkpointing_reproduces_the_golden_var_run(tmp_path: Path) -> None:
    got = golden.run_case("var", tmp_path, precision="fp64", activation_checkpointing=True)
    reference = golden.load_json(golden.REFERENCE)
    exact = reference["recorded_on"] == golden.machine_fingerprint()  # bit for bit where the reference was recorded
    problems = golden.differences(got, reference["cases"]["var"], 0.0 if exact else golden.REFERENCE_RTOL)
    assert not problems, "; ".join(problems)  # every loss, eval metric and the final weights


def test_checkpointing_lowers_the_planned_peak(tmp_path: Path) -> None:
    plain, ckpt = (
        breakdown(trace_training(_recipe(tmp_path, c), device="cpu", micro_batch=16, grad_accumulation=1))
        for c in (False, True)
    )
    assert ckpt.activations_bytes < plain.activations_bytes / 2
    assert ckpt.peak_allocated_bytes < plain.peak_allocated_bytes
    assert ckpt.parameters_bytes == plain.parameters_bytes
    assert ckpt.optimizer_states_bytes == plain.optimizer_states_bytes


def test_the_planner_predicts_the_lever(tmp_path: Path) -> None:
    gpu = gpu_profile("48GiB")
    result = plan(_recipe(tmp_path, False), PlanRequest(device="cuda", gpu=gpu))
    lever = next(lv for lv in result.levers if lv.name == "activation checkpointing")
    micro = result.breakdown.micro_batch
    traced = breakdown(trace_training(_recipe(tmp_path, True), device="cuda", micro_batch=micro, grad_accumulation=1))
    extra = overheads("cuda", gpu, 1, traced.gradients_bytes, traced.uses_convolution).total
    assert lever.total_bytes == traced.peak_reserved_bytes + extra
    assert traced.peak_allocated_bytes < result.breakdown.peak_allocated_bytes
    assert lever.fits is True and "--activation-checkpointing" in lever.description
    with_flag = plan(_recipe(tmp_path, True), PlanRequest(device="cuda", gpu=gpu))
    assert with_flag.activation_checkpointing and with_flag.total_bytes == lever.total_bytes
    assert all(lv.name != "activation checkpointing" for lv in with_flag.levers)  # already on


def test_a_recipe_without_it_refuses_the_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for command in ("train", "plan"):
        assert main([command, "toy", "--activation-checkpointing", "--device", "cpu", "--run-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert "--activation-checkpointing is not implemented by recipe 'toy'" in err and len(err.splitlines()) == 1
