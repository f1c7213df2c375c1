"""`trainlab plan --fsdp`: the FSDP2 memory model's arithmetic, the planner's use of it and the command's inputs."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from torch import nn

from trainlab.cli import main
from trainlab.engine.debug import debug_run_config
from trainlab.engine.precision import Precision
from trainlab.memory.breakdown import CATEGORIES, Breakdown
from trainlab.memory.fsdp_memory import (
    FsdpSettings,
    ShardUnit,
    fsdp_memory,
    gathered_working_set,
    model_units,
    recipe_layout,
    shard_rows,
)
from trainlab.memory.gpus import gpu_profile
from trainlab.memory.planner import PlanRequest, plan
from trainlab.memory.trace import trace_training
from trainlab.recipes import get_recipe
from trainlab.recipes.var import VARRecipe

MIB = 2**20
FP32, BF16 = Precision.parse("fp32"), Precision.parse("bf16-amp")


def _unit(name: str, *shapes: tuple[int, ...], element_size: int = 4) -> ShardUnit:
    return ShardUnit(name, shapes, tuple(element_size for _ in shapes), tuple(True for _ in shapes))


def _breakdown(**at_peak: int) -> Breakdown:
    peak = dict.fromkeys(CATEGORIES, 0) | at_peak
    total = sum(peak.values())
    return Breakdown(
        device="cpu",
        micro_batch=8,
        grad_accumulation=1,
        parameters=0,
        parameters_bytes=peak["parameter"],
        gradients_bytes=peak["gradient"],
        optimizer_states_bytes=peak["optimizer_state"],
        activations_bytes=peak["activations"],
        frozen_bytes=peak["frozen"],
        peak_allocated_bytes=total,
        peak_reserved_bytes=total,
        at_peak=peak,
    )


def test_rows_are_padded_to_a_multiple_of_the_ranks() -> None:
    assert shard_rows((10, 3), 4) == 3  # 10 rows over 4 ranks: 12 rows, 3 each
    assert shard_rows((8,), 4) == 2
    assert shard_rows((), 4) == 1
    unit = _unit("u", (10, 3), (8,))
    assert unit.unsharded_bytes() == (30 + 8) * 4
    assert unit.sharded_bytes(4) == (3 * 3 + 2) * 4
    assert unit.sharded_bytes(4, element_size=2) == (3 * 3 + 2) * 2


def test_each_named_block_is_a_unit_and_the_root_takes_the_rest() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 8)])
            self.head = nn.Linear(8, 2)

    net = Net()
    blocks = list(net.blocks)
    units = model_units("net", net, blocks)
    assert [u.name for u in units] == ["net.0", "net.1", "net (root)"]
    assert units[0].unsharded_bytes() == 2 * (64 + 8) * 4
    assert units[2].unsharded_bytes() == ((4 * 8 + 8) + (8 * 2 + 2)) * 4
    assert sum(u.unsharded_bytes() for u in units) == sum(p.numel() * 4 for p in net.parameters())


def test_the_working_set_is_the_root_and_the_largest_pair_unless_nothing_reshards() -> None:
    units = [_unit("a", (4, 4)), _unit("b", (8, 4)), _unit("c", (2, 4)), _unit("root", (4,))]
    pair = (16 + 32) * 4  # a running, b prefetched (b's all-gather output: 8 rows over 2 ranks, no padding)
    assert gathered_working_set(units, 2, 4, reshard=True) == pair + 16
    assert gathered_working_set(units, 2, 4, reshard=False) == (16 + 32 + 8 + 4) * 4
    assert gathered_working_set(units, 2, 2, reshard=True) == (pair + 16) // 2  # gathered in a 16-bit compute dtype


def test_one_rank_holds_a_shard_of_the_states_and_the_working_set() -> None:
    blocks = [_unit(str(i), (256, 1024)) for i in range(4)]
    layout = {"model": [*blocks, _unit("root", (1024,))]}
    params = sum(u.unsharded_bytes() for u in layout["model"])
    b = _breakdown(parameter=params, optimizer_state=2 * params, activations=64 * MIB, frozen=3 * MIB)
    m = fsdp_memory(b, layout, FsdpSettings(world=4), FP32)
    assert m.sharded_parameters_bytes == params // 4
    assert m.sharded_optimizer_states_bytes == 2 * params // 4
    assert m.padding_bytes == 0
    block = 256 * 1024 * 4
    assert m.gathered_bytes == 2 * block + 1024 * 4
    assert m.reduce_scatter_bytes == block  # one block's gradient, fp32
    expected = b.peak_allocated_bytes - 3 * params + 3 * params // 4 + m.gathered_bytes + block
    assert m.peak_bytes == expected
    assert m.peak_bytes < b.peak_allocated_bytes


def test_options_move_the_bytes_where_fsdp2_puts_them() -> None:
    layout = {"model": [_unit(str(i), (1000, 100)) for i in range(3)] + [_unit("root", (10,))]}
    params = sum(u.unsharded_bytes() for u in layout["model"])
    b = _breakdown(parameter=params, optimizer_state=2 * params, gradient=params, activations=32 * MIB)
    on = fsdp_memory(b, layout, FsdpSettings(world=2), FP32)
    off = fsdp_memory(b, layout, FsdpSettings(world=2, reshard_after_forward=False), FP32)
    assert off.gathered_bytes > on.gathered_bytes and off.peak_bytes > on.peak_bytes
    offload = fsdp_memory(b, layout, FsdpSettings(world=2, cpu_offload=True), FP32)
    assert offload.host_bytes == 4 * (params // 2)  # parameters, gradients and two AdamW states
    assert offload.peak_bytes == on.peak_bytes - 3 * (params // 2) - on.gradients_at_peak_bytes
    amp = fsdp_memory(
        dataclasses.replace(b, at_peak=b.at_peak | {"autocast_copies": MIB}), layout, FsdpSettings(2), BF16
    )
    # the engine's MixedPrecisionPolicy gathers the fp32 weights; autocast still makes its 16-bit copies
    assert amp.gathered_bytes == on.gathered_bytes and amp.removed_bytes == on.removed_bytes
    assert on.gradients_at_peak_bytes == params // 2  # reduced each micro-batch: sharded
    accumulating = fsdp_memory(dataclasses.replace(b, grad_accumulation=2), layout, FsdpSettings(2), FP32)
    assert accumulating.gradients_at_peak_bytes == params  # micro-steps before the last do not synchronise


def _var(tmp_path: Path, **overrides: object) -> VARRecipe:
    config = debug_run_config(VARRecipe(VARRecipe.config_class()))
    return VARRecipe(dataclasses.replace(config, run_dir=tmp_path, depth=4, **overrides))


@pytest.mark.slow  # a full search with levers: about 10 traces
def test_fsdp_is_a_lever_when_ddp_does_not_fit(tmp_path: Path) -> None:
    recipe = _var(tmp_path)
    big = gpu_profile("1000GiB")
    ddp = plan(recipe, PlanRequest(device="cuda", gpu=big, gpus=2, search=False))
    sharded = plan(recipe, PlanRequest(device="cuda", gpu=big, gpus=2, fsdp=FsdpSettings(world=2), search=False))
    assert sharded.fsdp is not None and ddp.fsdp is None
    assert sharded.total_bytes < ddp.total_bytes
    assert sharded.overheads.ddp_buckets_bytes == 0 < ddp.overheads.ddp_buckets_bytes
    gpu = dataclasses.replace(big, total_bytes=(ddp.total_bytes + sharded.total_bytes) // 2)
    planned = plan(recipe, PlanRequest(device="cuda", gpu=gpu, gpus=2))
    lever = next(lv for lv in planned.levers if lv.name == "fsdp")
    assert planned.fits is False
    assert lever.fits is True
    largest = int(re.search(r"largest micro-batch (\d+)", lever.description).group(1))  # type: ignore[union-attr]
    ddp_largest = planned.max_micro_batch or 0
    assert largest > ddp_largest
    assert (f"(DDP: {ddp_largest})" if ddp_largest else "DDP does not fit at any micro-batch") in lever.description


TINY_VAR = [
    *(
        "--depth",
        "4",
        "--embed-dim",
        "64",
        "--num-heads",
        "2",
        "--patch-nums",
        "1",
        "2",
        "3",
        "4",
        "--image-size",
        "16",
    ),
    *("--vocab-size", "64", "--num-classes", "10", "--tokenizer-model", "vqvae_debug", "--batch-size", "8"),
]


def test_plan_fsdp_json_and_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["plan", "var", *TINY_VAR, "--device", "cpu", "--gpus", "2", "--run-dir", str(tmp_path)]
    assert main([*args, "--fsdp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fsdp"]["world"] == 2 and out["fsdp"]["units"] == 4 + 1
    assert out["total_bytes"] == out["fsdp"]["peak_bytes"]  # cpu: no allocator model, no overheads
    assert main([*args, "--fsdp", "--fsdp-reshard-after-forward", "false", "--fsdp-cpu-offload"]) == 0
    text = capsys.readouterr().out
    for row in ("sharded optimizer states 1/2 (host)", "all-gathered working set", "of shards on the host"):
        assert row in text


def test_fsdp_on_one_gpu_is_a_no_op_and_offload_needs_fsdp(capsys: pytest.CaptureFixture[str]) -> None:
    toy = ["plan", "toy", "--num-samples", "64", "--batch-size", "32", "--device", "cpu", "--json"]
    assert main([*toy, "--fsdp"]) == 0
    captured = capsys.readouterr()
    assert "no-op" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "fsdp" not in json.loads(captured.out)
    assert main([*toy, "--fsdp-cpu-offload"]) == 2
    err = capsys.readouterr().err
    assert "--fsdp-cpu-offload" in err and "add --fsdp" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("name", "changes"),
    [("toy", {}), ("var", {}), ("moco", {}), ("cifar", {"precision": "bf16"}), ("cifar", {"precision": "fp64"})],
)
def test_a_traced_build_gives_the_layout_a_build_of_its_own_gives(name: str, changes: dict[str, object]) -> None:
    """The planner takes the FSDP layout from the configured run's trace (`trace_training(layout=True)`) instead of
    building the recipe once more: the traced models are cast in place (BatchNorm kept fp32 under pure bf16), the
    layout is the build's all the same."""
    cls = get_recipe(name)
    recipe = cls(dataclasses.replace(debug_run_config(cls(cls.config_class())), **changes))
    traced = trace_training(recipe, device="cuda", micro_batch=2, grad_accumulation=1, layout=True)
    assert traced.layout == recipe_layout(recipe)
    assert trace_training(recipe, device="cuda", micro_batch=2, grad_accumulation=1).layout is None
