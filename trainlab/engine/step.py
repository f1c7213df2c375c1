"""One optimizer step: micro-batches fetched one at a time, `no_sync` for all but the last, one unscale / clip /
step / scaler update per phase, then the recipe's `after_optimizer_step` hook, then the averaged copies of the
phase's models (`engine.ema`) take their step.

Per phase: the loss of each micro-batch is divided by the number of micro-batches (so accumulation is the large
batch), micro-steps before the last run forward and backward inside DDP's `no_sync` (under `--fsdp`: without
FSDP2's gradient sync), and the gradient norm is always
a finite float or the step is reported as skipped. A second phase (a GAN's discriminator) replays the same
micro-batches from host memory; a single phase never holds more than one micro-batch on the device. A recipe's
`first_pass` (MoCo's keys of the whole optimizer batch) reads the micro-batches once before the phase's micro-steps,
which then replay them from host memory too.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainlab import dist
from trainlab.dtypes import at_least_float32
from trainlab.engine.ema import WeightAverage, update_average_
from trainlab.engine.fsdp import agree_on_overflow, set_gradient_sync
from trainlab.engine.health import HealthMonitor
from trainlab.engine.precision import LossScaler, Precision, grad_norm_, only_requires_grad
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo
from trainlab.engine.schedule import Scheduler
from trainlab.errors import TrainingStopped, UsageError

log = logging.getLogger(__name__)


def move_to(batch: Any, device: torch.device) -> Any:
    """Tensors of a (nested) batch on `device` (non-blocking from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    return batch


class MicroBatches:
    """The micro-batches of one optimizer step, drawn from the loader lazily, in order.

    Each pass (one per active phase) yields `count` device batches. With `replay` the host copies are kept so that
    a later phase sees the same batches; the loader is always advanced by exactly `count` batches.
    """

    def __init__(self, iterator: Iterator[Any], count: int, to_device: Callable[[Any], Batch], replay: bool) -> None:
        self._iterator, self.count, self._to_device, self._replay = iterator, count, to_device, replay
        self._host: list[Any] = []
        self._drawn = 0

    def __iter__(self) -> Iterator[Batch]:
        for i in range(self.count):
            if i < len(self._host):
                raw = self._host[i]
            elif i < self._drawn:
                raise RuntimeError("micro-batches were not kept for a second pass (replay=False)")
            else:
                raw = next(self._iterator)
                self._drawn += 1
                if self._replay:
                    self._host.append(raw)
            yield self._to_device(raw)

    def drain(self) -> None:
        """Draw what no phase consumed, so the data order does not depend on which phases ran."""
        while self._drawn < self.count:
            next(self._iterator)
            self._drawn += 1


@dataclass
class StepRunner:
    """Runs optimizer steps for the Trainer (which owns set-up, the loop, checkpoints and logging)."""

    recipe: Recipe[Any]
    phases: list[Phase]
    models: dict[str, nn.Module]  # trained models, unwrapped
    wrapped: dict[str, nn.Module]  # the same, DDP-wrapped where trained under DDP
    frozen: dict[str, nn.Module]
    averaged: dict[str, nn.Module]  # the averaged copies, by name
    averages: dict[str, WeightAverage]  # what each averaged copy follows, and its decay
    scalers: dict[str, LossScaler]
    schedulers: dict[str, Scheduler]
    precision: Precision
    device: torch.device
    clip_grad_norm: float
    health: HealthMonitor | None = None  # observes every --health-every-th step (engine.health); None: off
    sharded: bool = False  # --fsdp sharded the trained models (engine.fsdp)

    def __post_init__(self) -> None:
        self.all_params = [p for m in self.models.values() for p in m.parameters()]
        self._unused_checked: set[str] = set()  # phases whose parameters were checked for a missing gradient

    def models_for(self, phase: Phase) -> dict[str, nn.Module]:
        """Modules trained in `phase` DDP-wrapped; the other trained ones raw (no gradient sync); frozen and averaged
        ones."""
        trained = {n: (self.wrapped[n] if n in phase.modules else m) for n, m in self.models.items()}
        return {**trained, **self.frozen, **self.averaged}

    def phase_params(self, phase: Phase) -> list[nn.Parameter]:
        """The parameters `phase`'s optimizer updates (those requiring gradients)."""
        return [p for n in phase.modules for p in self.models[n].parameters() if p.requires_grad]

    def to_device(self, raw: Any) -> Batch:
        """A loader batch on the device, cast for the precision mode (pure 16-bit modes cast float inputs)."""
        batch: Batch = self.precision.cast_input(move_to(raw, self.device))
        return batch

    def run(self, iterator: Iterator[Any], info: StepInfo) -> dict[str, float]:
        """One optimizer step per active phase over the same micro-batches. Returns float metrics."""
        active = [p for p in self.phases if self.recipe.phase_active(p.name, info.step)]
        first_pass = any(self.recipe.has_first_pass(p.name, info) for p in active)
        batches = MicroBatches(iterator, info.num_micro_steps, self.to_device, replay=len(active) > 1 or first_pass)
        multi = len(self.phases) > 1
        metrics: dict[str, float] = {}
        for phase in active:
            prefix = f"{phase.name}/" if multi else ""
            try:
                phase_metrics = self._phase_step(phase, batches, info, multi)
            except RuntimeError as err:  # DDP's unused-parameter error, a timed-out collective: one named line
                dist.raise_named(err, {n: self.wrapped[n] for n in phase.modules}, info.step)
                raise
            metrics.update({prefix + k: v for k, v in phase_metrics.items()})
        batches.drain()
        return metrics

    def _phase_step(self, phase: Phase, batches: MicroBatches, info: StepInfo, multi: bool) -> dict[str, float]:
        models = self.models_for(phase)
        params = self.phase_params(phase)
        scaler = self.scalers[phase.name]
        lr = self.schedulers[phase.name].apply(info.step)
        num_micro = batches.count
        sums: dict[str, torch.Tensor] = {}
        freeze = only_requires_grad(params, self.all_params) if multi else contextlib.nullcontext()
        with freeze:
            if self.recipe.has_first_pass(phase.name, info):
                with torch.no_grad(), self.precision.autocast(self.device.type):
                    self.recipe.first_pass(models, batches, phase.name, info)
            for i, batch in enumerate(batches):
                micro_info = replace(info, micro_step=i)
                with self._no_sync(phase, skip=i < num_micro - 1):
                    with self.precision.autocast(self.device.type), self._health_forward(phase.name, micro_info):
                        out = self.recipe.train_step(models, batch, phase.name, micro_info)
                    scaler.scale(out["loss"] / num_micro).backward()
                for key, value in out.items():
                    v = (
                        at_least_float32(value.detach())
                        if isinstance(value, torch.Tensor)
                        else torch.tensor(float(value))
                    )
                    sums[key] = sums.get(key, 0) + v / num_micro
                del out, batch
        scaler.unscale_(phase.optimizer)
        if self.sharded:
            agree_on_overflow(scaler, phase.optimizer)
        self._check_unused_parameters(phase, info)
        if self.health is not None:
            self.health.record_gradients(phase.name, info)  # before clipping: the gradients as computed
        clip = self.clip_grad_norm if phase.clip_grad_norm is None else phase.clip_grad_norm
        norm, finite = grad_norm_(params, clip)
        metrics = {key: float(value) for key, value in sums.items()}
        loss = metrics["loss"]
        if scaler.policy == "none" and not (finite and math.isfinite(loss)):
            phase.optimizer.zero_grad(set_to_none=True)
            raise TrainingStopped(
                f"training diverged at step {info.step + 1} ({phase.name}): loss {loss:.4g}, gradient norm {norm:.4g} "
                f"in {self.precision.name}, where no loss scaling skips such steps; nothing was saved after the last "
                "good checkpoint: lower the learning rate (or clip gradients) and resume"
            )
        if self.health is not None:
            self.health.before_update(phase.name, info)
        stepped = scaler.step(phase.optimizer, finite)
        if self.health is not None:
            self.health.after_update(phase.name, info, stepped)
        phase.optimizer.zero_grad(set_to_none=True)
        metrics.update(self.recipe.after_optimizer_step(models, phase.name, info))
        if stepped:
            for name, spec in self.averages.items():
                if spec.follows in phase.modules:
                    update_average_(self.averaged[name], self.models[spec.follows], spec.decay)
        metrics["grad_norm"] = norm if finite else float("nan")
        metrics["skipped"] = 0.0 if stepped else 1.0
        metrics["lr"] = lr
        if scaler.policy != "none":
            metrics["loss_scale"] = scaler.current_scale
        if not stepped:
            log.warning("step %d (%s): non-finite gradients (overflow); optimizer step skipped", info.step, phase.name)
        return metrics

    def _health_forward(self, phase: str, info: StepInfo) -> contextlib.AbstractContextManager[Any]:
        return self.health.watch_forward(phase, info) if self.health is not None else contextlib.nullcontext()

    def _check_unused_parameters(self, phase: Phase, info: StepInfo) -> None:
        """At a phase's first step in this process: parameters that received no gradient. Under DDP without
        --ddp-find-unused-parameters that is a one-line error now (DDP itself would fail one step later without
        naming them); in one process a warning (torchrun would fail). Collective under DDP."""
        if phase.name in self._unused_checked:
            return
        self._unused_checked.add(phase.name)
        named = [
            (f"{n}.{k}", p) for n in phase.modules for k, p in self.models[n].named_parameters() if p.requires_grad
        ]
        unused = dist.unused_parameters(named)
        if not unused:
            return
        wrappers = [getattr(self.wrapped[n], "_orig_mod", self.wrapped[n]) for n in phase.modules]
        ddp = [w for w in wrappers if isinstance(w, DistributedDataParallel)]
        if not ddp:
            log.warning("%s", dist.unused_parameters_line(unused, step=info.step, ddp=False))
        elif not all(w.find_unused_parameters for w in ddp):
            raise UsageError(dist.unused_parameters_line(unused, step=info.step, ddp=True))
        else:
            log.info("%d parameter(s) without a gradient, as --ddp-find-unused-parameters allows", len(unused))

    def _no_sync(self, phase: Phase, skip: bool) -> contextlib.AbstractContextManager[Any]:
        set_gradient_sync({name: self.models[name] for name in phase.modules}, enabled=not skip)  # --fsdp
        if not skip:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for name in phase.modules:
            module = getattr(self.wrapped[name], "_orig_mod", self.wrapped[name])  # under torch.compile
            if isinstance(module, DistributedDataParallel):
                stack.enter_context(module.no_sync())
        return stack
