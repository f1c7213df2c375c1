"""The contract between the engine and a recipe: what a recipe author writes, and what the engine calls when.

A recipe is a typed config (a subclass of `TrainConfig`) plus a `Recipe[Config]` subclass. The engine owns everything
else: devices, precision, accumulation, DDP, clipping, schedules, checkpoints, logging. In the order the engine calls:

    build(device)            -> TrainParts: trained models, one `Phase` (optimizer) per trained group, frozen models,
                                averaged copies to keep (`WeightAverage`); touches no data, so a planner can build the
                                models and trace a step on fake tensors
    build_data(parts, device) -> the training `Dataset` of `Batch`es (may use the frozen models, e.g. a token cache)
    on each loader batch once it is on the device (before the precision mode's input cast):
        prepare_batch(batch)   -> the batch the steps see (batched augmentation on the device: MoCo's
                                --augment-device); default: the batch as it is
    per optimizer step, per active phase:
        first_pass(models, micro_batches, phase, info) where `has_first_pass(phase, info)`: sees every micro-batch
                                of the step before the first train_step (MoCo's keys of the whole optimizer batch)
    per optimizer step, per active phase, per micro-batch:
        train_step(models, batch, phase, info) -> {"loss": scalar tensor, **metrics}
    after each phase's optimizer.step():
        after_optimizer_step(models, phase, info) -> extra metrics (momentum / EMA updates: once per optimizer step)
    evaluate(models, device, epoch) -> held-out metrics (rank 0)
    on_fit_end(models)       training reached its end (exports)

`example_batch(batch_size)` returns a batch of the right shapes and dtypes without reading data (memory planning).

Multi-optimizer recipes (a GAN's generator and discriminator) declare several `Phase`s. Each optimizer step runs
the phases in order over the same micro-batches; during a phase only that phase's parameters require gradients,
and only that phase's modules are DDP-wrapped (and compiled, with --compile) in the mapping handed to `train_step`;
`unwrap_model` reaches the model under those wrappers. Every model a recipe uses is in exactly one slot:

    models    trained: in a phase's optimizer, cast by the precision mode, DDP-wrapped, checkpointed
    frozen    used, never updated (a tokenizer, a perceptual network, a judge): on the device, eval mode, no
              gradients, in no optimizer and no checkpoint, never cast (the recipe picks their dtype); `--debug`
              fails if their weights change during training
    averaged  updated, never trained (an EMA of a trained model's weights: `engine.ema`): the engine makes the copy,
              updates it once per optimizer step of the phase that trains its model, keeps it in eval mode, never
              casts or wraps it, and checkpoints it

All three are in the mapping handed to `train_step`, `after_optimizer_step`, `evaluate` and `on_fit_end`, by name.
State that is neither weights nor optimizer state (counters, EMA codebook statistics, generators) goes in
`Recipe.state_dict`: it is checkpointed too, and `--debug` compares it across the resume.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from trainlab.config import FLOAT32_MAX, check_ranges, option
from trainlab.data.loader_options import DEFAULT_PREFETCH_FACTOR, LoaderOptions, Switch, resolve_loader_options
from trainlab.engine.device import check_device_name
from trainlab.engine.ema import WeightAverage
from trainlab.engine.precision_names import PrecisionName
from trainlab.engine.schedule import ScheduleConfig
from trainlab.errors import UsageError
from trainlab.models.grad_checkpoint import set_grad_checkpointing
from trainlab.models.names import ModelFamily
from trainlab.optim.config import OptimConfig

Batch = dict[str, torch.Tensor]
"""The one batch format: named tensors, e.g. {"image": img_B3HW, "label": label_B} or {"tokens": ..., "label": ...}."""

FP16_MAX = 65504.0
"""The largest finite float16."""


@dataclass(frozen=True)
class StepInfo:
    """Where training stands, handed to every `train_step` / `after_optimizer_step` call (the engine's arithmetic).

    Attributes:
        step: index of this optimizer step (0-based: optimizer steps completed before it).
        total_steps: the schedule's horizon, epochs x steps_per_epoch (`engine.run_length`): --max-steps only stops
            the run early, it does not shorten this (a run stopped by it and resumed without it continues the same
            curve).
        steps_per_epoch: optimizer steps in one epoch.
        epoch: index of the current epoch (0-based).
        log_now: whether the engine logs this step's metrics (compute expensive metrics only then).
        micro_step: index of the micro-batch inside the optimizer step (0 .. num_micro_steps - 1).
        num_micro_steps: micro-batches per optimizer step (--grad-accumulation).
    """

    step: int
    total_steps: int
    steps_per_epoch: int
    epoch: int = 0
    log_now: bool = True
    micro_step: int = 0
    num_micro_steps: int = 1


@dataclass(kw_only=True)
class TrainConfig:
    """Engine settings shared by every recipe (recipes subclass this and add their own fields)."""

    run_dir: Path = option(
        Path("runs/default"),
        "the run's folder: config.yaml, metrics.jsonl, tb/, ckpt/, locked while it trains; launched again, it resumes",
        metavar="DIR",
    )
    seed: int = option(0, "one seed for init, data order and augmentation", ge=0, lt=2**63)
    device: str = option("auto", "cpu, cuda, cuda:N, or auto (cuda when available, else cpu; logged)")
    precision: PrecisionName = option(
        "fp32",
        "fp16/bf16: pure 16-bit weights; -amp: fp32 weights + autocast; -scale: loss scaling; fp64: float64 reference",
    )
    keep_batchnorm_fp32: bool = option(True, "in pure fp16/bf16 modes keep BatchNorm weights and statistics in fp32")
    static_loss_scale: float = option(1024.0, "loss scale of the static policy (fp16-scale)", gt=0)
    epochs: int = option(1, "number of epochs", ge=1)
    max_steps: int = option(-1, "stop after this many optimizer steps (-1: run all epochs)", ge=1, sentinels=(-1,))
    batch_size: int = option(128, "global batch per optimizer step (all processes x accumulation steps)", gt=0)
    grad_accumulation: int = option(1, "micro-steps per optimizer step (same gradients as the large batch)", ge=1)
    batchnorm_decay: Literal["per-micro-batch", "per-optimizer-step"] = option(
        "per-micro-batch",
        "under --grad-accumulation k: BatchNorm running statistics decay by momentum m at each micro-batch "
        "(per-micro-batch) or by m once per optimizer step as the large batch's (per-optimizer-step: m becomes "
        "1 - (1 - m)^(1/k))",
    )
    clip_grad_norm: float = option(0.0, "clip the total gradient norm to this value after unscaling (0: no clip)", ge=0)
    optim: OptimConfig = option(OptimConfig(learning_rate=0.1), "optimizer (each recipe sets its own defaults)")
    schedule: ScheduleConfig = option(ScheduleConfig(), "learning-rate schedule")
    num_workers: int = option(0, "DataLoader worker processes", ge=0)
    pin_memory: Switch = option(
        "auto", "page-locked loader batches, copied to the GPU without blocking (auto: on when the device is CUDA)"
    )
    persistent_workers: Switch = option(
        "auto", "keep the loader workers alive from epoch to epoch (auto: on when --num-workers > 0)"
    )
    prefetch_factor: int = option(
        DEFAULT_PREFETCH_FACTOR, "batches each loader worker prepares ahead (PyTorch's default; workers only)", ge=1
    )
    log_every: int = option(10, "log training metrics every N optimizer steps", ge=1)
    health_every: int = option(
        200,
        "log training health (per-block gradient norm, update/weight ratio, dead ReLU units) every N optimizer "
        "steps, warning once per problem (0: off)",
        ge=0,
    )
    eval_every_epochs: int = option(1, "evaluate every N epochs (and always after the last)", ge=1)
    checkpoint_every: int = option(0, "also save ckpt/last.pt every N optimizer steps (0: at epoch ends only)", ge=0)
    async_checkpoint: bool = option(
        False,
        "write checkpoints in a background thread (a copy in host memory first) while training goes on; the next "
        "save waits for the previous one",
    )
    keep_checkpoints: int = option(
        2, "keep the last K saves (ckpt/step_*.pt): a corrupt last.pt falls back to them", ge=1
    )
    resume: str = option(
        "auto",
        "auto: continue from run_dir's checkpoint if there is one; never: refuse to touch one; or a path",
        metavar="auto|never|PATH",
    )
    overwrite: bool = option(False, "start over in a run_dir that holds a checkpoint (deletes its ckpt/ and logs)")
    max_skipped_steps: int = option(
        20, "stop after this many consecutive overflow-skipped steps (dynamic loss scaling only; 0: never skip)", ge=0
    )
    tensorboard: bool = option(True, "write TensorBoard scalars to run_dir/tb")
    wandb: Literal["off", "online", "offline"] = option("off", "Weights & Biases logging mode")
    wandb_project: str = option("", "W&B project ('': $WANDB_PROJECT, else trainlab)")
    wandb_entity: str = option("", "W&B entity (team or user; '': $WANDB_ENTITY or your default)")
    wandb_name: str = option("", "W&B run name ('': the run directory's name)")
    progress: bool = option(True, "progress bar on a terminal; otherwise a plain line every --log-every steps")
    deterministic: bool = option(False, "deterministic cuDNN kernels (slower)")
    ddp_find_unused_parameters: bool = option(False, "DDP find_unused_parameters (only for models that need it)")
    dist_timeout: float = option(
        300.0,
        "seconds a training collective waits for the other processes before the run stops, naming the ranks that "
        "did not answer (NCCL's own default: 600; raise it for a long first --compile)",
        gt=0,
        le=86400,
    )
    fsdp: bool = option(
        False,
        "under torchrun, shard each trained model's parameters, gradients and optimizer states over the processes "
        "(FSDP2, block by block; one process: no-op); each checkpoint is a folder every process writes its shards "
        "into (torch.distributed.checkpoint), resumed on any number of processes",
    )
    fsdp_reshard_after_forward: bool = option(
        True, "--fsdp: free each block's gathered parameters after its forward (gathered again for backward)"
    )
    fsdp_cpu_offload: bool = option(
        False, "--fsdp: keep the parameter, gradient and optimizer-state shards in host memory (CUDA runs)"
    )
    activation_checkpointing: bool = option(
        False, "recompute activations in backward instead of keeping them (less memory, one more forward per block)"
    )
    compile: bool = option(
        False, "torch.compile the trained models' training forward (inductor; the first step compiles)"
    )
    memory_snapshot: str = option("", "write a CUDA memory snapshot (pytorch.org/memory_viz) of the first steps here")
    debug: bool = option(False, "tiny data, a few steps, save, reload, more steps; check resumed losses match")

    @classmethod
    def unrecorded(cls, stored: Mapping[str, Any]) -> dict[str, Any]:
        """What a run did in place of settings its checkpoint predates, where that was not today's default:
        {field: value}, given the checkpoint's stored config. A resume compares them as if recorded. Default: none
        (a setting a checkpoint does not record behaved as its default)."""
        return {}

    def validate(self) -> None:
        """One-line UsageErrors for values no run can use (checked before anything is built): every number against
        the range declared on its field (again, for configs built in Python rather than by `from_dict`), then the
        rules across fields and the environment."""
        from trainlab.engine.metrics import check_wandb_login

        check_ranges(self)
        check_wandb_login(self.wandb)
        check_device_name(self.device, training=True)
        self.loader_options(None if self.device == "auto" else self.device.split(":")[0])
        self.optim.validate()
        self._check_optimizer_numbers()
        self._check_fsdp()

    def _check_fsdp(self) -> None:
        """What `--fsdp` cannot combine with yet, refused before anything is built."""
        if not self.fsdp:
            changed = ["--fsdp-reshard-after-forward false"] if not self.fsdp_reshard_after_forward else []
            changed += ["--fsdp-cpu-offload"] if self.fsdp_cpu_offload else []
            if changed:
                raise UsageError(f"{changed[0]} only applies with --fsdp: add --fsdp or drop it")
            return
        if self.compile:
            raise UsageError("--compile with --fsdp is not built yet: drop --compile (or --fsdp)")
        if self.precision in ("fp16", "bf16", "fp16-scale"):
            raise UsageError(
                f"--precision {self.precision} (pure 16-bit weights) with --fsdp is not built yet: use "
                f"--precision {'bf16-amp' if self.precision == 'bf16' else 'fp16-amp-scale'} (fp32 weight shards, "
                "16-bit compute)"
            )

    def loader_options(self, device_type: str | None) -> LoaderOptions:
        """The training loader's settings on `device_type` (`trainlab.data.loader_options`; None: not known yet).

        Raises:
            UsageError: a loader setting the run cannot use (`--pin-memory on` off CUDA, ...).
        """
        return resolve_loader_options(
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor,
            device_type=device_type,
        )

    def _check_optimizer_numbers(self) -> None:
        """The optimizer applies the learning rate (at its largest: peak x the schedule's largest ratio; a `base_`
        rate is per 256 images, x batch_size / 256, `OptimConfig.peak_lr`) and the weight decay as numbers of the
        weights' dtype: above float32's largest (fp16's, 65504, with fp16 weights) they cannot be applied at all and
        the first step failed with an overflow traceback. Every learning rate and weight decay is checked, in nested
        groups too (`--optim.learning-rate`, `--discriminator-optim.weight-decay`)."""
        fp16 = self.precision in ("fp16", "fp16-scale")
        limit, kind = (FP16_MAX, "fp16") if fp16 else (FLOAT32_MAX, "float32")
        ratio = max(1.0, self.schedule.warmup_start_ratio, self.schedule.final_ratio)
        for dotted, value in _numbers(self):
            name = dotted.rsplit(".", 1)[-1]
            steps: list[tuple[str, float]] = []  # how the setting grows into the number applied
            if name.endswith("learning_rate"):
                if name.startswith("base_"):
                    steps.append((f"x batch {self.batch_size} / 256", self.batch_size / 256))
                if ratio > 1:
                    steps.append((f"x the schedule's largest ratio {ratio:g}", ratio))
            elif name.endswith("weight_decay"):
                if self.schedule.weight_decay_end > value:
                    steps.append((f"rising to --schedule.weight-decay-end {self.schedule.weight_decay_end:g}", 0.0))
            else:
                continue
            applied = float(value)
            for _, factor in steps:
                applied = applied * factor if factor else self.schedule.weight_decay_end
            if applied > limit:
                how = "".join(f" {text}" for text, _ in steps) + (f" = {applied:g}" if steps else "")
                fix = "; lower it or use an -amp or bf16 precision" if fp16 else "; lower it"
                raise UsageError(
                    f"--{dotted.replace('_', '-')} {value:g}{how} exceeds the largest {kind} number {limit:g}, which "
                    f"the optimizer cannot apply to {'--precision ' + self.precision if fp16 else 'the'} weights{fix}"
                )


def _numbers(config: Any, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted field name, value) of every int / float field of a config, nested groups included."""
    out: list[tuple[str, float]] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out += _numbers(value, f"{prefix}{f.name}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((prefix + f.name, value))
    return out


@dataclass
class Phase:
    """One optimizer and the modules it trains. Most recipes have exactly one phase, named 'main'."""

    name: str
    optimizer: torch.optim.Optimizer
    modules: list[str]
    clip_grad_norm: float | None = None  # None: use TrainConfig.clip_grad_norm


@dataclass
class TrainParts:
    """What `Recipe.build` returns: the models and optimizers, no data.

    Attributes:
        models: trained models (fp32 on `device`; the engine applies the precision mode, DDP and checkpoints them).
        phases: one optimizer each, naming the entries of `models` it trains.
        frozen: models used but never updated (moved to the device, eval mode, no gradients, not checkpointed).
        averaged: averaged copies the engine keeps of trained models, by the copy's name (`engine.ema`; e.g.
            {"var_ema": WeightAverage(follows="var", decay=0.9999)}). Names are unique across the three slots.
        shard_units: per trained model's name, its blocks: the submodules `--fsdp` shards one by one (each is
            all-gathered whole for its forward and backward) before the rest of the model goes in one last unit
            (the root). A missing or empty entry: the root only. Name the repeated blocks (transformer blocks,
            ResNet stages), in forward order; a unit may hold units named before it (it then owns the parameters
            they do not hold: name a submodule the recipe calls on its own, outside the model's forward, this way).
            An averaged copy is sharded like the model it follows.
    """

    models: dict[str, nn.Module]
    phases: list[Phase]
    frozen: dict[str, nn.Module] = field(default_factory=dict)
    averaged: dict[str, WeightAverage] = field(default_factory=dict)
    shard_units: dict[str, list[nn.Module]] = field(default_factory=dict)


ConfigT = TypeVar("ConfigT", bound=TrainConfig)
_METHOD_KINDS = (types.FunctionType, property, staticmethod, classmethod, functools.cached_property)


def unwrap_model(module: nn.Module) -> nn.Module:
    """The model itself under the engine's wrappers (DDP, `--compile`), to reach its own methods and attributes
    from `train_step` / `after_optimizer_step` (calling the wrapped module runs its forward)."""
    while True:
        inner = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            inner = module.module if isinstance(module, DistributedDataParallel) else None
        if inner is None:
            return module
        module = inner


def apply_activation_checkpointing(recipe: Recipe[Any], parts: TrainParts) -> list[str]:
    """Switch activation checkpointing of the trained models to `--activation-checkpointing`, through each model's
    `set_grad_checkpointing` (`trainlab.models.grad_checkpoint`); recipes never toggle it themselves.

    Returns:
        The names of the trained models that support it.

    Raises:
        UsageError: the flag is on and none of the recipe's trained models supports it.
    """
    enabled = recipe.config.activation_checkpointing
    supported = [name for name, model in parts.models.items() if set_grad_checkpointing(model, enabled)]
    if enabled and not supported:
        raise UsageError(
            f"--activation-checkpointing is not implemented by recipe {recipe.name!r} (its models "
            f"{', '.join(parts.models)} have no set_grad_checkpointing); drop the flag"
        )
    return supported


class Recipe(ABC, Generic[ConfigT]):
    """Base class: subclasses set `name`, `config_class`, and implement `build`, `build_data`, `train_step`,
    `example_batch` and `debug_config`. `self.config` is the recipe's own typed config.

    A subclass may set only the class attributes declared here (a misspelt or dead one fails at import).
    """

    name: str = ""
    config_class: type[TrainConfig] = TrainConfig
    best_metric: str = ""  # key returned by evaluate(); '' disables best.pt
    best_mode: Literal["max", "min"] = "max"
    resume_may_change: tuple[str, ...] = ()  # config fields (`data.root`: dotted) a resume may change; all others
    # must equal the checkpoint's (a resume that would silently compute something else is refused, naming the field)
    last_step_repeats_previous: bool = True  # the run's last optimizer step runs what the one before it runs (the
    # planner then copies that step instead of tracing it, `memory.step_repeat`); False where it does something less

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse public class attributes the engine does not read (a typo such as `best_metrc`, or a dead setting):
        what a recipe declares must change what the engine does."""
        super().__init_subclass__(**kwargs)
        known = set(Recipe.__annotations__) | set(vars(Recipe))
        unknown = sorted(
            name
            for name, value in vars(cls).items()
            if not name.startswith("_") and name not in known and not isinstance(value, _METHOD_KINDS)
        )
        if unknown:
            raise TypeError(
                f"recipe class {cls.__name__} sets {', '.join(unknown)}, which the engine does not read; the class "
                f"attributes a recipe may set are {', '.join(sorted(Recipe.__annotations__))} (its own state belongs "
                "in __init__)"
            )

    def __init__(self, config: ConfigT) -> None:
        if not isinstance(config, self.config_class):
            raise TypeError(f"recipe {self.name!r} takes a {self.config_class.__name__}, got {type(config).__name__}")
        self.config: ConfigT = config

    @abstractmethod
    def build(self, device: torch.device) -> TrainParts:
        """Create the models (on `device`, fp32), frozen models and optimizers. Must not read training data."""

    @abstractmethod
    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        """The training dataset (its items are `Batch` dicts); called after `build`, with its parts."""

    @abstractmethod
    def example_batch(self, batch_size: int) -> Batch:
        """A batch of `batch_size` samples with the shapes and dtypes of real ones (CPU, no data read)."""

    def prepare_batch(self, batch: Batch) -> Batch:
        """A loader batch on the device, before the precision cast: what `first_pass` and `train_step` see. It must
        be a function of the batch alone (a phase or a first pass that replays a micro-batch prepares it again)."""
        return batch

    @abstractmethod
    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        """Forward and loss of one micro-batch. Must return {'loss': scalar tensor, **metrics}."""

    def after_optimizer_step(self, models: Mapping[str, nn.Module], phase: str, info: StepInfo) -> dict[str, float]:
        """Called once per optimizer step of `phase`, right after `optimizer.step()` (momentum encoders, EMA
        codebooks, code restarts). Runs on every rank; returns extra metrics of the step. Default: nothing."""
        return {}

    def has_first_pass(self, phase: str, info: StepInfo) -> bool:
        """Whether `first_pass` runs before this optimizer step's micro-steps of `phase` (then the engine keeps the
        micro-batches' host copies and hands them to the device twice). Default: no."""
        return False

    def first_pass(
        self, models: Mapping[str, nn.Module], micro_batches: Iterable[Batch], phase: str, info: StepInfo
    ) -> None:
        """Sees every micro-batch of the optimizer step, in order, before the first `train_step` (under the precision
        mode's autocast, no gradient recorded); whatever it computes, `train_step` uses. Default: nothing."""

    def phase_active(self, phase: str, step: int) -> bool:
        """Whether `phase` trains at optimizer step `step` (e.g. a discriminator that starts late)."""
        return True

    def evaluate(self, models: Mapping[str, nn.Module], device: torch.device, epoch: int) -> dict[str, float]:
        """Metrics on held-out data after an epoch (rank 0 only, models in eval mode). Default: none."""
        return {}

    def on_fit_end(self, models: Mapping[str, nn.Module]) -> None:
        """Training reached its last step (not called on an interruption; rank 0 only): export weights here."""

    def model_family(self) -> ModelFamily:
        """How well the trained model fills a GPU: the family whose efficiency (`memory.efficiency`) the planner
        assumes until one is measured. Default: a small convnet (CIFAR-size, toy)."""
        return "small-convnet"

    def plan_notes(self, gpus: int, accumulation: int, micro_batch: int) -> list[str]:
        """Lines `trainlab plan` prints under the plan for this configuration: what the split of the batch into
        `gpus` x `accumulation` micro-batches changes for this recipe (default: nothing to say)."""
        return []

    def accumulation_note(self, gpus: int, accumulation: int) -> str:
        """What gradient accumulation, offered as a lever by `trainlab plan`, changes for this recipe besides memory
        ('' where the step is the large batch's: the default)."""
        return ""

    def hand_formula_depth(self) -> int | None:
        """The transformer depth the seed's hand formula of `trainlab plan` takes (None: no depth to give it)."""
        return None

    @abstractmethod
    def debug_config(self) -> ConfigT:
        """A tiny variant of `self.config` that trains in seconds on a CPU: smaller model and data only (--debug and
        the golden runs apply the engine's debug settings on top: `engine.debug.debug_run_config`)."""

    def state_dict(self) -> dict[str, Any]:
        """Recipe state beyond models/optimizers that must survive a resume (e.g. counters)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
