"""Per-GPU memory under FSDP2 (`trainlab plan ... --fsdp --gpus N`): the traced step with the model states sharded.

The planner traces one process's step (micro-batch per rank, as under DDP); this module turns that breakdown into
what one of N FSDP2 ranks holds, over the parameter layout of the shard units (`fully_shard` per block, then the
root, which takes the parameters no block holds). The model, for torch 2.14's FSDP2:

- Units: the recipe's `TrainParts.shard_units` per trained model, then the root.
- Sharding: every parameter is split on dim 0, padded to a multiple of N rows; rank 0 (the fullest) holds
  ceil(rows / N) rows of it. Its sharded parameter, its sharded gradient and each optimizer state are that size
  (the padding is counted). Buffers are not sharded; frozen models (the tokenizer) are not sharded; averaged and
  momentum copies are sharded like the model they follow.
- Gathered working set: with the default prefetch, the unit that runs and the next one are all-gathered (forward
  and backward; the next one as its padded all-gather output until its copy-out), in the MixedPrecisionPolicy's
  parameter dtype (`engine.fsdp.fsdp_policy`: the weights' own dtype, so under the -amp modes autocast still makes
  its per-op 16-bit weight copies, as traced; a policy that gathered in the autocast dtype would drop them); the
  root stays gathered from its forward to its backward. Without reshard-after-forward every unit stays gathered
  after its forward.
- Reduce-scatter: the gradient of one unit, padded, in the policy's reduce dtype (the weights' dtype), beside the
  unit's unsharded gradient. Gradients that the traced peak holds are sharded (1/N) when each micro-batch reduces
  them; under accumulation the micro-steps before the last do not synchronise (`engine.fsdp.set_gradient_sync`),
  so their gradients stay unsharded.
- CPU offload: sharded parameters, gradients and optimizer states live on the host (FSDP2's CPUOffloadPolicy); the
  GPU keeps the gathered working set, the reduce-scatter buffers and the activations.

Activations, batch, temporaries and buffers are the traced ones: activations are per rank, as with DDP.
Legend: N ranks (GPUs), rows: a parameter's dim 0.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainlab.engine.fsdp import fsdp_policy
from trainlab.engine.precision import Precision
from trainlab.engine.recipe import Recipe, TrainParts
from trainlab.memory.breakdown import Breakdown
from trainlab.user_files import shapes_only


@dataclass(frozen=True)
class ShardUnit:
    """The parameters one `fully_shard` call manages: shapes and element sizes (the last unit of a model: its root)."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    element_sizes: tuple[int, ...]
    trained: tuple[bool, ...]  # requires_grad

    def unsharded_bytes(self, element_size: int | None = None) -> int:
        """Bytes of the gathered parameters (each in `element_size` when given, e.g. the compute dtype)."""
        return sum(math.prod(s) * (element_size or e) for s, e in zip(self.shapes, self.element_sizes, strict=True))

    def sharded_bytes(self, world: int, element_size: int | None = None, trained_only: bool = False) -> int:
        """Bytes rank 0 holds of this unit's parameters: ceil(rows / N) rows each (the padded shard)."""
        return sum(
            shard_rows(s, world) * _row_numel(s) * (element_size or e)
            for s, e, t in zip(self.shapes, self.element_sizes, self.trained, strict=True)
            if t or not trained_only
        )

    def trained_bytes(self) -> int:
        return sum(math.prod(s) * e for s, e, t in zip(self.shapes, self.element_sizes, self.trained, strict=True) if t)


def shard_rows(shape: Sequence[int], world: int) -> int:
    """Rows of a parameter on rank 0: ceil(rows / N) (a 0-dim parameter counts as one row)."""
    rows = shape[0] if shape else 1
    return -(-rows // world)


def _row_numel(shape: Sequence[int]) -> int:
    return math.prod(shape[1:]) if shape else 1


def padded_unit_bytes(unit: ShardUnit, world: int, element_size: int) -> int:
    """The unit's all-gather output (or reduce-scatter input): N padded shards, in `element_size`."""
    return world * unit.sharded_bytes(world, element_size)


def unit_of(name: str, params: Sequence[nn.Parameter]) -> ShardUnit:
    return ShardUnit(
        name=name,
        shapes=tuple(tuple(p.shape) for p in params),
        element_sizes=tuple(p.element_size() for p in params),
        trained=tuple(p.requires_grad for p in params),
    )


def model_units(name: str, model: nn.Module, blocks: Sequence[nn.Module]) -> list[ShardUnit]:
    """The shard units of one model: each block's parameters (in the given order, the forward order), then the root
    with every parameter no block holds."""
    claimed: set[int] = set()
    units: list[ShardUnit] = []
    for index, block in enumerate(blocks):
        params = [p for p in block.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        if params:
            units.append(unit_of(f"{name}.{index}", params))
    root = [p for p in model.parameters() if id(p) not in claimed]
    units.append(unit_of(f"{name} (root)", root))
    return units


@dataclass(frozen=True)
class FsdpSettings:
    """`--fsdp` with its options, as planned."""

    world: int
    reshard_after_forward: bool = True
    cpu_offload: bool = False


@dataclass(frozen=True)
class FsdpMemory:
    """What one FSDP2 rank holds at the traced peak (bytes; rank 0, the fullest).

    Attributes:
        sharded_parameters_bytes, sharded_gradients_bytes, sharded_optimizer_states_bytes: the model states' shards
            (on the host, not counted in `peak_bytes`, with CPU offload).
        padding_bytes: of the sharded parameters, what rank 0 holds beyond 1/N of them (rows padded to N).
        gathered_bytes: the all-gathered parameters at the peak (compute dtype), prefetch included.
        reduce_scatter_bytes: one unit's padded gradient in the reduce dtype.
        gradients_at_peak_bytes: gradients the traced peak holds, sharded or (accumulating micro-steps) not.
        momentum_copies_bytes: averaged / momentum copies and the loss scale, sharded like the model.
        host_bytes: what CPU offload keeps on the host.
        removed_bytes: the traced peak's unsharded parameters, gradients, states and momentum copies (and autocast's
            weight copies where the policy gathers in the autocast dtype).
        peak_bytes: the traced peak of live tensors with those replaced.
        units: shard units of all trained models (roots included); largest_unit_bytes: the largest, unsharded.
    """

    world: int
    sharded_parameters_bytes: int
    sharded_gradients_bytes: int
    sharded_optimizer_states_bytes: int
    padding_bytes: int
    gathered_bytes: int
    reduce_scatter_bytes: int
    gradients_at_peak_bytes: int
    momentum_copies_bytes: int
    host_bytes: int
    removed_bytes: int
    peak_bytes: int
    units: int
    largest_unit_bytes: int


def gathered_working_set(units: Sequence[ShardUnit], world: int, element_size: int, reshard: bool) -> int:
    """Gathered parameters of one model at the activation peak, in `element_size` bytes per element.

    With reshard-after-forward: the root (gathered from its forward to its backward) plus the largest neighbouring
    pair of blocks: the one that runs, unsharded, and the prefetched one, as its all-gather output (padded; its
    copy-out into unsharded parameters frees that buffer). Without it: every unit stays gathered from its forward
    to its backward."""
    *blocks, root = units
    sizes = [u.unsharded_bytes(element_size) for u in blocks]
    padded = [padded_unit_bytes(u, world, element_size) for u in blocks]
    if not reshard:
        return sum(sizes) + root.unsharded_bytes(element_size)
    pair = max((a + b for a, b in zip(sizes, padded[1:], strict=False)), default=sum(sizes))
    return root.unsharded_bytes(element_size) + pair


def fsdp_memory(
    b: Breakdown,
    layout: Mapping[str, list[ShardUnit]],
    settings: FsdpSettings,
    precision: Precision,
) -> FsdpMemory:
    """One rank's bytes at the traced peak under FSDP2 (see the module docstring).

    Args:
        b: the breakdown of the traced step at the per-rank micro-batch (one process, no DDP buckets).
        layout: trained model name -> its shard units (`model_units`), the root last.
        settings: world size, reshard-after-forward, CPU offload.
        precision: the run's precision mode, mapped to FSDP2's MixedPrecisionPolicy as the engine maps it.
    """
    n = settings.world
    units = [u for model in layout.values() for u in model]
    unsharded = sum(u.unsharded_bytes() for u in units)
    trained = sum(u.trained_bytes() for u in units)
    sharded = sum(u.sharded_bytes(n) for u in units)
    sharded_trained = sum(u.sharded_bytes(n, trained_only=True) for u in units)
    ratio = sharded / unsharded if unsharded else 1.0
    states = round(b.optimizer_states_bytes * sharded_trained / trained) if trained else 0
    policy = fsdp_policy(precision)
    master = max((e for u in units for e in u.element_sizes), default=4)
    gathered_element = _element_size(policy.param_dtype, master)
    reduce_element = _element_size(policy.reduce_dtype, master)
    # autocast's weight copies vanish only where the gathered weights are already in the autocast dtype
    copies_removed = policy.param_dtype is not None and policy.param_dtype == precision.autocast_dtype
    gathered = sum(
        gathered_working_set(model, n, gathered_element, settings.reshard_after_forward)
        for model in layout.values()
        if model
    )
    reduce_scatter = max((padded_unit_bytes(u, n, reduce_element) for u in units if any(u.trained)), default=0)
    p = b.at_peak
    accumulating = b.grad_accumulation > 1  # the peak micro-step does not synchronise: gradients stay whole
    gradients_at_peak = p["gradient"] if accumulating else round(p["gradient"] * ratio)
    if settings.cpu_offload and not accumulating:
        gradients_at_peak = 0  # the sharded gradients are copied to the host as they are reduced
    # momentum copies inside a sharded model (MoCo's momentum encoder, no gradient) are in `sharded` already; the
    # rest of the recipe state (averaged copies of the model, the loss scale) is sharded like the model
    untrained = unsharded - trained
    momentum = round(max(p["recipe_state"] - untrained, 0) * ratio)
    removed = p["parameter"] + p["gradient"] + p["optimizer_state"] + p["recipe_state"]
    removed += p["autocast_copies"] if copies_removed else 0
    resident = 0 if settings.cpu_offload else sharded + states
    host = sharded + sharded_trained + states if settings.cpu_offload else 0
    peak = b.peak_allocated_bytes - removed + resident + gradients_at_peak + momentum + gathered + reduce_scatter
    largest = max((u.unsharded_bytes() for u in units), default=0)
    return FsdpMemory(
        world=n,
        sharded_parameters_bytes=sharded,
        sharded_gradients_bytes=sharded_trained,
        sharded_optimizer_states_bytes=states,
        padding_bytes=sharded - -(-unsharded // n),
        gathered_bytes=gathered,
        reduce_scatter_bytes=reduce_scatter,
        gradients_at_peak_bytes=gradients_at_peak,
        momentum_copies_bytes=momentum,
        host_bytes=host,
        removed_bytes=removed,
        peak_bytes=peak,
        units=len(units),
        largest_unit_bytes=largest,
    )


def _element_size(dtype: torch.dtype | None, weights: int) -> int:
    return weights if dtype is None else dtype.itemsize


FsdpLayout = dict[str, list[ShardUnit]]  # trained model name -> its shard units


def recipe_layout(recipe: Recipe[Any]) -> FsdpLayout:
    """The shard units of the recipe's trained models, built once on fake tensors inside `shapes_only` (no memory,
    no weights file needed).

    The units are the recipe's `TrainParts.shard_units` (none named: the root only), as `--fsdp` shards them. Pure
    16-bit modes hold their floating parameters in that dtype."""
    from trainlab.memory.tracer import StorageTracer, tracing

    precision = Precision.parse(recipe.config.precision)
    with shapes_only(), tracing(StorageTracer()), torch.random.fork_rng(devices=[]), precision.default_dtype():
        return parts_layout(recipe.build(torch.device("cpu")), precision)


def parts_layout(parts: TrainParts, precision: Precision) -> FsdpLayout:
    """The shard units of built parts' trained models (a traced run's, `trace_training(layout=True)`, or a build's),
    their floating parameters in the weights' dtype under the pure 16-bit modes."""
    trained = {name for phase in parts.phases for name in phase.modules}
    layout: dict[str, list[ShardUnit]] = {}
    for name, model in parts.models.items():
        if name not in trained:
            continue
        units = model_units(name, model, parts.shard_units.get(name, []))
        if precision.casts_weights:
            size = precision.param_dtype.itemsize
            units = [dataclasses.replace(u, element_sizes=tuple(size for _ in u.element_sizes)) for u in units]
        layout[name] = units
    return layout


class FsdpPlanner:
    """The planner's FSDP mode: one layout per recipe, a per-rank total per traced breakdown."""

    def __init__(self, recipe: Recipe[Any], settings: FsdpSettings, layout: FsdpLayout | None = None) -> None:
        """`layout`: the recipe's `recipe_layout` where the caller holds it (else it is built here)."""
        self.settings = settings
        self.layout = layout if layout is not None else recipe_layout(recipe)
        self.precision = Precision.parse(recipe.config.precision)

    def memory(self, b: Breakdown, world: int | None = None) -> FsdpMemory:
        settings = self.settings if world is None else dataclasses.replace(self.settings, world=world)
        return fsdp_memory(b, self.layout, settings, self.precision)

    def reserved(self, b: Breakdown, world: int | None = None) -> int:
        """The rank's reserved peak: its live peak plus the fragmentation the allocator model found for the traced
        step (reserved minus allocated)."""
        return self.memory(b, world).peak_bytes + b.peak_reserved_bytes - b.peak_allocated_bytes


def breakdown_rows(m: FsdpMemory) -> list[tuple[str, int]]:
    """Rows of the plan's table for the FSDP rank (bytes)."""
    where = " (host)" if m.host_bytes else ""
    return [
        (f"sharded parameters 1/{m.world}{where}", m.sharded_parameters_bytes),
        (f"  of which padding to {m.world} rows", m.padding_bytes),
        (f"sharded gradients 1/{m.world}{where}", m.sharded_gradients_bytes),
        (f"sharded optimizer states 1/{m.world}{where}", m.sharded_optimizer_states_bytes),
        ("gradients at the peak", m.gradients_at_peak_bytes),
        ("all-gathered working set", m.gathered_bytes),
        ("reduce-scatter buffer", m.reduce_scatter_bytes),
        ("momentum / EMA copies (sharded)", m.momentum_copies_bytes),
        ("unsharded states replaced", -m.removed_bytes),
    ]
