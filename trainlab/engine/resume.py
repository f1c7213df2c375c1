"""Relaunch and resume: what a run directory may be reused for, what a resume may change, and the Trainer's state
written into a checkpoint (`training_state`) and read back (`restore`).

Decided before anything is built (`plan_relaunch`), after the run-dir lock is taken:

- `--overwrite` starts over; it refuses an explicit `--resume PATH` or `--resume never` (each contradicts it).
- A run directory whose `config.yaml` records another recipe (or that holds logs without a `config.yaml` naming
  theirs) is refused without `--overwrite`: its logs are not replaced by a different recipe's.
- `--resume auto` continues the run directory's newest usable checkpoint (a damaged `last.pt` falls back to the kept
  `step_*.pt`); `--resume never` refuses to touch one; `--resume PATH` continues PATH.
- A resume must compute what the checkpoint's run computed: every config field equals the checkpoint's except the
  engine's `ENGINE_MAY_CHANGE`, every `*learning_rate` field (lower it after a divergence), and the recipe's
  `resume_may_change` (evaluation / logging settings, moved paths); those are applied and logged. A checkpoint that
  records no config (none of the fields every trainlab checkpoint records) cannot be checked and is refused. A
  field the checkpoint does not record (written by an older trainlab) must be at its default.

The config a checkpoint records is read under today's setting names first (`trainlab.config.upgrade_keys`: a
setting renamed since keeps its old spelling for one release), so a checkpoint written before a rename still resumes
and is still checked field by field.

Checked once the data and models exist (`check_fits`): the dataset size and steps per epoch (another dataset would
silently change the schedule's length), the progress counters against them, and every optimizer state tensor
against its parameter's shape. `check_structure` validates a checkpoint's layout and types first, so that a damaged
file is one line naming it, never a traceback from deep inside a load. The layout itself is `engine.checkpoint`'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from trainlab import dist
from trainlab.config import to_dict, upgrade_keys
from trainlab.engine import sharded_checkpoint as sharded
from trainlab.engine.assemble import Assembly
from trainlab.engine.checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    CheckpointStore,
    Progress,
    load_checkpoint,
    non_finite_weights,
)
from trainlab.engine.fsdp import full_state, load_model_state, load_optimizer_state
from trainlab.engine.recipe import Phase, Recipe, TrainConfig
from trainlab.engine.run_dir import RunDir
from trainlab.engine.seeding import rng_state, set_rng_state
from trainlab.errors import UsageError, first_line, missing_file

log = logging.getLogger(__name__)

# Engine fields a resume may change (applied and logged); every other field must equal the checkpoint's.
ENGINE_MAY_CHANGE = (
    "run_dir",
    "device",
    "max_steps",
    "clip_grad_norm",  # after a divergence: clip
    "static_loss_scale",  # after a divergence: another loss scale (fp16-scale)
    "max_skipped_steps",  # after a divergence: more patience for overflow skips
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
    "log_every",
    "eval_every_epochs",
    "checkpoint_every",
    "keep_checkpoints",
    "resume",
    "overwrite",
    "tensorboard",
    "wandb",
    "wandb_project",
    "wandb_entity",
    "wandb_name",
    "progress",
    "deterministic",
    "activation_checkpointing",  # the same losses and gradients, recomputed
    "compile",  # the same computation, float arithmetic reordered
    "ddp_find_unused_parameters",
    "fsdp",  # a checkpoint, whole file or sharded folder, resumes sharded or not, on any number of processes
    "async_checkpoint",  # when the files are written, not what they hold
    "fsdp_reshard_after_forward",
    "fsdp_cpu_offload",
    "dist_timeout",  # how long the collectives wait, not what they compute
    "health_every",  # observed steps only read tensors: the same losses (engine/health.py)
    "memory_snapshot",
    "debug",
)
LEARNING_RATE_SUFFIX = "learning_rate"  # every `*learning_rate` field of any recipe may change on resume
# Fields every trainlab checkpoint's config has recorded since the first format: a config without them is no config.
ALWAYS_RECORDED = ("seed", "precision", "epochs", "batch_size", "grad_accumulation")


def may_change(key: str, recipe_fields: Iterable[str]) -> bool:
    """Whether the dotted config key `key` may differ from the checkpoint's on resume."""
    top, fields = key.split(".")[0], set(recipe_fields)
    named = key in fields or top in fields  # a field (`data.root`), or a whole group (`schedule`)
    return named or top in ENGINE_MAY_CHANGE or key.endswith(LEARNING_RATE_SUFFIX)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config dicts as dotted keys ({"schedule": {"kind": ...}} -> {"schedule.kind": ...})."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _defaults(config: TrainConfig) -> dict[str, Any]:
    try:
        return flatten(to_dict(type(config)()))
    except (TypeError, ValueError):  # a config class without defaults for every field: nothing is assumed
        return {}


def check_config(saved: Any, config: TrainConfig, path: Path, recipe_fields: Iterable[str]) -> list[str]:
    """Refuse a resume that would silently compute something else; return the allowed changes ("key a -> b").

    Raises:
        UsageError: the checkpoint records no config, or a field that must match differs (named with its flag).
    """
    missing = [k for k in ALWAYS_RECORDED if k not in saved] if isinstance(saved, Mapping) else list(ALWAYS_RECORDED)
    if not missing:  # settings renamed since the checkpoint was written: under their current names, and what the
        # run did in place of settings it predates (`TrainConfig.unrecorded`)
        saved = upgrade_keys(type(config), dict(saved), f"checkpoint {path}")
        saved = {**type(config).unrecorded(saved), **saved}
    if missing:
        raise UsageError(
            f"checkpoint {path} records no config (no {', '.join(missing)}), so this run cannot be checked against the "
            "one that wrote it; resume from a checkpoint trainlab wrote, or start over (--overwrite or a new --run-dir)"
        )
    fields = tuple(recipe_fields)
    old, now = flatten(saved), flatten(to_dict(config))
    defaults = _defaults(config)
    changed = []
    for key in sorted(now):
        if key not in old:  # a field the writing version did not have: it behaved as the default
            if key in defaults and now[key] != defaults[key] and not may_change(key, fields):
                raise UsageError(
                    f"checkpoint {path} does not record {key} (written by an older trainlab, which had none) and this "
                    f"run sets {key}={now[key]!r}; resume with the default {_flag(key)} {defaults[key]!r}, or start "
                    "over (--overwrite or a new --run-dir)"
                )
            continue
        if old[key] == now[key]:
            continue
        if may_change(key, fields):
            changed.append(f"{key} {old[key]!r} -> {now[key]!r}")
            continue
        raise UsageError(
            f"checkpoint {path} was trained with {key}={old[key]!r} but this run has {key}={now[key]!r}; "
            f"resume with the same {_flag(key)}, or start over (--overwrite or a new --run-dir)"
        )
    return changed


# ------------------------------------------------------------------------------------------- structure
def _damaged(path: Path, what: str) -> UsageError:
    return UsageError(
        f"checkpoint {path} is incomplete or damaged ({what}); resume from another checkpoint (ckpt/step_*.pt) or "
        "start over with --overwrite"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """An int or float that converts to a float (an int of 400 digits does not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _mapping(state: Mapping[str, Any], key: str, path: Path) -> Mapping[str, Any]:
    value = state.get(key)
    if not isinstance(value, Mapping):
        raise _damaged(path, f"{key!r} is {type(value).__name__}, not a mapping")
    return value


def check_structure(state: Mapping[str, Any], path: Path) -> None:
    """Validate a training checkpoint's layout and types (not yet its fit to this run's models and data).

    Raises:
        UsageError: a missing or mistyped entry, named with the file and the fix.
    """
    for key in ("step", "epoch", "step_in_epoch"):
        if not _is_int(state.get(key)) or state[key] < 0:
            raise _damaged(path, f"{key!r} is {state.get(key)!r}, not a count")
    if state.get("best_score") is not None and not (
        _is_number(state["best_score"]) and math.isfinite(state["best_score"])
    ):  # NaN or inf: no later score would be best, and best.pt would never be written again
        raise _damaged(path, f"'best_score' is {state['best_score']!r:.40}, not a finite number")
    if state.get("best_step") is not None and not (_is_int(state["best_step"]) and state["best_step"] >= 0):
        raise _damaged(path, f"'best_step' is {state['best_step']!r}, not a step")
    if not isinstance(state.get("eval_pending", False), bool):
        raise _damaged(path, f"'eval_pending' is {state['eval_pending']!r}, not true or false")
    if state.get("last_eval_epoch") is not None and not _is_int(state["last_eval_epoch"]):
        raise _damaged(path, f"'last_eval_epoch' is {state['last_eval_epoch']!r}, not an epoch")
    last_eval = state.get("last_eval", {})
    if not isinstance(last_eval, Mapping) or not all(
        isinstance(k, str) and _is_number(v) for k, v in last_eval.items()
    ):
        raise _damaged(path, f"'last_eval' is {last_eval!r:.60}, not metric names -> numbers")
    for key in ("models", "optimizers", "scalers", "schedulers"):
        for name, entry in _mapping(state, key, path).items():
            if not isinstance(entry, Mapping):
                raise _damaged(path, f"{key}[{name!r}] is {type(entry).__name__}, not a mapping")
    for name, weights in state["models"].items():
        bad = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise _damaged(path, f"models[{name!r}][{bad[0]!r}] is not a tensor")
    for name, entry in (_mapping(state, "averaged", path) if "averaged" in state else {}).items():
        weights = entry.get("weights") if isinstance(entry, Mapping) else None
        if not (
            isinstance(weights, Mapping) and isinstance(entry.get("follows"), str) and _is_number(entry.get("decay"))
        ):
            raise _damaged(path, f"averaged[{name!r}] has no 'follows' name, 'decay' number and 'weights' mapping")
        bad = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise _damaged(path, f"averaged[{name!r}]['weights'][{bad[0]!r}] is not a tensor")
    for name, opt in state["optimizers"].items():
        if not isinstance(opt.get("state"), Mapping) or not isinstance(opt.get("param_groups"), list):
            raise _damaged(path, f"optimizers[{name!r}] has no 'state' mapping and 'param_groups' list")
    for name, sched in state["schedulers"].items():
        if not (_is_int(sched.get("last_step")) and _is_int(sched.get("total_steps"))):
            raise _damaged(path, f"schedulers[{name!r}] has no integer 'last_step' and 'total_steps'")
    _mapping(state, "recipe_state", path)
    data = state.get("data")
    if data is not None and not (
        isinstance(data, Mapping) and _is_int(data.get("dataset_size")) and _is_int(data.get("steps_per_epoch"))
    ):
        raise _damaged(path, "'data' has no integer 'dataset_size' and 'steps_per_epoch'")
    _check_rng(state.get("rng_per_rank"), path)


def _check_rng(rngs: Any, path: Path) -> None:
    """Every rank's RNG state must restore: tried on this process's generators, then put back as they were."""
    if not isinstance(rngs, list) or not rngs:
        raise _damaged(path, f"'rng_per_rank' is {rngs!r:.40}, not a list of every rank's RNG state")
    current = rng_state()
    try:
        for rank, entry in enumerate(rngs):
            if not isinstance(entry, Mapping):
                raise _damaged(path, f"rng_per_rank[{rank}] is {type(entry).__name__}, not an RNG state")
            try:
                set_rng_state(dict(entry))
            except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as err:
                raise _damaged(path, f"rng_per_rank[{rank}]: {type(err).__name__}: {str(err)[:80]}") from None
    finally:
        set_rng_state(current)


# ------------------------------------------------------------------------------------- fit to this run
def check_fits(
    state: Mapping[str, Any],
    path: Path,
    *,
    dataset_size: int,
    steps_per_epoch: int,
    total_steps: int,
    batch_size: int,
    phases: list[Phase],
) -> None:
    """The checkpoint against this run's data and optimizers (after `check_structure` and `check_config`).

    Raises:
        UsageError: another dataset size (the schedule's length would change), counters that do not add up, or
            optimizer state that does not fit the parameters.
    """
    data = state.get("data")
    if data is not None:
        if (data["dataset_size"], data["steps_per_epoch"]) != (dataset_size, steps_per_epoch):
            raise UsageError(
                f"checkpoint {path} was trained on a dataset of {data['dataset_size']} samples "
                f"({data['steps_per_epoch']} steps per epoch) but this run's has {dataset_size} samples "
                f"({steps_per_epoch} steps per epoch at batch {batch_size}): the schedule's length would change; "
                "resume with the same data (--data.root), or start over (--overwrite or a new --run-dir)"
            )
    else:  # written before checkpoints recorded the data: the schedulers' horizon says the same
        for name, sched in state["schedulers"].items():
            if sched["total_steps"] != total_steps:
                raise UsageError(
                    f"checkpoint {path} was trained with a schedule of {sched['total_steps']} steps ({name}) but this "
                    f"run's data gives {total_steps} ({dataset_size} samples, {steps_per_epoch} steps per epoch at "
                    f"batch {batch_size}): another dataset size; resume with the same data (--data.root), or start "
                    "over (--overwrite or a new --run-dir)"
                )
    step, epoch, in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
    if in_epoch >= steps_per_epoch or step != epoch * steps_per_epoch + in_epoch:
        raise _damaged(
            path, f"step {step} is not epoch {epoch} x {steps_per_epoch} steps + {in_epoch} steps into the epoch"
        )
    for phase in phases:
        if phase.name not in state["optimizers"]:
            raise _damaged(path, f"no optimizer state for phase {phase.name!r}")
        _check_optimizer_state(state["optimizers"][phase.name], phase.optimizer, path, phase.name)


def _check_optimizer_state(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer, path: Path, name: str) -> None:
    """Saved param groups of the same sizes, and each parameter's non-scalar state tensors of its shape."""
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise _damaged(
            path, f"optimizer {name!r} has {len(groups)} parameter groups, this run {len(optimizer.param_groups)}"
        )
    params: dict[Any, nn.Parameter] = {}
    for index, (old, new) in enumerate(zip(groups, optimizer.param_groups)):
        ids = old.get("params") if isinstance(old, Mapping) else None
        if not isinstance(ids, list) or len(ids) != len(new["params"]):
            raise _damaged(path, f"optimizer {name!r} group {index} does not hold this run's parameters")
        params.update(zip(ids, new["params"]))
    for pid, entry in saved["state"].items():
        param = params.get(pid)
        if param is None or not isinstance(entry, Mapping):
            raise _damaged(path, f"optimizer {name!r} holds state for an unknown parameter {pid!r}")
        for key, value in entry.items():
            if value is None or (key == "step" and _is_number(value)):  # SGD without momentum; a step count
                continue
            if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or key == "step"):
                what = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
                raise _damaged(path, f"optimizer {name!r} state {key!r} of a parameter is {what}, not numbers")
            # a step count is one number; every other state (moments, momentum) has the parameter's shape
            if (value.dim() > 0 or key != "step") and value.shape != param.shape:
                raise _damaged(
                    path,
                    f"optimizer {name!r} state {key!r} of a parameter has shape {tuple(value.shape)}, the parameter "
                    f"{tuple(param.shape)}",
                )


# ------------------------------------------------------------------------------------------- the plan
@dataclass
class RelaunchPlan:
    """What this launch does with its run directory: start fresh (replacing logs of an attempt that saved no
    checkpoint), start over (`--overwrite`), or resume `state` read from `path`."""

    kind: Literal["fresh", "overwrite", "resume"]
    state: dict[str, Any] | None = None
    path: Path | None = None
    replace_logs: bool = False


def plan_relaunch(
    config: TrainConfig,
    recipe_name: str,
    recipe_fields: Iterable[str],
    store: CheckpointStore,
    run_dir: Path,
) -> RelaunchPlan:
    """Apply the relaunch rules (module docstring); reads the checkpoint to resume, deletes nothing.

    Raises:
        UsageError: contradictory flags, another recipe's run directory, a checkpoint that cannot be resumed here.
    """
    resume = config.resume or "never"
    if config.overwrite:
        if resume != "auto":
            what = "never touch them" if resume == "never" else "continue that checkpoint"
            raise UsageError(
                f"--overwrite (start over, deleting the checkpoints in {run_dir}) contradicts --resume {resume} "
                f"({what}): pass only one of them"
            )
        _refuse_deleting_inputs(config, run_dir)
        return RelaunchPlan("overwrite")
    _check_run_dir_recipe(run_dir, recipe_name)
    for where in (store.last, store.best):  # found now, not at the first save after minutes of training
        if where.is_dir() and not where.is_symlink():
            raise UsageError(f"{where} is a folder where the run keeps a checkpoint file; move it away, then relaunch")
    fields = tuple(recipe_fields)

    def usable(state: dict[str, Any], path: Path) -> None:
        check_structure(state, path)

    if resume != "auto" and resume != "never":
        path = sharded.index_path(Path(resume))
        if not path.is_file():
            raise UsageError(
                f"checkpoint {resume} {missing_file(path)}; pass an existing file (or a sharded checkpoint's folder), "
                "or --resume auto"
            )
        state = load_checkpoint(path, whole=False)
        _check_recipe(state, path, recipe_name)
        usable(state, path)
        return _resumable(state, path, config, fields)
    if not store.exists():
        if store.best.exists() or store.best.is_symlink():  # starting fresh would delete the run's best weights
            raise UsageError(
                f"{run_dir} holds {store.best} but no last.pt to resume: continue from it with --resume "
                f"{store.best}, start over with --overwrite (deleting it), or pass a new --run-dir"
            )
        return RelaunchPlan("fresh", replace_logs=RunDir(run_dir).metrics.exists())
    if resume == "never":
        raise UsageError(
            f"{run_dir} holds a checkpoint; continue it with --resume auto (the default), start over with "
            "--overwrite, or pass a new --run-dir"
        )
    state, path = store.load_latest(check=usable)
    _check_recipe(state, path, recipe_name)
    log.info("%s holds a checkpoint: resuming it (--overwrite starts over)", run_dir)
    return _resumable(state, path, config, fields)


def _refuse_deleting_inputs(config: TrainConfig, run_dir: Path) -> None:
    """`--overwrite` deletes the run directory's checkpoints and logs: refuse it when a setting reads a file among
    them (`--moco-weights RUN_DIR/ckpt/last.pt` of the run being overwritten), which would be gone before it is read
    again at the next relaunch.

    Raises:
        UsageError: naming the setting and the file.
    """
    try:
        inside = run_dir.resolve()
    except OSError:
        return
    for key, value in flatten(to_dict(config)).items():
        if key in ("run_dir", "resume") or not isinstance(value, (str, Path)) or not str(value):
            continue
        try:
            path = Path(value).resolve()
        except (OSError, ValueError):
            continue
        if path.is_file() and inside in path.parents:
            raise UsageError(
                f"--overwrite would delete {value}, which {_flag(key)} reads (it is inside {run_dir}); copy it out of "
                "the run directory first, or pass a new --run-dir"
            )


def _resumable(state: dict[str, Any], path: Path, config: TrainConfig, fields: tuple[str, ...]) -> RelaunchPlan:
    changed = check_config(state.get("config"), config, path, fields)
    if changed:
        log.info("resuming with changed settings (applied): %s", "; ".join(changed))
    return RelaunchPlan("resume", state=state, path=path)


def _check_recipe(state: Mapping[str, Any], path: Path, recipe_name: str) -> None:
    if state.get("recipe") != recipe_name:
        raise UsageError(f"checkpoint {path} is from recipe {state.get('recipe')!r}, not {recipe_name!r}")


def _check_run_dir_recipe(run_dir: Path, recipe_name: str) -> None:
    """A run directory is one recipe's: its config.yaml names it (logs without one are of an unknown recipe)."""
    files = RunDir(run_dir)
    recorded = files.recipe()
    if recorded is not None and recorded != recipe_name:
        raise UsageError(
            f"{run_dir} holds a {recorded!r} run (its config.yaml), not {recipe_name!r}; pass another --run-dir, or "
            "--overwrite to replace its checkpoints and logs"
        )
    if recorded is None and files.metrics.exists():
        raise UsageError(
            f"{run_dir} holds logs (metrics.jsonl) but no config.yaml naming their recipe; pass another --run-dir, "
            "or --overwrite to replace them"
        )


# ---------------------------------------------------------------------------------------------- state in / out
def training_state(
    recipe: Recipe[Any], run: Assembly, progress: Progress, dataset_size: int, *, whole: bool = True
) -> dict[str, Any]:
    """Everything a resume needs, to the bit, in `engine.checkpoint`'s format (collective under DDP: every rank's
    RNG state is gathered, so every rank takes part). `whole`: sharded tensors (--fsdp) gathered whole into rank 0's
    host memory (`engine.fsdp.full_state`); else left as this rank's live shards, for a sharded checkpoint
    (`engine.sharded_checkpoint`: every rank writes its own)."""
    per_rank_rng = dist.all_gather_object(rng_state())
    keep = dist.is_main()  # under --fsdp only rank 0, which writes, keeps the gathered tensors

    def tensors(state: Any) -> Any:
        return full_state(state, keep) if whole else state

    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "recipe": recipe.name,
        "config": to_dict(recipe.config),
        "data": {"dataset_size": dataset_size, "steps_per_epoch": run.length.steps_per_epoch},
        "models": {name: tensors(model.state_dict()) for name, model in run.parts.models.items()},
        "averaged": {
            name: {
                "follows": spec.follows,
                "decay": spec.decay,
                "weights": tensors(run.averaged[name].state_dict()),
            }
            for name, spec in run.parts.averaged.items()
        },
        "optimizers": {phase.name: tensors(phase.optimizer.state_dict()) for phase in run.parts.phases},
        "scalers": {name: scaler.state_dict() for name, scaler in run.scalers.items()},
        "schedulers": {name: scheduler.state_dict() for name, scheduler in run.schedulers.items()},
        **progress.to_state(),
        "rng_per_rank": per_rank_rng,
        "recipe_state": recipe.state_dict(),
    }


@dataclass
class Restored:
    """What `restore` read back beyond what it loaded into the models, optimizers and recipe."""

    progress: Progress
    rng: dict[str, Any]  # this rank's RNG state, set when fit() starts


def restore(state: dict[str, Any], path: Path, recipe: Recipe[Any], run: Assembly, *, dataset_size: int) -> Restored:
    """Load a checkpoint that passed the relaunch checks (recipe, structure, config) into the assembled run: models,
    averaged copies, optimizers (with this run's peak learning rates: a resume may lower them after a divergence),
    scalers, schedules, recipe state; returns the progress and this rank's RNG state.

    Raises:
        UsageError: the checkpoint does not fit this run's data, models or optimizers, is incomplete, or holds
            NaN / inf weights.
    """
    cfg = recipe.config
    check_fits(
        state,
        path,
        dataset_size=dataset_size,
        steps_per_epoch=run.length.steps_per_epoch,
        total_steps=run.length.total_steps,
        batch_size=cfg.batch_size,
        phases=run.parts.phases,
    )
    if sharded.is_sharded_index(state):  # the tensors are in its folder: read into the live (sharded) tensors
        state = _read_shards(state, path, run)
    try:
        for name, model in run.parts.models.items():
            try:
                load_model_state(model, state["models"][name])
            except (KeyError, RuntimeError) as err:
                raise UsageError(
                    f"checkpoint {path} does not fit model {name!r} ({first_line(err)}); check --model"
                ) from None
        saved_averages = state.get("averaged", {})
        for name, average in run.averaged.items():
            entry = saved_averages.get(name)
            if entry is None or entry["follows"] != run.parts.averaged[name].follows:
                raise UsageError(
                    f"checkpoint {path} holds no averaged weights {name!r} of model "
                    f"{run.parts.averaged[name].follows!r}; resume with the settings it was trained with, or start "
                    "over (--overwrite or a new --run-dir)"
                )
            try:
                load_model_state(average, entry["weights"])
            except RuntimeError as err:
                raise UsageError(
                    f"checkpoint {path} does not fit averaged model {name!r} ({first_line(err)})"
                ) from None
        for phase in run.parts.phases:
            live = [{k: v for k, v in group.items() if k != "params"} for group in phase.optimizer.param_groups]
            load_optimizer_state(phase.optimizer, state["optimizers"][phase.name])
            for group, hyperparameters in zip(phase.optimizer.param_groups, live):
                # this run's hyperparameters (its config was checked against the checkpoint's; a value edited into
                # the file's groups is not used): the schedule sets lr and weight decay from the checkpoint's step on
                group.update(hyperparameters)
            run.scalers[phase.name].load_state_dict(state["scalers"][phase.name])
            run.schedulers[phase.name].load_state_dict(state["schedulers"][phase.name])
        progress = Progress.from_state(state)
        rngs = state["rng_per_rank"]
        rng = rngs[dist.rank()] if dist.rank() < len(rngs) else rngs[0]
        recipe.load_state_dict(state["recipe_state"])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as err:
        raise UsageError(
            f"checkpoint {path} is incomplete or damaged ({type(err).__name__}: {str(err)[:120]}); resume from "
            "another checkpoint (ckpt/step_*.pt) or start over with --overwrite"
        ) from None
    bad = non_finite_weights({**run.parts.models, **run.averaged})
    if bad:
        raise UsageError(
            f"checkpoint {path} holds NaN or inf in {len(bad)} weight / buffer tensor(s) (first: {bad[0]}); resume "
            "from an earlier checkpoint (ckpt/step_*.pt) or start over with --overwrite"
        )
    return Restored(progress, rng)


def _read_shards(state: dict[str, Any], path: Path, run: Assembly) -> dict[str, Any]:
    """A sharded checkpoint's index with its tensors read from its folder (collective), each straight into the live
    tensor it restores where there is one of the saved shape (this rank's shards under --fsdp; a resharded read when
    the checkpoint was written by another number of processes), an optimizer's states into new tensors sharded like
    their parameters."""
    folder = sharded.check_folder(state, path)
    saved_optimizers = state.get("optimizers", {})
    live = {
        "models": {name: model.state_dict() for name, model in run.parts.models.items()},
        "averaged": {name: {"weights": model.state_dict()} for name, model in run.averaged.items()},
        "optimizers": {
            phase.name: _optimizer_targets(phase.optimizer, saved_optimizers.get(phase.name))
            for phase in run.parts.phases
        },
    }
    try:
        return sharded.load_into(state, folder, live, dist.side_group())
    except sharded.READ_ERRORS as err:  # a folder that does not hold what its index says
        raise UsageError(
            f"checkpoint {path}: its folder {folder} could not be read ({sharded.reason(err)}); resume from "
            "another checkpoint (ckpt/step_*.pt) or start over with --overwrite"
        ) from None


def _optimizer_targets(optimizer: torch.optim.Optimizer, saved: Any) -> dict[str, Any]:
    """Empty tensors like each parameter (sharded like it) for the saved states of the parameter's shape."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    entries = saved.get("state", {}) if isinstance(saved, Mapping) else {}
    return {
        "state": {
            index: {key: torch.empty_like(params[index].detach()) for key in entry}
            for index, entry in entries.items()
            if isinstance(index, int) and index < len(params) and isinstance(entry, Mapping)
        }
    }


def carry_out(plan: RelaunchPlan, store: CheckpointStore, files: RunDir) -> None:
    """Rank 0, when fit starts: the deletions the relaunch plan decided (`--overwrite`; the logs of an attempt that
    saved no checkpoint)."""
    if plan.kind == "overwrite":
        if store.exists() or files.metrics.exists():
            log.warning("--overwrite: deleting the checkpoints and logs in %s and starting over", files.path)
            store.clear()
            files.clear_logs()
    elif plan.kind == "fresh" and plan.replace_logs:
        log.info("no checkpoint in %s: starting fresh (replacing the logs of an attempt that saved none)", files.path)
        store.clear()
        files.clear_logs()
