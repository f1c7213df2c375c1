"""The training loop every recipe runs on: set-up, epochs, evaluation and best/last checkpoints, logging.

`Trainer(recipe).fit()` is the whole public API. Set-up: device and precision (both logged), the process group
under torchrun (none in one process), then before anything is built the run-dir lock (rank 0) and the relaunch
rules (`engine.resume`: overwrite / resume / recipe of the run dir, the checkpoint read and checked against the
config), then `recipe.build` (models, frozen models, optimizers), `recipe.build_data`, the seeded resumable
sampler, loss scalers and schedules, and the checkpoint checked against the data and loaded. The lock is held until
`fit` returns. Errors that only some ranks see (rank 0 writes) are raised on every rank alike
(`dist.raise_together`). One optimizer step is `engine.step.StepRunner.run`:
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
from trainlab.engine.batchnorm_momentum import decay_per_optimizer_step_, describe_per_micro_batch
from trainlab.engine.checkpoint import CheckpointStore, NonFiniteWeightsError, load_checkpoint, non_finite_weights
from trainlab.engine.compile import check_compile_toolchain, compile_for_training
from trainlab.engine.data import StepBatchSampler, build_loader
from trainlab.engine.device import resolve_device
from trainlab.engine.health import HealthMonitor
from trainlab.engine.memory import current_rss_bytes, peak_memory, reset_peak, synchronize
from trainlab.engine.metrics import WANDB_RUN_ID_FILE, MetricsLogger, RunProgress
from trainlab.engine.precision import LossScaler, Precision, check_device_support
from trainlab.engine.recipe import Phase, Recipe, StepInfo, TrainConfig, TrainParts, apply_activation_checkpointing
from trainlab.engine.resume import (
    ENGINE_MAY_CHANGE,
    RelaunchPlan,
    check_config,
    check_fits,
    check_structure,
    plan_relaunch,
)
from trainlab.engine.run_lock import RunDirLock
from trainlab.engine.runinfo import prepare_run_dir, write_config
from trainlab.engine.schedule import Scheduler
from trainlab.engine.seeding import rng_state, seed_everything, set_deterministic, set_rng_state
from trainlab.engine.signals import graceful_stop
from trainlab.engine.step import StepRunner
from trainlab.errors import TrainingStopped, UsageError
from trainlab.host_memory import host_allocator

log = logging.getLogger(__name__)

__all__ = ["ENGINE_MAY_CHANGE", "FitResult", "Progress", "Trainer", "resolve_device"]


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
        self.store = CheckpointStore(self.ckpt_dir, keep=cfg.keep_checkpoints)
        self._lock: RunDirLock | None = None
        self._claimed = False
        try:
            # Before anything is built: the run directory is this process's, and the relaunch rules allow this run.
            dist.raise_together(self._claim_run_dir)
            self._plan: RelaunchPlan = dist.raise_together(self._plan_relaunch)
            self._build(compiler)
        except BaseException:
            self._release_run_dir()
            raise

    def _set_batchnorm_decay(self) -> None:
        """BatchNorm momentum under accumulation (engine/batchnorm_momentum.py), logged either way."""
        k, models = self.config.grad_accumulation, self.parts.models.values()
        if self.config.batchnorm_decay == "per-optimizer-step":
            log.info(decay_per_optimizer_step_(models, k))
        elif (line := describe_per_micro_batch(models, k)) is not None:
            log.info(line)

    def _build(self, compiler: str) -> None:
        recipe, cfg = self.recipe, self.config
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
            apply_activation_checkpointing(recipe, self.parts)
            for name, model in self.parts.models.items():
                self.precision.prepare_model(model, keep_batchnorm_fp32=cfg.keep_batchnorm_fp32)
                self.parts.models[name] = model.to(self.device)
            for name, model in self.parts.frozen.items():
                self.parts.frozen[name] = model.to(self.device).eval().requires_grad_(False)
            if cfg.grad_accumulation > 1:
                self._set_batchnorm_decay()
            self.phases: list[Phase] = self.parts.phases
            if not self.phases:
                raise ValueError(f"recipe {recipe.name} built no optimizer phase")
            self.train_dataset = recipe.build_data(self.parts, self.device)
        self.dataset_size = len(self.train_dataset)  # type: ignore[arg-type]
        self.world = dist.world_size()
        self.sampler = StepBatchSampler(
            self.dataset_size,
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
        self._resumed_rng: dict[str, Any] | None = None
        plan = self._plan
        if plan.kind == "resume" and plan.state is not None and plan.path is not None:
            state, path = plan.state, plan.path
            dist.raise_together(lambda: self._load_state(state, path))
            plan.state = None  # the models, optimizers and counters hold it now

    # -------------------------------------------------------------------------------------------- run dir
    def _claim_run_dir(self) -> None:
        """Rank 0: a writable run directory, locked for this process (a second launch stops here, at once)."""
        self._claimed = True
        if not self.write_outputs:
            return
        prepare_run_dir(self.run_dir)
        self._lock = RunDirLock(self.run_dir)
        self._lock.acquire()
        self.store.clean_temp_files()

    def _release_run_dir(self) -> None:
        self._claimed = False
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _plan_relaunch(self) -> RelaunchPlan:
        return plan_relaunch(self.config, self.recipe.name, self.recipe.resume_may_change, self.store, self.run_dir)

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
            "data": {"dataset_size": self.dataset_size, "steps_per_epoch": self.steps_per_epoch},
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
        """Write ckpt/last.pt (and best.pt); refuses weights or buffers with NaN / inf (except buffers declared inf by
        design), decided on every rank alike (BatchNorm statistics differ between ranks)."""
        if is_best:
            self.progress.best_step = self.progress.step
        bad = non_finite_weights(self.parts.models)
        if dist.any_rank(bool(bad), self.device):
            first = bad[0] if bad else "on another rank"
            raise NonFiniteWeightsError(
                f"training diverged: at step {self.progress.step} {len(bad) or 'some'} weight / buffer tensor(s) hold "
                f"NaN or inf (first: {first}); the last finite checkpoint is kept: lower the learning rate and resume"
            )
        state = self.state_dict()

        def write() -> None:
            if self.write_outputs:
                self.store.save(state, is_best=is_best)

        # rank 0's write, waited for by the others in raise_together's gather (the side group's long timeout, not
        # --dist-timeout); a full disk on rank 0 stops every rank with its one line
        dist.raise_together(write)
        if self.write_outputs:
            log.info("saved %s (step %d%s)", self.store.last, self.progress.step, ", best" if is_best else "")

    def load(self, path: Path) -> None:
        """Resume from the checkpoint at `path` (its config must match this run's, see `trainlab.engine.resume`)."""
        state = load_checkpoint(path)
        if state.get("recipe") != self.recipe.name:
            raise UsageError(f"checkpoint {path} is from recipe {state.get('recipe')!r}, not {self.recipe.name!r}")
        check_structure(state, path)
        changed = check_config(state.get("config"), self.config, path, self.recipe.resume_may_change)
        if changed:
            log.info("resuming with changed settings (applied): %s", "; ".join(changed))
        self._load_state(state, path)

    def _load_state(self, state: dict[str, Any], path: Path) -> None:
        """Apply a checkpoint that passed the relaunch checks (recipe, structure, config) to the built run."""
        check_fits(
            state,
            path,
            dataset_size=self.dataset_size,
            steps_per_epoch=self.steps_per_epoch,
            total_steps=self.total_steps,
            batch_size=self.config.batch_size,
            phases=self.phases,
        )
        try:
            for name, model in self.parts.models.items():
                try:
                    model.load_state_dict(state["models"][name])
                except (KeyError, RuntimeError) as err:
                    first = (str(err).splitlines() or [type(err).__name__])[0][:200]
                    raise UsageError(
                        f"checkpoint {path} does not fit model {name!r} ({first}); check --model"
                    ) from None
            for phase in self.phases:
                # This run's peak learning rates: a resume may lower them (after a divergence); the schedule applies
                # them from the checkpoint's step on.
                peaks = [group["peak_lr"] for group in phase.optimizer.param_groups]
                phase.optimizer.load_state_dict(state["optimizers"][phase.name])
                for group, peak in zip(phase.optimizer.param_groups, peaks):
                    group["peak_lr"] = peak
                self.scalers[phase.name].load_state_dict(state["scalers"][phase.name])
                self.schedulers[phase.name].load_state_dict(state["schedulers"][phase.name])
            best = state.get("best_score")
            self.progress = Progress(
                step=state["step"],
                epoch=state["epoch"],
                step_in_epoch=state["step_in_epoch"],
                best_score=None if best is None else float(best),
                best_step=state.get("best_step"),
                eval_pending=bool(state.get("eval_pending", False)),
            )
            rngs = state["rng_per_rank"]
            # Restored when fit() starts: what runs between the Trainer and fit (the demo trains its judge) must not
            # consume the resumed run's random numbers.
            self._resumed_rng = rngs[dist.rank()] if dist.rank() < len(rngs) else rngs[0]
            self.recipe.load_state_dict(state["recipe_state"])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as err:
            raise UsageError(
                f"checkpoint {path} is incomplete or damaged ({type(err).__name__}: {str(err)[:120]}); resume from "
                "another checkpoint (ckpt/step_*.pt) or start over with --overwrite"
            ) from None
        bad = non_finite_weights(self.parts.models)
        if bad:
            raise UsageError(
                f"checkpoint {path} holds NaN or inf in {len(bad)} weight / buffer tensor(s) (first: {bad[0]}); resume "
                "from an earlier checkpoint (ckpt/step_*.pt) or start over with --overwrite"
            )
        if self.write_outputs and path.parent == self.ckpt_dir:
            self.store.repair_best(state, path)
        log.info("resumed from %s at step %d (epoch %d, step %d in epoch)", path, *self._position())

    def _position(self) -> tuple[int, int, int]:
        return self.progress.step, self.progress.epoch, self.progress.step_in_epoch

    def _start(self) -> None:
        """Carry out the relaunch plan's deletions, decided before anything was built (`trainlab.engine.resume`)."""
        plan = self._plan
        if self.write_outputs and plan.kind == "overwrite":
            if self.store.exists() or (self.run_dir / "metrics.jsonl").exists():
                log.warning("--overwrite: deleting the checkpoints and logs in %s and starting over", self.run_dir)
                self._clear_outputs()
        elif self.write_outputs and plan.kind == "fresh" and plan.replace_logs:
            log.info(
                "no checkpoint in %s: starting fresh (replacing the logs of an attempt that saved none)", self.run_dir
            )
            self._clear_outputs()
        self._plan = RelaunchPlan("fresh")  # done: a second fit() of this Trainer continues, it deletes nothing

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
        """Train to the end (or to `stop_at_step`, saving there as an interruption would: used by --debug/tests).

        The run-dir lock taken when the Trainer was built is released when fit returns (a second fit takes it again).
        """
        if not self._claimed:  # the same on every rank (only rank 0 holds the lock)
            dist.raise_together(self._claim_run_dir)
        try:
            with self.precision.default_dtype():
                return self._fit(stop_at_step)
        finally:
            self._release_run_dir()

    def _open_outputs(self) -> MetricsLogger:
        """Rank 0: the plan's deletions, config.yaml (the recipe's record in the run dir), then the metric sinks."""
        cfg = self.config
        self._start()
        if self.write_outputs:
            write_config(self.run_dir, self.recipe.name, to_dict(cfg))
        return MetricsLogger(
            self.run_dir if self.write_outputs else None,
            tensorboard=cfg.tensorboard,
            wandb_mode=cfg.wandb,
            wandb_project=cfg.wandb_project,
            wandb_entity=cfg.wandb_entity,
            run_name=cfg.wandb_name,
            config=to_dict(cfg),
        )

    def _fit(self, stop_at_step: int | None) -> FitResult:
        cfg = self.config
        self._stop_at_step = stop_at_step
        logger = dist.raise_together(self._open_outputs)
        dist.barrier()
        if self._resumed_rng is not None:
            set_rng_state(self._resumed_rng)
            self._resumed_rng = None
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
            if status != "interrupted" and self._reached_end():
                dist.raise_together(self._on_fit_end)  # rank 0 exports; a full disk stops every rank alike
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

    def _on_fit_end(self) -> None:
        if self.is_main:
            self.recipe.on_fit_end({**self.parts.models, **self.parts.frozen})

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
                try:
                    metrics = self.runner.run(iterator, info)
                except RuntimeError as err:
                    if not _overflows_weight_dtype(err):
                        raise
                    dtype = str(self.precision.param_dtype).removeprefix("torch.")
                    raise TrainingStopped(
                        f"training diverged at step {self.progress.step + 1}: a value of the step does not fit the "
                        f"{dtype} weights ({str(err).splitlines()[0][:100]}; e.g. the learning rate times the "
                        "update); nothing was saved after the last good checkpoint: lower the learning rate and resume"
                    ) from None
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

        def evaluate() -> dict[str, float]:
            if not self.is_main:
                return {}
            for model in self.parts.models.values():
                model.eval()
            with torch.no_grad(), self.precision.autocast(self.device.type):
                return self.recipe.evaluate({**self.parts.models, **self.parts.frozen}, self.device, epoch)

        metrics = dist.raise_together(evaluate)  # an evaluation error on rank 0 stops every rank alike
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


def _overflows_weight_dtype(err: RuntimeError) -> bool:
    """c10's checked scalar conversion: a Python number (the optimizer's `-lr * ...` alpha, a loss scale) that does not
    fit the tensor's dtype (fp16's largest is 65504), e.g. `param.add_(grad, alpha=-lr)` with lr 1e6 on fp16 weights.
    It is raised before the tensor is written; the run has diverged as surely as with a NaN loss."""
    return "cannot be converted to type" in str(err) and "without overflow" in str(err)
