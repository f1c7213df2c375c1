"""The plan of MoCo under accumulation: the first pass is traced (its keys live through the step), and the plan says
whether accumulation keeps the loss (full-batch keys) or changes it (micro-batch keys), with the keys buffer and the
held micro-batches counted."""

from __future__ import annotations

import dataclasses

from trainlab.memory.planner import PlanRequest, plan
from trainlab.recipes.moco import MocoConfig, MocoRecipe
from trainlab.recipes.moco_plan import held_micro_batches_bytes, keys_bytes, moco_plan_notes


def _config(**kw: object) -> MocoConfig:
    return dataclasses.replace(MocoRecipe(MocoConfig()).debug_config(), **kw)  # type: ignore[arg-type]


def test_the_notes_say_what_accumulation_does_to_the_loss() -> None:
    full = moco_plan_notes(_config(batch_size=16, moco_keys="full-batch"), gpus=1, accumulation=4, micro=4)
    assert "the same loss" in full[0] and "16 keys" in full[0]
    assert "keys buffer" in full[1] and "host memory" in full[1]
    assert "BatchNorm" in full[2]
    micro = moco_plan_notes(_config(batch_size=16, moco_keys="micro-batch"), gpus=2, accumulation=2, micro=4)
    assert "a different loss" in micro[0] and "the 4 keys of its micro-batch" in micro[0]
    assert not any("keys buffer" in line for line in micro)
    whole = moco_plan_notes(_config(batch_size=16), gpus=1, accumulation=1, micro=16)
    assert whole == ["MoCo: one batch, the large batch's loss"]


def test_buffer_arithmetic() -> None:
    assert keys_bytes(4096, 256) == 2 * 4096 * 256 * 4  # 8 MiB: ViT-S at the paper's batch
    assert held_micro_batches_bytes(1024, 224) == 1024 * 2 * 3 * 224 * 224 * 4


def test_the_traced_step_runs_the_keys_pass() -> None:
    """A full-batch plan under accumulation traces the two-pass step (the keys exist during the micro-steps) and
    peaks at least as high as the micro-batch plan, which holds no keys of other micro-batches."""
    full = plan(MocoRecipe(_config(grad_accumulation=4)), PlanRequest(device="cpu", search=False))
    micro = plan(MocoRecipe(_config(grad_accumulation=4, moco_keys="micro-batch")), PlanRequest(device="cpu"))
    assert full.breakdown.grad_accumulation == 4 and full.breakdown.micro_batch == 4
    assert "the same loss" in full.notes[0] and "a different loss" in micro.notes[0]
    assert full.breakdown.peak_allocated_bytes >= micro.breakdown.peak_allocated_bytes
