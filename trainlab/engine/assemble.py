"""Assembly: everything a run needs before its first step, built one way for the Trainer and the memory planner.

In order: seed, `recipe.build` (models, phases, frozen models, averaged copies declared), the averaged copies made
(`engine.ema`), `--activation-checkpointing` switched on the trained models (`apply_activation_checkpointing`), the
precision mode applied to the trained models, every model placed on the device (frozen and averaged ones in eval
mode without gradients), the run's length (from the training data: `length_of(parts)`), one `LossScaler` and one
`Scheduler` per phase, DDP wrappers for the trained modules of several processes (or, with `--fsdp`, the trained
models and their averaged copies sharded in place: `engine.fsdp`), `--compile`, the training-health
monitor (`engine.health`, every `--health-every` steps) and the `StepRunner` that runs one optimizer step. The
Trainer adds the relaunch rules before and the loop after; the planner (`memory.trace`) passes its hooks
(`AssemblyHooks`: models placed on fake tensors, storages labelled, the recipe wrapped to mark regions) and its own
run length instead of data, and runs the same steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainlab.engine.batchnorm_momentum import decay_per_optimizer_step_, describe_per_micro_batch
from trainlab.engine.compile import compile_for_training
from trainlab.engine.ema import averaged_copy
from trainlab.engine.fsdp import Sharding, shard_run
from trainlab.engine.health import HealthMonitor
from trainlab.engine.precision import LossScaler, Precision
from trainlab.engine.recipe import Recipe, TrainParts, apply_activation_checkpointing
from trainlab.engine.run_length import RunLength
from trainlab.engine.schedule import Scheduler
from trainlab.engine.seeding import seed_everything
from trainlab.engine.step import StepRunner

log = logging.getLogger(__name__)

Place = Callable[[nn.Module, Precision | None], nn.Module]
"""How a model reaches the device: (model, the precision mode to apply, None for frozen and averaged models) -> the
placed model."""


@dataclass
class AssemblyHooks:
    """What a caller other than the Trainer changes (the memory planner: fake tensors, labels, regions).

    Attributes:
        place: puts a model on the device in the precision mode (default: `Precision.prepare_model`, then `.to`).
        after_build: sees the placed parts and averaged copies before scalers and schedules exist.
        step_recipe: the recipe the `StepRunner` calls (default: the recipe itself).
    """

    place: Place | None = None
    after_build: Callable[[TrainParts, dict[str, nn.Module]], None] | None = None
    step_recipe: Callable[[Recipe[Any]], Recipe[Any]] | None = None


@dataclass
class Assembly:
    """What `assemble` built.

    Attributes:
        parts: the recipe's parts, trained and frozen models placed on the device.
        averaged: the averaged copies (`TrainParts.averaged`), by name, placed on the device.
        length: the run's length in optimizer steps.
        scalers, schedulers: one per phase, by phase name.
        wrapped: the trained models as the step calls them (DDP-wrapped / compiled where that applies).
        runner: runs one optimizer step.
        compiled: the names of the models `--compile` compiled.
        health: observes every `--health-every`-th step (None: off).
        sharding: what `--fsdp` sharded (`engine.fsdp`; None without it and in one process).
    """

    parts: TrainParts
    averaged: dict[str, nn.Module]
    length: RunLength
    scalers: dict[str, LossScaler]
    schedulers: dict[str, Scheduler]
    wrapped: dict[str, nn.Module]
    runner: StepRunner
    compiled: list[str] = field(default_factory=list)
    health: HealthMonitor | None = None
    sharding: Sharding | None = None

    def all_models(self) -> dict[str, nn.Module]:
        """Every model by name (trained, frozen, averaged): the mapping `evaluate` and `on_fit_end` receive."""
        return {**self.parts.models, **self.parts.frozen, **self.averaged}


def check_parts(parts: TrainParts, recipe_name: str) -> None:
    """The slots a recipe filled must fit together (a recipe bug otherwise, so ValueError, not a usage error)."""
    if not parts.phases:
        raise ValueError(f"recipe {recipe_name} built no optimizer phase")
    slots: dict[str, Mapping[str, object]] = {
        "models": parts.models,
        "frozen": parts.frozen,
        "averaged": parts.averaged,
    }
    seen: dict[str, str] = {}
    for slot, names in slots.items():
        for name in names:
            if name in seen:
                raise ValueError(f"recipe {recipe_name}: {name!r} is in both TrainParts.{seen[name]} and .{slot}")
            seen[name] = slot
    trained = {name for phase in parts.phases for name in phase.modules}
    for phase in parts.phases:
        missing = [name for name in phase.modules if name not in parts.models]
        if missing:
            raise ValueError(f"recipe {recipe_name}: phase {phase.name!r} trains {missing}, not in TrainParts.models")
    for name, spec in parts.averaged.items():
        if spec.follows not in trained:
            raise ValueError(f"recipe {recipe_name}: averaged {name!r} follows {spec.follows!r}, which no phase trains")
        if not 0.0 <= spec.decay < 1.0:
            raise ValueError(f"recipe {recipe_name}: averaged {name!r} has decay {spec.decay}, not in [0, 1)")


def _default_place(device: torch.device, keep_batchnorm_fp32: bool) -> Place:
    def place(model: nn.Module, precision: Precision | None) -> nn.Module:
        if precision is not None:
            precision.prepare_model(model, keep_batchnorm_fp32=keep_batchnorm_fp32)
        return model.to(device)

    return place


def assemble(
    recipe: Recipe[Any],
    *,
    device: torch.device,
    precision: Precision,
    length_of: Callable[[TrainParts], RunLength],
    world: int = 1,
    compile_models: bool = False,
    health_every: int = 0,
    warn: bool = True,
    hooks: AssemblyHooks | None = None,
) -> Assembly:
    """Build what a run needs before its first step (see the module docstring).

    Args:
        recipe: the recipe with its config (seed, precision details, clipping, schedule, DDP settings).
        device: where the models go.
        precision: the precision mode (cast of the trained models, loss scaling, default dtype of the build).
        length_of: the run's length, given the built parts (the Trainer builds the training data here).
        world: processes; above 1 the trained modules of each phase are DDP-wrapped.
        compile_models: `torch.compile` the trained models' training forward (`--compile`).
        health_every: observe training health every N optimizer steps (`--health-every`; 0: no monitor).
        warn: the health monitor logs its warnings (rank 0; the others measure for the average but stay quiet).
        hooks: what the memory planner changes.
    """
    cfg = recipe.config
    hooks = hooks or AssemblyHooks()
    place = hooks.place or _default_place(device, cfg.keep_batchnorm_fp32)
    seed_everything(cfg.seed)
    with precision.default_dtype():  # fp64: models initialised and data generated in float64
        parts = recipe.build(device)
        check_parts(parts, recipe.name)
        averaged = {name: averaged_copy(parts.models[spec.follows]) for name, spec in parts.averaged.items()}
        apply_activation_checkpointing(recipe, parts)  # the trained models only: averaged copies run no backward
        for name, model in parts.models.items():
            parts.models[name] = place(model, precision)
        _set_batchnorm_decay(parts, cfg.grad_accumulation, cfg.batchnorm_decay)
        for name, model in parts.frozen.items():
            parts.frozen[name] = place(model, None).eval().requires_grad_(False)
        for name, model in averaged.items():
            averaged[name] = place(model, None).eval().requires_grad_(False)
        if hooks.after_build is not None:
            hooks.after_build(parts, averaged)
        length = length_of(parts)
    scalers = {p.name: LossScaler(precision, device.type, cfg.static_loss_scale) for p in parts.phases}
    schedulers = {p.name: Scheduler(p.optimizer, cfg.schedule, length.total_steps) for p in parts.phases}
    sharding = None
    if cfg.fsdp:
        sharding = shard_run(
            parts,
            averaged,
            precision=precision,
            device=device,
            world=world,
            reshard_after_forward=cfg.fsdp_reshard_after_forward,
            cpu_offload=cfg.fsdp_cpu_offload,
        )
    wrapped = _wrap_ddp(parts, device, 1 if cfg.fsdp else world, cfg.ddp_find_unused_parameters)
    compiled: list[str] = []
    if compile_models:
        compiled = sorted({name for phase in parts.phases for name in phase.modules})
        for name in compiled:
            wrapped[name] = compile_for_training(wrapped[name])
    health = None
    if health_every > 0:
        health = HealthMonitor(
            parts.models, parts.phases, health_every, device, observe_activations=not compile_models, warn=warn
        )
    runner = StepRunner(
        recipe=hooks.step_recipe(recipe) if hooks.step_recipe is not None else recipe,
        phases=parts.phases,
        models=parts.models,
        wrapped=wrapped,
        frozen=parts.frozen,
        averaged=averaged,
        averages=parts.averaged,
        scalers=scalers,
        schedulers=schedulers,
        precision=precision,
        device=device,
        clip_grad_norm=cfg.clip_grad_norm,
        health=health,
        sharded=sharding is not None,
    )
    return Assembly(parts, averaged, length, scalers, schedulers, wrapped, runner, compiled, health, sharding)


def _set_batchnorm_decay(parts: TrainParts, accumulation: Any, decay: str) -> None:
    """BatchNorm momentum under accumulation (`engine/batchnorm_momentum.py`), logged either way."""
    if not isinstance(accumulation, int) or accumulation <= 1:
        return
    if decay == "per-optimizer-step":
        log.info(decay_per_optimizer_step_(parts.models.values(), accumulation))
    elif (line := describe_per_micro_batch(parts.models.values(), accumulation)) is not None:
        log.info(line)


def _wrap_ddp(parts: TrainParts, device: torch.device, world: int, find_unused: bool) -> dict[str, nn.Module]:
    """The trained models as steps call them: DDP-wrapped under several processes when a phase trains them."""
    trained = {name for phase in parts.phases for name in phase.modules}
    wrapped: dict[str, nn.Module] = {}
    for name, model in parts.models.items():
        if world > 1 and name in trained and any(p.requires_grad for p in model.parameters()):
            device_ids = [device.index] if device.type == "cuda" else None
            wrapped[name] = DistributedDataParallel(
                model, device_ids=device_ids, find_unused_parameters=find_unused, forward_sync_buffers=False
            )
        else:
            wrapped[name] = model
    return wrapped
