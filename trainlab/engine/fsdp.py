"""`--fsdp`: FSDP2 sharding of the trained models (`torch.distributed.fsdp.fully_shard`).

Under torchrun every trained model is sharded block by block (the recipe names its blocks in
`TrainParts.shard_units`), then the rest of the model as its root unit, over a one-dimensional mesh of all processes:
each rank keeps 1/N of every parameter, gradient and optimizer state, all-gathers a block's parameters for its
forward and backward, and reduce-scatters its gradients. The precision mode maps to FSDP2's `MixedPrecisionPolicy`
(`fsdp_policy`: the weights' own dtype, autocast as without sharding). Frozen models are not sharded; an averaged
copy is sharded like the model it follows, so that its update runs on the local shards (FSDP2 shards each parameter
along dim 0 alike, whatever the units).

The engine guarantees hold as under DDP: gradient sync only on the last micro-step (`set_gradient_sync`), the
gradient norm of the sharded gradients is the global one (DTensor), overflow skips are decided on every rank alike
(`agree_on_overflow`). What rank 0 does alone (evaluation, exports) runs on whole copies (`Sharding.whole`: every
rank gathers the shards, rank 0 rebuilds plain models from their meta-device templates). Under `--fsdp` a checkpoint
is a folder every rank writes its own shards into (`engine.sharded_checkpoint`, read back straight into the shards,
resharded for another number of processes); a whole-tensor checkpoint (written without `--fsdp`) is sharded as it
is loaded (`load_full_state`). Either resumes on any number of processes, with or without `--fsdp`. In one process
`--fsdp` shards nothing (logged), and its checkpoints are folders all the same.

Tensor names: `full` is the unsharded tensor, `local` this rank's shard.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from trainlab.engine.precision import LossScaler, Precision
from trainlab.engine.recipe import TrainParts

log = logging.getLogger(__name__)


@dataclass
class Sharding:
    """What `shard_run` sharded: the plain structure of each sharded model and averaged copy, by name."""

    templates: dict[str, nn.Module] = field(default_factory=dict)

    def whole(self, models: Mapping[str, nn.Module], device: torch.device, keep: bool) -> dict[str, nn.Module]:
        """`models` with every sharded one replaced by its `whole_copy` where `keep` (rank 0). Collective."""
        out = dict(models)
        for name, template in self.templates.items():
            if name in models:
                whole = whole_copy(template, models[name], device, keep)
                if whole is not None:
                    out[name] = whole
        return out


def check_shard_units(parts: TrainParts) -> None:
    """Refuse a `TrainParts.shard_units` the engine cannot shard: a key that is no trained model, a unit that is not
    a submodule of its model (or is the model itself), a unit named twice, a unit named after one that holds it
    (FSDP2 shards from the inside out).

    Raises:
        ValueError: naming the model and the unit (a recipe bug, not a user error).
    """
    for name, units in parts.shard_units.items():
        model = parts.models.get(name)
        if model is None:
            raise ValueError(f"shard_units names {name!r}, which is not a trained model ({', '.join(parts.models)})")
        path = {id(module): sub for sub, module in model.named_modules() if sub}
        seen: dict[int, str] = {}
        for unit in units:
            if id(unit) not in path:
                raise ValueError(f"shard_units[{name!r}] holds a {type(unit).__name__} that is no submodule of it")
            if id(unit) in seen:
                raise ValueError(f"shard_units[{name!r}] names {path[id(unit)]} twice")
            seen[id(unit)] = path[id(unit)]
        order = {id(unit): i for i, unit in enumerate(units)}
        for i, unit in enumerate(units):
            later = [path[id(m)] for m in unit.modules() if m is not unit and order.get(id(m), -1) > i]
            if later:
                raise ValueError(
                    f"shard_units[{name!r}]: {later[0]} is inside {path[id(unit)]}, named before it; name the inner "
                    "block first"
                )


def unit_names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    """The dotted paths of `units` inside `model` (for the log and the planner)."""
    path = {id(module): sub for sub, module in model.named_modules()}
    return [path[id(unit)] for unit in units]


def fsdp_policy(precision: Precision) -> MixedPrecisionPolicy:
    """The precision mode as FSDP2's policy: parameters are gathered and gradients reduced in the weights' dtype
    (fp32 under the -amp modes, fp64 in the reference). Autocast casts the gathered fp32 weights per operation, as
    without `--fsdp`: gathering them in the autocast dtype instead would halve the all-gather but break the fp32
    islands recipes keep under autocast (VAR's embeddings and head), and change the numbers of the unsharded run.
    The pure 16-bit modes are refused with `--fsdp` (`TrainConfig.validate`)."""
    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None)


def describe_policy(policy: MixedPrecisionPolicy) -> str:
    def name(dtype: torch.dtype | None) -> str:
        return "the weights' dtype" if dtype is None else str(dtype).removeprefix("torch.")

    return f"parameters gathered in {name(policy.param_dtype)}, gradients reduced in {name(policy.reduce_dtype)}"


def shard_run(
    parts: TrainParts,
    averaged: dict[str, nn.Module],
    *,
    precision: Precision,
    device: torch.device,
    world: int,
    reshard_after_forward: bool,
    cpu_offload: bool,
) -> Sharding | None:
    """Shard the trained models (and the averaged copies that follow them) in place, and point each phase's
    optimizer at the sharded parameters. Returns what was sharded (None in one process, or nothing to shard).

    Call it after the precision mode is applied and every model is on the device, before the optimizers hold state.
    """
    check_shard_units(parts)
    if world <= 1:
        log.info("--fsdp in one process: nothing to shard, the models train whole (launch with torchrun to shard)")
        return None
    mesh = init_device_mesh(device.type, (world,))
    policy = fsdp_policy(precision)
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": policy,
        "offload_policy": offload,
        "reshard_after_forward": reshard_after_forward,
    }
    trained = {name for phase in parts.phases for name in phase.modules}
    sharding = Sharding()
    for name, model in parts.models.items():
        if name not in trained or not any(p.requires_grad for p in model.parameters()):
            continue
        units = unit_names(model, parts.shard_units.get(name, []))
        before = {id(p): key for key, p in model.named_parameters()}
        sharding.templates[name] = meta_copy(model)
        _shard(model, units, options)
        after = dict(model.named_parameters())
        for phase in parts.phases:
            for group in phase.optimizer.param_groups:
                group["params"] = [after[before[id(p)]] if id(p) in before else p for p in group["params"]]
        for copy_name, spec in parts.averaged.items():
            if spec.follows == name:
                sharding.templates[copy_name] = meta_copy(averaged[copy_name])
                _shard(averaged[copy_name], units, options)
        shown = ", ".join(units[:3]) + (" ..." if len(units) > 3 else "")
        log.info(
            "fsdp: %s sharded over %d processes: %s",
            name,
            world,
            f"{len(units)} blocks ({shown}), then the root" if units else "as one unit (the recipe names no blocks)",
        )
    if not sharding.templates:
        return None
    log.info(
        "fsdp: %s; parameters resharded after forward: %s; CPU offload: %s",
        describe_policy(policy),
        "yes" if reshard_after_forward else "no (kept gathered until backward)",
        "parameter, gradient and optimizer-state shards on the host" if cpu_offload else "no",
    )
    return sharding


def _shard(model: nn.Module, units: list[str], options: dict[str, Any]) -> None:
    for path in units:
        fully_shard(model.get_submodule(path), **options)
    fully_shard(model, **options)
    # FSDP2 makes the first unit to run forward the root: settle it now, so that a unit a recipe calls on its own
    # before the model's first forward (MoCo's momentum encoder for the keys) stays a unit inside this root
    model._get_fsdp_state()._lazy_init()  # type: ignore[operator]


def _fsdp_modules(models: Mapping[str, nn.Module]) -> list[FSDPModule]:
    return [m for model in models.values() for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def set_gradient_sync(models: Mapping[str, nn.Module], enabled: bool) -> None:
    """Reduce-scatter gradients in this backward (the last micro-step) or keep accumulating them unsharded."""
    for model in models.values():
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled)


def meta_copy(model: nn.Module) -> nn.Module:
    """`model`'s structure without its memory (every parameter and buffer on the meta device): the template from
    which `whole_copy` rebuilds a plain model after sharding."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for value in [*module.parameters(recurse=False), *module.buffers(recurse=False), *vars(module).values()]:
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                meta = torch.empty_like(value, device="meta")
                memo[id(value)] = nn.Parameter(meta, value.requires_grad) if isinstance(value, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def whole_copy(template: nn.Module, live: nn.Module, device: torch.device, keep: bool) -> nn.Module | None:
    """A plain (unsharded) model with `live`'s current weights, built from its `meta_copy` where `keep` (rank 0), for
    what one rank does alone (evaluation, exports). Collective: every rank calls it, the shards are gathered whole.
    Buffers (persistent or not) and tensor attributes are `live`'s own (buffers are never sharded)."""
    full = full_state(live.state_dict(), keep)
    if not keep:
        return None
    model = copy.deepcopy(template).to_empty(device=device)
    model.load_state_dict(full)
    del full
    for copied, module in zip(model.modules(), live.modules(), strict=True):
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                setattr(copied, key, value)
        for key, buffer in module.named_buffers(recurse=False):
            copied.register_buffer(key, buffer, persistent=key not in module._non_persistent_buffers_set)
    return model.train(live.training)


def agree_on_overflow(scaler: LossScaler, optimizer: torch.optim.Optimizer) -> None:
    """After `scaler.unscale_`: GradScaler found inf / NaN in this rank's shards only; make every rank skip alike."""
    grad_scaler = scaler.grad_scaler
    if grad_scaler is None or not torch.distributed.is_initialized():
        return
    state = grad_scaler._per_optimizer_states[id(optimizer)]
    for found_inf in state["found_inf_per_device"].values():
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)


def full_state(state: Any, keep: bool = True) -> Any:
    """A (nested) state dict with every sharded tensor gathered whole into host memory, one tensor at a time
    (collective under `--fsdp`: every rank calls it with the same structure); where not `keep` (the ranks that do not
    write) the gathered tensors are dropped (None); anything else as it is."""
    if isinstance(state, DTensor):
        full = state.full_tensor()
        return full.cpu() if keep else None
    if isinstance(state, Mapping):
        return {key: full_state(value, keep) for key, value in state.items()}
    if isinstance(state, list):
        return [full_state(value, keep) for value in state]
    return state


def load_full_state(like: Any, full: Any) -> Any:
    """`full` (a checkpoint's whole tensors) sharded like `like` (the live state dict) wherever `like` holds a
    sharded tensor of the same shape; anything else as it is."""
    if isinstance(full, DTensor):  # read from a sharded checkpoint straight into shards like `like`'s
        return full
    if isinstance(like, DTensor) and isinstance(full, torch.Tensor) and tuple(full.shape) == tuple(like.shape):
        return distribute_tensor(
            full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None
        )
    if isinstance(like, Mapping) and isinstance(full, Mapping):
        return {key: load_full_state(like[key], value) if key in like else value for key, value in full.items()}
    return full


def load_model_state(model: nn.Module, full: Mapping[str, Any]) -> None:
    """`model.load_state_dict` of a full state dict, sharded first where the model is."""
    model.load_state_dict(load_full_state(model.state_dict(), full) if is_sharded(model) else full)


def load_optimizer_state(optimizer: torch.optim.Optimizer, full: Mapping[str, Any]) -> None:
    """`optimizer.load_state_dict` of a full state dict, each parameter's state sharded like the parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(isinstance(p, DTensor) for p in params):
        state = {
            index: {key: load_full_state(params[index], value) for key, value in entry.items()}
            if isinstance(params[index], DTensor) and isinstance(index, int) and index < len(params)
            else entry
            for index, entry in full["state"].items()
        }
        full = {**full, "state": state}
    optimizer.load_state_dict(dict(full))
