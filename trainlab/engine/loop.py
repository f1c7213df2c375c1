"""The training loop every recipe runs on: set-up, epochs, evaluation and best/last checkpoints, logging.

`Trainer(recipe).fit()` is the whole public API. Set-up: device and precision (both logged), the process group
under torchrun (none in one process), `recipe.build` (models, frozen models, optimizers), `recipe.build_data`, the
seeded resumable sampler, loss scalers and schedules. One optimizer step is `engine.step.StepRunner.run`:
`grad_accumulation` micro-steps per phase, then once unscale, clip, step, scaler update, the recipe's
`after_optimizer_step`. At each epoch end: evaluation (rank 0), `ckpt/last.pt` and, when the recipe's best metric
improved, `ckpt/best.pt`. SIGTERM / Ctrl-C finish the current step, save and return "interrupted".
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainlab import dist
from trainlab.config import to_dict
from trainlab.engine.checkpoint import CheckpointStore, NonFiniteWeightsError, load_checkpoint, non_finite_weights
from trainlab.engine.compile import check_compile_toolchain, compile_for_training
from trainlab.engine.data import StepBatchSampler, build_loader
from trainlab.engine.health import HealthMonitor
from trainlab.engine.memory import current_rss_bytes, peak_memory, reset_peak, synchronize
from trainlab.engine.metrics import WANDB_RUN_ID_FILE, MetricsLogger, RunProgress
from trainlab.engine.precision import LossScaler, Precision, check_device_support
from trainlab.engine.recipe import Phase, Recipe, StepInfo, TrainConfig, TrainParts, check_activation_checkpointing
from trainlab.engine.run_lock import RunDirLock
from trainlab.engine.runinfo import prepare_run_dir, write_config
from trainlab.engine.schedule import Scheduler
from trainlab.engine.seeding import rng_state, seed_everything, set_deterministic, set_rng_state
from trainlab.engine.signals import graceful_stop
from trainlab.engine.step import StepRunner
from trainlab.errors import TrainingStopped, UsageError
from trainlab.host_memory import host_allocator

log = logging.getLogger(__name__)

# Engine fields a resume may change (applied and logged); every other field must equal the checkpoint's.
ENGINE_MAY_CHANGE = (
    "run_dir",
    "device",
    "max_steps",
    "clip_grad_norm",
    "num_workers",
    "log_every",
    "eval_every_epochs",
    "checkpoint_every",
    "keep_checkpoints",
    "resume",
    "overwrite",
    "max_skipped_steps",
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
    "dist_timeout",
    "health_every",
    "memory_snapshot",
    "debug",
)


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when available (and says so); an explicit CUDA request without CUDA is an error."""
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.info("device: %s (auto: CUDA %savailable)", device, "" if device.type == "cuda" else "not ")
        return device
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {name!r} requested but CUDA is not available here; use --device cpu")
    return device


@dataclass
class Progress:
    """Where the run stands; saved in every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    step_in_epoch: int = 0
    best_score: float | None = None
    best_step: int | None = None  # the step best.pt holds
    eval_pending: bool = False  # saved at an epoch end before its evaluation ran


@dataclass
class FitResult:
    """What `Trainer.fit` returns: how it ended, where, and this call's per-step losses and last evaluation."""

    status: str  # "finished" | "interrupted" | "max_steps"
    step: int
    epoch: int
    losses: list[float]  # per optimizer step (first phase's loss), this process, this call
    last_eval: dict[str, float]


class Trainer:
    """Runs a recipe. Single process needs no process group; under torchrun every rank builds a Trainer."""

    def __init__(self, recipe: Recipe[Any], *, write_outputs: bool = True) -> None:
        self.recipe = recipe
        self.config: TrainConfig = recipe.config
        cfg = self.config
        self.device = resolve_device(cfg.device)
        self.precision = Precision.parse(cfg.precision)
        check_device_support(self.precision, self.device)
        check_activation_checkpointing(recipe)
        compiler = check_compile_toolchain(self.device) if cfg.compile else ""
        if cfg.memory_snapshot and self.device.type != "cuda":
            raise UsageError("--memory-snapshot records the CUDA caching allocator and needs a CUDA device")
        dist.init(self.device.type, cfg.dist_timeout)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", dist.local_rank())
        self.is_main = dist.is_main()
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "ckpt"
        self.write_outputs = write_outputs and self.is_main
        if self.write_outputs:
            prepare_run_dir(self.run_dir)
        if self.device.type == "cpu":
            log.info(host_allocator())
        log.info(
            "precision: %s (weights %s, autocast %s, loss scaling %s)",
            self.precision.name,
            self.precision.param_dtype,
            self.precision.autocast_dtype,
            self.precision.scaling,
        )

        set_deterministic(cfg.deterministic)
        seed_everything(cfg.seed)
        with self.precision.default_dtype():  # fp64: models initialised and data generated in float64
            self.parts: TrainParts = recipe.build(self.device)
            for name, model in self.parts.models.items():
                self.precision.prepare_model(model, keep_batchnorm_fp32=cfg.keep_batchnorm_fp32)
                self.parts.models[name] = model.to(self.device)
            for name, model in self.parts.frozen.items():
                self.parts.frozen[name] = model.to(self.device).eval().requires_grad_(False)
            self.phases: list[Phase] = self.parts.phases
            if not self.phases:
                raise ValueError(f"recipe {recipe.name} built no optimizer phase")
            self.train_dataset = recipe.build_data(self.parts, self.device)
        self.world = dist.world_size()
        self.sampler = StepBatchSampler(
            len(self.train_dataset),  # type: ignore[arg-type]
            batch_size=cfg.batch_size,
            accumulation=cfg.grad_accumulation,
            rank=dist.rank(),
            world=self.world,
            seed=cfg.seed,
        )
        self.loader = build_loader(
            self.train_dataset,
            self.sampler,
            num_workers=cfg.num_workers,
            seed=cfg.seed,
            pin_memory=self.device.type == "cuda",
        )
        self.steps_per_epoch = self.sampler.steps_per_epoch
        self.total_steps = self.steps_per_epoch * cfg.epochs  # the schedule's horizon; --max-steps only stops early
        self.stop_step = min(self.total_steps, cfg.max_steps) if cfg.max_steps > 0 else self.total_steps
        self.store = CheckpointStore(self.ckpt_dir, keep=cfg.keep_checkpoints)
        self.scalers = {
            p.name: LossScaler(self.precision, self.device.type, cfg.static_loss_scale) for p in self.phases
        }
        self.schedulers = {p.name: Scheduler(p.optimizer, cfg.schedule, self.total_steps) for p in self.phases}
        self.wrapped = self._wrap_ddp()
        if cfg.compile:
            trained = sorted({name for phase in self.phases for name in phase.modules})
            for name in trained:
                self.wrapped[name] = compile_for_training(self.wrapped[name])
            log.info(
                "compile: %s of %s for training steps (deterministic kernels; evaluation stays eager)",
                compiler,
                ", ".join(trained),
            )
        self.health = HealthMonitor(  # training health every --health-every steps (engine/health.py)
            self.parts.models,
            self.phases,
            cfg.health_every,
            self.device,
            observe_activations=not cfg.compile,
            warn=self.is_main,
        )
        self.runner = StepRunner(
            recipe=recipe,
            phases=self.phases,
            models=self.parts.models,
            wrapped=self.wrapped,
            frozen=self.parts.frozen,
            scalers=self.scalers,
            schedulers=self.schedulers,
            precision=self.precision,
            device=self.device,
            clip_grad_norm=cfg.clip_grad_norm,
            health=self.health,
        )
        self.progress = Progress()
        self._stop_at_step: int | None = None
        self._rss_at_start = 0
        self._skipped_in_a_row = 0

    # ----------------------------------------------------------------------------------------------- set-up
    def _wrap_ddp(self) -> dict[str, nn.Module]:
        trained = {name for phase in self.phases for name in phase.modules}
        wrapped: dict[str, nn.Module] = {}
        for name, model in self.parts.models.items():
            if self.world > 1 and name in trained and any(p.requires_grad for p in model.parameters()):
                device_ids = [self.device.index] if self.device.type == "cuda" else None
                wrapped[name] = DistributedDataParallel(
                    model,
                    device_ids=device_ids,
                    find_unused_parameters=self.config.ddp_find_unused_parameters,
                    broadcast_buffers=False,
                )
            else:
                wrapped[name] = model
        return wrapped

    # ---------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs, to the bit (collective under DDP: every rank takes part)."""
        per_rank_rng = dist.all_gather_object(rng_state())
        return {
            "format": "trainlab-checkpoint",
            "version": 1,
            "recipe": self.recipe.name,
            "config": to_dict(self.config),
            "models": {n: m.state_dict() for n, m in self.parts.models.items()},
            "optimizers": {p.name: p.optimizer.state_dict() for p in self.phases},
            "scalers": {n: s.state_dict() for n, s in self.scalers.items()},
            "schedulers": {n: s.state_dict() for n, s in self.schedulers.items()},
            "step": self.progress.step,
            "epoch": self.progress.epoch,
            "step_in_epoch": self.progress.step_in_epoch,
            "best_score": self.progress.best_score,
            "best_step": self.progress.best_step,
            "eval_pending": self.progress.eval_pending,
            "rng_per_rank": per_rank_rng,
            "recipe_state": self.recipe.state_dict(),
        }

    def save(self, *, is_best: bool = False) -> None:
        """Write ckpt/last.pt (and best.pt); refuses weights with NaN / inf on every rank alike."""
        if is_best:
            self.progress.best_step = self.progress.step
        bad = non_finite_weights(self.parts.models)
        if bad:
            raise NonFiniteWeightsError(
                f"training diverged: at step {self.progress.step} {len(bad)} weight / buffer tensor(s) hold NaN or inf "
                f"(first: {bad[0]}); the last finite checkpoint is kept: lower the learning rate and resume"
            )
        state = self.state_dict()
        if self.write_outputs:
            self.store.save(state, is_best=is_best)
            log.info("saved %s (step %d%s)", self.store.last, self.progress.step, ", best" if is_best else "")
        dist.barrier("a checkpoint save")  # rank 0's write: waited for on the long timeout, not --dist-timeout

    def load(self, path: Path) -> None:
        """Resume from the checkpoint at `path` (its config must match this run's, see `ENGINE_MAY_CHANGE`)."""
        self._load_state(load_checkpoint(path), path)

    def _load_state(self, state: dict[str, Any], path: Path) -> None:
        if state.get("recipe") != self.recipe.name:
            raise UsageError(f"checkpoint {path} is from recipe {state.get('recipe')!r}, not {self.recipe.name!r}")
        self._check_resume_config(state, path)
        try:
            for name, model in self.parts.models.items():
                try:
                    model.load_state_dict(state["models"][name])
                except (KeyError, RuntimeError) as err:
                    first = str(err).splitlines()[0][:200]
                    raise UsageError(
                        f"checkpoint {path} does not fit model {name!r} ({first}); check --model"
                    ) from None
            for phase in self.phases:
                phase.optimizer.load_state_dict(state["optimizers"][phase.name])
                self.scalers[phase.name].load_state_dict(state["scalers"][phase.name])
                self.schedulers[phase.name].load_state_dict(state["schedulers"][phase.name])
            self.progress = Progress(
                step=int(state["step"]),
                epoch=int(state["epoch"]),
                step_in_epoch=int(state["step_in_epoch"]),
                best_score=state["best_score"],
                best_step=state.get("best_step"),
                eval_pending=bool(state.get("eval_pending", False)),
            )
            rngs = state["rng_per_rank"]
            set_rng_state(rngs[dist.rank()] if dist.rank() < len(rngs) else rngs[0])
            self.recipe.load_state_dict(state["recipe_state"])
        except (KeyError, TypeError, ValueError) as err:
            raise UsageError(
                f"checkpoint {path} is incomplete or damaged ({type(err).__name__}: {str(err)[:120]}); resume from "
                "another checkpoint (ckpt/step_*.pt) or start over with --overwrite"
            ) from None
        if self.write_outputs and path.parent == self.ckpt_dir:
            self.store.repair_best(state, path)
        log.info("resumed from %s at step %d (epoch %d, step %d in epoch)", path, *self._position())

    def _check_resume_config(self, state: dict[str, Any], path: Path) -> None:
        """Refuse a resume that would silently compute something else; apply and log the fields that may change."""
        may_change = set(ENGINE_MAY_CHANGE) | set(self.recipe.resume_may_change)
        saved, now = _flatten(state.get("config", {})), _flatten(to_dict(self.config))
        changed = []
        for key in sorted(set(saved) & set(now)):
            if saved[key] == now[key]:
                continue
            if key.split(".")[0] in may_change:
                changed.append(f"{key} {saved[key]!r} -> {now[key]!r}")
                continue
            flag = "--" + key.replace("_", "-")
            raise UsageError(
                f"checkpoint {path} was trained with {key}={saved[key]!r} but this run has {key}={now[key]!r}; "
                f"resume with the same {flag}, or start over (--overwrite or a new --run-dir)"
            )
        if changed:
            log.info("resuming with changed settings (applied): %s", "; ".join(changed))

    def _position(self) -> tuple[int, int, int]:
        return self.progress.step, self.progress.epoch, self.progress.step_in_epoch

    def _start(self) -> None:
        """Relaunch rules: resume when the run dir holds a checkpoint (the default), never destroy one silently."""
        cfg = self.config
        if self.write_outputs:
            self.store.clean_temp_files()
        resume = cfg.resume or "never"
        if cfg.overwrite:
            if self.write_outputs and (self.store.exists() or (self.run_dir / "metrics.jsonl").exists()):
                log.warning("--overwrite: deleting the checkpoints and logs in %s and starting over", self.run_dir)
                self._clear_outputs()
            dist.barrier()
            return
        if resume not in ("auto", "never"):
            path = Path(resume)
            if not path.is_file():
                raise UsageError(f"checkpoint {path} not found; pass an existing file, or --resume auto")
            self.load(path)
            return
        if not self.store.exists():
            if self.write_outputs and (self.run_dir / "metrics.jsonl").exists():
                log.info(
                    "no checkpoint in %s: starting fresh (replacing the logs of an attempt that saved none)",
                    self.run_dir,
                )
                self._clear_outputs()
            dist.barrier()
            return
        if resume == "never":
            raise UsageError(
                f"{self.run_dir} holds a checkpoint; continue it with --resume auto (the default), start over with "
                "--overwrite, or pass a new --run-dir"
            )
        state, path = self.store.load_latest()
        log.info("%s holds a checkpoint: resuming it (--overwrite starts over)", self.run_dir)
        self._load_state(state, path)

    def _clear_outputs(self) -> None:
        self.store.clear()
        (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        (self.run_dir / WANDB_RUN_ID_FILE).unlink(missing_ok=True)
        shutil.rmtree(self.run_dir / "tb", ignore_errors=True)

    def step_info(self) -> StepInfo:
        """The `StepInfo` of the next optimizer step."""
        step = self.progress.step
        return StepInfo(
            step=step,
            total_steps=self.total_steps,
            steps_per_epoch=self.steps_per_epoch,
            epoch=self.progress.epoch,
            log_now=self._logs_step(step + 1) or step + 1 == self.stop_step,
            num_micro_steps=self.config.grad_accumulation,
        )

    def _logs_step(self, step: int) -> bool:
        """Whether metrics are logged after `step` optimizer steps."""
        return step % self.config.log_every == 0 or step == 1

    # ------------------------------------------------------------------------------------------------ fit
    def fit(self, stop_at_step: int | None = None) -> FitResult:
        """Train to the end (or to `stop_at_step`, saving there as an interruption would: used by --debug/tests)."""
        lock = RunDirLock(self.run_dir) if self.write_outputs else None
        if lock is not None:
            lock.acquire()
        try:
            with self.precision.default_dtype():
                return self._fit(stop_at_step)
        finally:
            if lock is not None:
                lock.release()

    def _fit(self, stop_at_step: int | None) -> FitResult:
        cfg = self.config
        self._stop_at_step = stop_at_step
        self._start()
        logger = MetricsLogger(
            self.run_dir if self.write_outputs else None,
            tensorboard=cfg.tensorboard,
            wandb_mode=cfg.wandb,
            wandb_project=cfg.wandb_project,
            wandb_entity=cfg.wandb_entity,
            run_name=cfg.wandb_name,
            config=to_dict(cfg),
        )
        logger.log(
            "event",
            self.progress.step,
            self.progress.epoch,
            {"event": "start", "total_steps": self.total_steps, "stop_step": self.stop_step},
        )
        self._bar = RunProgress(
            self.stop_step,
            self.progress.step,
            cfg.batch_size,
            enabled=cfg.progress and self.is_main,
            log_every=cfg.log_every,
        )
        if self.write_outputs:
            write_config(self.run_dir, self.recipe.name, to_dict(cfg))
        if cfg.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        losses: list[float] = []
        last_eval: dict[str, float] = {}
        epoch_seconds: list[float] = []
        samples_seen = 0
        status = "finished"
        reset_peak(self.device)
        self._rss_at_start = current_rss_bytes()
        try:
            with graceful_stop() as stop:
                if self.progress.eval_pending:  # stopped at an epoch end before its evaluation: run it now
                    last_eval = self._evaluate_epoch(logger)
                while self.progress.epoch < cfg.epochs and status == "finished":
                    if cfg.max_steps > 0 and self.progress.step >= cfg.max_steps:  # resumed a run that reached it
                        log.info("already at --max-steps %d: nothing left to train", cfg.max_steps)
                        status = "max_steps"
                        break
                    status, epoch_time, samples = self._run_epoch(logger, stop, losses)
                    if epoch_time is not None:
                        epoch_seconds.append(epoch_time)
                        samples_seen += samples
                    if self.progress.step_in_epoch == 0:  # an epoch just completed
                        last_eval = self._end_of_epoch(logger, stop) or last_eval
            if status != "interrupted" and self._reached_end() and self.is_main:
                self.recipe.on_fit_end({**self.parts.models, **self.parts.frozen})
            logger.log(
                "summary",
                self.progress.step,
                self.progress.epoch,
                self._summary(epoch_seconds, samples_seen, last_eval),
            )
        finally:  # on an exception nothing is saved: the last good checkpoint stays as it was
            self._bar.close()
            logger.close()
        return FitResult(status, self.progress.step, self.progress.epoch, losses, last_eval)

    def _reached_end(self) -> bool:
        """All epochs done, or --max-steps reached (a `fit(stop_at_step=...)` stop is not an end)."""
        cfg = self.config
        return self.progress.epoch >= cfg.epochs or (cfg.max_steps > 0 and self.progress.step >= cfg.max_steps)

    def _run_epoch(self, logger: MetricsLogger, stop: Any, losses: list[float]) -> tuple[str, float | None, int]:
        cfg = self.config
        epoch = self.progress.epoch
        start = self.progress.step_in_epoch
        self.sampler.set_epoch(epoch, start_step=start)
        set_epoch = getattr(self.train_dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        for model in self.parts.models.values():
            model.train()  # frozen models stay in eval mode
        iterator = iter(self.loader)
        synchronize(self.device)
        t0 = time.perf_counter()
        steps_done = 0
        status = "finished"
        first_loss_key = "loss" if len(self.phases) == 1 else f"{self.phases[0].name}/loss"
        try:
            while self.progress.step_in_epoch < self.steps_per_epoch:
                info = self.step_info()
                metrics = self.runner.run(iterator, info)
                self._count_skipped(metrics)
                self.progress.step += 1
                self.progress.step_in_epoch += 1
                self._log_health(logger, info)
                steps_done += 1
                losses.append(metrics.get(first_loss_key, math.nan))
                self._bar.update(self.progress.step, metrics)
                if self.progress.step == 3 and cfg.memory_snapshot:
                    self._dump_memory_snapshot()
                if self._logs_step(self.progress.step) or self.progress.step == self.stop_step:
                    averaged = dist.all_reduce_mean(metrics, self.device)
                    logger.log("train", self.progress.step, epoch, averaged)
                stop_now = dist.any_rank(stop.requested, self.device)
                reached_max = (cfg.max_steps > 0 and self.progress.step >= cfg.max_steps) or (
                    self._stop_at_step is not None and self.progress.step >= self._stop_at_step
                )
                if stop_now or reached_max:
                    if self.progress.step_in_epoch < self.steps_per_epoch:
                        self.save()  # mid-epoch; at an epoch end the end-of-epoch save covers it
                    status = "interrupted" if stop_now else "max_steps"
                    if stop_now:
                        log.warning(
                            "stopped by %s at step %d; run the same command again to resume",
                            stop.signal_name,
                            self.progress.step,
                        )
                    break
                if cfg.checkpoint_every and self.progress.step % cfg.checkpoint_every == 0:
                    self.save()
        finally:
            synchronize(self.device)
        elapsed = time.perf_counter() - t0
        full_epoch = start == 0 and self.progress.step_in_epoch == self.steps_per_epoch
        if self.progress.step_in_epoch == self.steps_per_epoch:
            self.progress.epoch += 1
            self.progress.step_in_epoch = 0
        return status, (elapsed if full_epoch else None), steps_done * cfg.batch_size

    def _log_health(self, logger: MetricsLogger, info: StepInfo) -> None:
        """The health metrics of an observed step (every --health-every steps), averaged over ranks, and the
        warnings they call for (engine/health.py)."""
        health = self.health.pop_metrics(info)
        if health:
            health = dist.all_reduce_mean(health, self.device)
            self.health.check(self.progress.step, health)
            logger.log("health", self.progress.step, self.progress.epoch, health)

    def _count_skipped(self, metrics: dict[str, float]) -> None:
        """Overflow skips are legitimate with loss scaling, up to --max-skipped-steps in a row."""
        skipped = any(v for k, v in metrics.items() if k == "skipped" or k.endswith("/skipped"))
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if skipped else 0
        if self._skipped_in_a_row > self.config.max_skipped_steps:
            scale = {k: v for k, v in metrics.items() if k.endswith("loss_scale")}
            raise TrainingStopped(
                f"training diverged: {self._skipped_in_a_row} optimizer steps in a row skipped for non-finite "
                f"gradients (up to step {self.progress.step + 1}; loss scale {scale or 'n/a'}); the last good "
                "checkpoint is kept: lower the learning rate, or raise --max-skipped-steps, and resume"
            )

    def _end_of_epoch(self, logger: MetricsLogger, stop: Any) -> dict[str, float]:
        """Save first (a preemption during a long evaluation loses nothing), then evaluate and save again."""
        cfg = self.config
        epoch = self.progress.epoch  # epochs completed
        evaluate_now = epoch % cfg.eval_every_epochs == 0 or epoch >= cfg.epochs
        self.progress.eval_pending = evaluate_now
        self.save()
        if not evaluate_now:
            return {}
        if dist.any_rank(stop.requested, self.device):
            log.warning("stop requested: the evaluation of epoch %d runs when the run resumes", epoch)
            return {}
        return self._evaluate_epoch(logger)

    def _evaluate_epoch(self, logger: MetricsLogger) -> dict[str, float]:
        epoch = self.progress.epoch
        metrics: dict[str, float] = {}
        if self.is_main:
            for model in self.parts.models.values():
                model.eval()
            with torch.no_grad(), self.precision.autocast(self.device.type):
                metrics = self.recipe.evaluate({**self.parts.models, **self.parts.frozen}, self.device, epoch)
        metrics = dist.broadcast_object(metrics)  # type: ignore[assignment]
        if metrics:
            logger.log("eval", self.progress.step, epoch, metrics)
            self._bar.log_eval(epoch, metrics)
        is_best = False
        key = self.recipe.best_metric
        if key and key in metrics:
            score = metrics[key]
            best = self.progress.best_score
            better = best is None or (score > best if self.recipe.best_mode == "max" else score < best)
            if better:
                self.progress.best_score = score
                is_best = True
        self.progress.eval_pending = False
        self.save(is_best=is_best)
        return metrics

    def _summary(self, epoch_seconds: list[float], samples: int, last_eval: dict[str, float]) -> dict[str, Any]:
        timed = epoch_seconds[1:] if len(epoch_seconds) > 1 else epoch_seconds
        summary: dict[str, Any] = {"precision": self.precision.name, **peak_memory(self.device)}
        if self.device.type == "cpu":  # the RSS high-water mark includes the interpreter and libraries
            summary["cpu_rss_at_start_bytes"] = self._rss_at_start
            summary["cpu_peak_rss_growth_bytes"] = max(summary["peak_memory_bytes"] - self._rss_at_start, 0)
        if timed:
            summary["seconds_per_epoch"] = sum(timed) / len(timed)
            summary["images_per_second"] = (self.steps_per_epoch * self.config.batch_size) / summary[
                "seconds_per_epoch"
            ]
            summary["epochs_timed"] = len(timed)
        summary.update({f"final_{k}": v for k, v in last_eval.items()})
        if self.progress.best_score is not None and self.recipe.best_metric:
            summary[f"best_{self.recipe.best_metric}"] = self.progress.best_score
        return summary

    def _dump_memory_snapshot(self) -> None:
        path = Path(self.config.memory_snapshot)
        if self.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            log.info("CUDA memory snapshot of the first 3 steps written to %s (open at pytorch.org/memory_viz)", path)
        torch.cuda.memory._record_memory_history(enabled=None)


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config dicts as dotted keys ({"schedule": {"kind": ...}} -> {"schedule.kind": ...})."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
