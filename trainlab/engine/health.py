"""Training health: per block gradient norms, update-to-weight ratios and dead ReLU units, every N optimizer steps.

Every `--health-every` optimizer steps (0: off) the step runner lets `HealthMonitor` observe one optimizer step:
- **dead units**: forward hooks on the ReLU-family modules (`nn.ReLU`, `nn.ReLU6`) of the trained models, during
  the forward of the step's first micro-batch. A unit (a channel of a (B, C, H, W) map, the last dimension
  otherwise) is dead when it is zero for every sample and position of that micro-batch. A module called several
  times in one forward (torchvision's `BasicBlock.relu`) is reported per call: `layer1.0.relu`, `layer1.0.relu#2`.
- **gradient norm** per block, after unscaling and before clipping (the gradients the optimizer is about to use);
- **update-to-weight ratio** per block: ||W_after - W_before|| / ||W_before|| over the optimizer step, on up to
  `SAMPLED_ELEMENTS` evenly spaced elements of each parameter (every element of smaller ones), so the copy it needs
  stays small on large models. About 1e-3 per step is the usual range.

Blocks: each trained model is cut at its children; a container (`Sequential`, `ModuleList`, `ModuleDict`) is cut at
its items, and a child of the model holding at least half of its trainable parameters is cut further (a backbone
inside a wrapper, MoCo's `base_encoder`), so `var.blocks.3`, `model.layer2.1`, `model.features.0`,
`model.base_encoder.layer1.0`. The parameters a cut module owns directly (a position table, a class token) form the
block `<its path>.own`: `var.own`.

Hooks and measurements only read tensors: no value the step computes changes (golden runs are bit for bit the same
with health logging at any cadence) and no random number is drawn. The monitor's own time (synchronised on CUDA)
is logged as `health_seconds` and as a fraction of the wall time since the previous health step (`overhead`).

Warnings (one line each, once per block and kind per process, never a stop): a dead fraction above
`DEAD_FRACTION_WARN`, an update ratio above `UPDATE_RATIO_HIGH` (or below `UPDATE_RATIO_LOW` while the learning rate
is at least half its peak) at `RATIO_PERSISTS` observed steps in a row (the first steps of a fresh model move it a
lot), a gradient norm `GRAD_GROWTH_WARN` times the median of its earlier measurements. The
remedies named are the usual ones: the learning rate, the initialisation, clipping, LeakyReLU-type activations.
"""

# Shape legend: C units of an activation (channels of a (B, C, ...) map, else the last dimension).

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainlab.engine.health_limits import DEAD_FRACTION_WARN, UPDATE_RATIO_HIGH, UPDATE_RATIO_LOW
from trainlab.engine.recipe import Phase, StepInfo

log = logging.getLogger(__name__)

RELU_FAMILY = (nn.ReLU, nn.ReLU6)
RATIO_PERSISTS = 2
GRAD_GROWTH_WARN = 1e3
GRAD_HISTORY = 20
SAMPLED_ELEMENTS = 65_536
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def parameter_blocks(name: str, model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The trainable parameters of `model` grouped into blocks (see the module docstring), each named
    `name.<module path>`; every parameter in exactly one block, in registration order."""
    total = sum(p.numel() for p in model.parameters() if p.requires_grad) or 1
    blocks: dict[str, list[nn.Parameter]] = {}
    seen: set[int] = set()

    def trainable(module: nn.Module, recurse: bool) -> list[nn.Parameter]:
        found = [p for p in module.parameters(recurse=recurse) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in found)
        return found

    def visit(module: nn.Module, path: str, depth: int) -> None:
        children = [(n, c) for n, c in module.named_children() if any(p.requires_grad for p in c.parameters())]
        share = sum(p.numel() for p in module.parameters() if p.requires_grad) / total
        if children and (depth == 0 or isinstance(module, _CONTAINERS) or (depth == 1 and share >= 0.5)):
            own = trainable(module, recurse=False)
            if own:
                blocks[f"{path}.own"] = own
            for child_name, child in children:
                visit(child, f"{path}.{child_name}", depth + 1)
            return
        params = trainable(module, recurse=True)
        if params:
            blocks[path] = params

    visit(model, name, depth=0)
    return blocks


def relu_modules(name: str, model: nn.Module) -> dict[str, nn.Module]:
    """`name.<path>` -> each ReLU-family module of `model`."""
    return {f"{name}.{path}": m for path, m in model.named_modules() if isinstance(m, RELU_FAMILY)}


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype measurements are made in: float32, or float64 for float64 tensors."""
    return torch.promote_types(dtype, torch.float32)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a `--fsdp` parameter or gradient (measured per rank, norms summed over ranks)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sampled(p: torch.Tensor) -> torch.Tensor:
    """A float32 (float64 for float64) copy of at most `SAMPLED_ELEMENTS` evenly spaced elements of `p` (all of a small
    one). The stride shares no factor with the last dimension, so the sample walks through every column of a
    matrix."""
    flat = p.detach().reshape(-1)
    stride = max(1, math.ceil(flat.numel() / SAMPLED_ELEMENTS))
    if stride > 1 and p.dim() > 0:
        while math.gcd(stride, p.shape[-1]) != 1:
            stride += 1
    return flat[::stride].to(_wide(p.dtype), copy=True)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Warned:
    """Which (block, kind) warnings were already given: each one once per run."""

    given: set[tuple[str, str]] = field(default_factory=set)

    def first(self, block: str, kind: str) -> bool:
        if (block, kind) in self.given:
            return False
        self.given.add((block, kind))
        return True


@dataclass(frozen=True)
class _Layout:
    """One phase's trainable parameters in one flat list, each with the index of its block (for foreach ops)."""

    params: list[nn.Parameter]
    index: list[int]
    names: list[str]
    sharded: bool = False  # --fsdp: each rank holds a shard of every parameter; block norms add up over ranks

    @staticmethod
    def of(model_blocks: list[dict[str, list[nn.Parameter]]]) -> _Layout:
        params: list[nn.Parameter] = []
        index: list[int] = []
        names: list[str] = []
        for blocks in model_blocks:
            for name, block in blocks.items():
                params += block
                index += [len(names)] * len(block)
                names.append(name)
        return _Layout(params, index, names, sharded=any(isinstance(p, DTensor) for p in params))

    def block_norms(self, norms: list[torch.Tensor] | tuple[torch.Tensor, ...], index: torch.Tensor) -> list[float]:
        """Per block, the L2 norm of its tensors' norms `norms` (one per entry of `index`), as floats."""
        squares = torch.stack(list(norms)).to(torch.float64).square()
        total = torch.zeros(len(self.names), dtype=torch.float64, device=squares.device)
        total.index_add_(0, index, squares)
        if self.sharded:  # the squares of this rank's shards: the block's are their sum over ranks (collective)
            torch.distributed.all_reduce(total)
        return total.sqrt().tolist()


class HealthMonitor:
    """Observes every `every`-th optimizer step for the step runner; see the module docstring.

    Args:
        models: the trained models (unwrapped), by name.
        phases: the optimizer phases (which models each trains).
        every: cadence in optimizer steps (0: never).
        device: the training device (its work is synchronised before the monitor times its own).
        observe_activations: install the dead-unit hooks (False under `--compile`, whose graphs the hooks would break).
        warn: log warnings (rank 0; the others measure for the average but stay quiet).
    """

    def __init__(
        self,
        models: Mapping[str, nn.Module],
        phases: list[Phase],
        every: int,
        device: torch.device,
        *,
        observe_activations: bool = True,
        warn: bool = True,
    ) -> None:
        self.every = every
        self.device = device
        self.observe_activations = observe_activations
        self.warn = warn
        self.phase_models = {p.name: list(p.modules) for p in phases}
        self.optimizers = {p.name: p.optimizer for p in phases}
        self.blocks = {n: parameter_blocks(n, m) for n, m in models.items()}
        self.relus = {n: relu_modules(n, m) for n, m in models.items()}
        self._layout = {p.name: _Layout.of([self.blocks.get(m, {}) for m in p.modules]) for p in phases}
        self._metrics: dict[str, float] = {}
        self._alive: dict[str, list[torch.Tensor]] = {}  # relu name -> alive_C per call this step
        self._before: dict[str, list[torch.Tensor]] = {}  # phase -> sampled weights before the optimizer step
        self._grad_history: dict[str, deque[float]] = {}
        self._ratio_streak: dict[str, int] = {}  # block -> observed steps in a row with its ratio out of range
        self._warned = _Warned()
        self._seconds = 0.0
        self._last_report: float | None = None

    def due(self, info: StepInfo) -> bool:
        """Whether optimizer step `info.step` (0-based) is observed: the `every`-th, 2`every`-th, ... step."""
        return self.every > 0 and (info.step + 1) % self.every == 0

    # ------------------------------------------------------------------------------------------------ hooks
    @contextlib.contextmanager
    def watch_forward(self, phase: str, info: StepInfo) -> Iterator[None]:
        """Around the forward of a micro-batch: on the first micro-batch of an observed step, record which units
        of each ReLU-family module of the phase's models are alive."""
        if not (self.observe_activations and self.due(info) and info.micro_step == 0):
            yield
            return
        handles = []
        for model in self.phase_models[phase]:
            for name, module in self.relus.get(model, {}).items():
                handles.append(module.register_forward_hook(self._relu_hook(name)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _relu_hook(self, name: str) -> Callable[[nn.Module, object, torch.Tensor], None]:
        def hook(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
            start = time.perf_counter()
            if isinstance(output, torch.Tensor) and output.dim() >= 2:
                unit_dim = 1 if output.dim() >= 4 else output.dim() - 1
                others = tuple(d for d in range(output.dim()) if d != unit_dim)
                with torch.no_grad():  # a ReLU's output is >= 0: a unit is alive where its largest value is > 0
                    alive_C = output.detach().amax(dim=others) > 0
                self._alive.setdefault(name, []).append(alive_C)
            self._seconds += time.perf_counter() - start

        return hook

    # ------------------------------------------------------------------------------------------------ gradients
    def record_gradients(self, phase: str, info: StepInfo) -> None:
        """After unscaling, before clipping: the gradient norm of each block of the phase's models."""
        if not self.due(info):
            return
        _synchronize(self.device)
        start = time.perf_counter()
        layout = self._layout[phase]
        present = [(_local(p.grad), i) for p, i in zip(layout.params, layout.index) if p.grad is not None]
        if present:
            grads = [g for g, _ in present]
            index = torch.tensor([i for _, i in present], device=grads[0].device)
            norms = layout.block_norms(torch._foreach_norm(grads), index)
            for i in sorted({i for _, i in present}):
                self._metrics[f"grad_norm/{layout.names[i]}"] = norms[i]
        self._seconds += time.perf_counter() - start

    # ------------------------------------------------------------------------------------------------ updates
    def before_update(self, phase: str, info: StepInfo) -> None:
        """Right before `optimizer.step()`: keep a sample of each block's weights."""
        if not self.due(info):
            return
        _synchronize(self.device)
        start = time.perf_counter()
        self._before[phase] = [sampled(_local(p)) for p in self._layout[phase].params]
        self._seconds += time.perf_counter() - start

    def after_update(self, phase: str, info: StepInfo, stepped: bool) -> None:
        """Right after `optimizer.step()`: each block's update-to-weight ratio (none for a skipped step)."""
        if not self.due(info):
            return
        _synchronize(self.device)
        start = time.perf_counter()
        layout = self._layout[phase]
        before = self._before.pop(phase, None)
        if before and stepped:
            index = torch.tensor(layout.index, device=before[0].device)
            deltas = torch._foreach_sub([sampled(_local(p)) for p in layout.params], before)
            moved = layout.block_norms(torch._foreach_norm(deltas), index)
            size = layout.block_norms(torch._foreach_norm(before), index)
            for i, name in enumerate(layout.names):
                self._metrics[f"update_ratio/{name}"] = moved[i] / size[i] if size[i] > 0 else math.nan
        lr, peak = self._lr(phase)
        self._metrics.setdefault(f"lr_factor/{phase}", lr / peak if peak > 0 else math.nan)
        self._seconds += time.perf_counter() - start

    def _lr(self, phase: str) -> tuple[float, float]:
        group = self.optimizers[phase].param_groups[0]
        return float(group["lr"]), float(group.get("peak_lr", group["lr"]))

    # ------------------------------------------------------------------------------------------------ results
    def pop_metrics(self, info: StepInfo) -> dict[str, float]:
        """The observed step's metrics (empty for an unobserved one): grad_norm/<block>, update_ratio/<block>,
        dead_fraction/<relu>, health_seconds and overhead (its share of the time since the last observed step)."""
        if not self.due(info):
            return {}
        start = time.perf_counter()
        metrics = dict(self._metrics)
        for name, calls in self._alive.items():
            for i, alive_C in enumerate(calls):
                key = name if i == 0 else f"{name}#{i + 1}"
                metrics[f"dead_fraction/{key}"] = 1.0 - float(alive_C.float().mean())
        self._metrics.clear()
        self._alive.clear()
        now = time.perf_counter()
        seconds = self._seconds + (now - start)
        metrics["health_seconds"] = seconds
        if self._last_report is not None and now > self._last_report:
            metrics["overhead"] = seconds / (now - self._last_report)
        self._last_report = now
        self._seconds = 0.0
        return metrics

    def check(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """The warnings a step's (averaged) health metrics call for, each block and kind once per run; logged when
        this monitor warns. Returns the lines."""
        lines = []
        for key, value in metrics.items():
            kind, _, block = key.partition("/")
            if not block or not math.isfinite(value):
                continue
            line = self._judge(kind, block, value, step, metrics)
            if line and self._warned.first(block, kind):
                lines.append(line)
        for line in lines:
            if self.warn:
                log.warning("%s", line)
        return lines

    def _judge(self, kind: str, block: str, value: float, step: int, metrics: Mapping[str, float]) -> str:
        if kind == "dead_fraction" and value > DEAD_FRACTION_WARN:
            return (
                f"health at step {step}: {value:.0%} of the units after {block} are zero for a whole micro-batch "
                "(dead ReLUs); usual remedies: a lower learning rate, He (Kaiming) initialisation, or a LeakyReLU- "
                "or SELU-type activation"
            )
        if kind == "update_ratio":
            lr_factor = next((v for k, v in metrics.items() if k.startswith("lr_factor/")), 1.0)
            out_of_range = value > UPDATE_RATIO_HIGH or (value < UPDATE_RATIO_LOW and lr_factor >= 0.5)
            self._ratio_streak[block] = self._ratio_streak.get(block, 0) + 1 if out_of_range else 0
            if self._ratio_streak[block] < RATIO_PERSISTS:
                return ""
            if value > UPDATE_RATIO_HIGH:
                return (
                    f"health at step {step}: block {block} changed by {value:.2g} of its weights' norm in one step "
                    f"(usually about 1e-3); usual remedies: a lower learning rate (or warm-up), gradient clipping "
                    "(--clip-grad-norm)"
                )
            return (
                f"health at step {step}: block {block} barely moves ({value:.2g} of its weights' norm per step, "
                "usually about 1e-3) at a learning rate near its peak; usual remedies: a higher learning rate "
                "for it, its initialisation (weights far larger than their gradients), a frozen or unused block"
            )
        if kind == "grad_norm":
            history = self._grad_history.setdefault(block, deque(maxlen=GRAD_HISTORY))
            reference = statistics.median(history) if history else 0.0
            history.append(value)
            if reference > 0 and value > GRAD_GROWTH_WARN * reference:
                return (
                    f"health at step {step}: the gradient norm of block {block} grew {value / reference:.2g}-fold "
                    f"({reference:.3g} -> {value:.3g}); usual remedies: a lower learning rate, gradient clipping "
                    "(--clip-grad-norm), the initialisation"
                )
        return ""
