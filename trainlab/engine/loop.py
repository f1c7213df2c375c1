"""The training loop every recipe runs on: epochs, evaluation, best/last checkpoints, logging, stop signals.

`Trainer(recipe).fit()` is the whole public API. When the Trainer is built: device and precision (both logged), the
process group under torchrun (none in one process), then, before anything is built, the run-dir lock (rank 0) and
the relaunch rules (`engine.resume`: overwrite / resume / recipe of the run dir, the checkpoint read and checked
against the config), then everything a run needs (`engine.assemble`: models, averaged copies, data, schedules, the
step runner) and the checkpoint loaded into it (`engine.resume.restore`). The lock is held until `fit` returns.
Errors that only some ranks see (rank 0 writes) are raised on every rank alike (`dist.raise_together`).

The loop: one optimizer step is `engine.step.StepRunner.run`; the run's length is `engine.run_length`'s. At each
epoch end: `ckpt/last.pt`, evaluation (rank 0, every model in eval mode; under `--fsdp` on whole copies of the sharded
models: `engine.fsdp.Sharding.whole`), `ckpt/last.pt` again and, when the
recipe's best metric improved, `ckpt/best.pt`. SIGTERM / Ctrl-C finish the current step, save and return
"interrupted"; `--max-steps` stops early with "max_steps". How a save reaches the disk (one whole file, or under
`--fsdp` a folder of every rank's shards; in the step, or with `--async-checkpoint` in the background, waited for by
the next save and by the end of `fit`) is `engine.checkpoint_writer`'s. A caller that times the loop's steps
(`trainlab plan --measure`: `memory.measure`) passes `on_mark`, told where each epoch's steps start and where each
step ends (`StepMark`); the loop runs the same with or without it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from trainlab import dist
from trainlab.config import to_dict
from trainlab.engine.assemble import Assembly, assemble
from trainlab.engine.checkpoint import CheckpointStore, NonFiniteWeightsError, Progress, non_finite_weights
from trainlab.engine.checkpoint_writer import CheckpointWriter
from trainlab.engine.compile import check_compile_toolchain
from trainlab.engine.data_wait import DataWaitClock
from trainlab.engine.device import resolve_device
from trainlab.engine.health import HealthMonitor
from trainlab.engine.host_allocator import host_allocator
from trainlab.engine.metrics import MetricsLogger, RunProgress
from trainlab.engine.peak_memory import current_rss_bytes, peak_memory, reset_peak, synchronize
from trainlab.engine.precision import LossScaler, Precision, check_device_support
from trainlab.engine.recipe import Phase, Recipe, StepInfo, TrainConfig, TrainParts
from trainlab.engine.resume import ENGINE_MAY_CHANGE, RelaunchPlan, carry_out, plan_relaunch, restore, training_state
from trainlab.engine.run_dir import RunDir
from trainlab.engine.run_length import RunLength, run_length
from trainlab.engine.run_lock import RunDirLock
from trainlab.engine.runinfo import write_config
from trainlab.engine.sampler import training_loader
from trainlab.engine.schedule import Scheduler
from trainlab.engine.seeding import set_deterministic, set_rng_state
from trainlab.engine.signals import StopFlag, deferring_interrupts, graceful_stop
from trainlab.engine.step import StepRunner
from trainlab.engine.throughput import Throughput, compute_name, device_peak
from trainlab.errors import TrainingStopped, UsageError

log = logging.getLogger(__name__)

__all__ = ["ENGINE_MAY_CHANGE", "FitResult", "FitStatus", "Progress", "StepMark", "Trainer", "resolve_device"]

FitStatus = Literal["finished", "interrupted", "max_steps"]
"""How a `fit` call ended: the run's end (all epochs), a stop signal (or `fit(stop_at_step=...)`'s stop), or
`--max-steps`."""


@dataclass
class FitResult:
    """What `Trainer.fit` returns: how it ended, where, this call's per-step losses, and the run's latest evaluation.

    Attributes:
        status: how the call ended (`FitStatus`).
        step, epoch: where the run stands.
        losses: per optimizer step of this call (the first phase's loss), this process.
        last_eval: the metrics of the run's latest evaluation (of this call, else the one its checkpoint recorded: a
            finished run launched again reports its result); {} when the run has not evaluated yet.
        last_eval_epoch: the epochs completed when `last_eval` was evaluated (None: no evaluation yet).
    """

    status: FitStatus
    step: int
    epoch: int
    losses: list[float]
    last_eval: dict[str, float]
    last_eval_epoch: int | None = None


@dataclass(frozen=True)
class EpochResult:
    """How one `_run_epoch` call ended."""

    status: FitStatus  # "finished": the epoch's steps ran out (the run goes on to the next epoch)
    seconds: float | None  # the epoch's time when this call trained all of it, else None (not timed)
    samples: int  # samples trained in this call


@dataclass(frozen=True)
class StepMark:
    """A point of an epoch's steps, told to `Trainer(on_mark=...)` (a caller reads its clock there).

    Attributes:
        step: optimizer steps done.
        epoch_start: True where the epoch's steps start (its loader iterator made, the device synchronized); False
            after a step and its bookkeeping (the NaN / skip checks, health, the loss kept, the progress display).
        data_wait_seconds: seconds spent inside this epoch's loader `next()` so far.
    """

    step: int
    epoch_start: bool
    data_wait_seconds: float


class Trainer:
    """Runs a recipe. Single process needs no process group; under torchrun every rank builds a Trainer.

    Args:
        recipe: the recipe with its config.
        write_outputs: rank 0 writes the run directory (config, metrics, checkpoints); False writes nothing.
        on_mark: called at each `StepMark` of the loop (None: nothing is called).
    """

    def __init__(
        self,
        recipe: Recipe[Any],
        *,
        write_outputs: bool = True,
        on_mark: Callable[[StepMark], None] | None = None,
    ) -> None:
        self.recipe = recipe
        self._on_mark = on_mark
        self.config: TrainConfig = recipe.config
        cfg = self.config
        self.device = resolve_device(cfg.device)
        self.precision = Precision.parse(cfg.precision)
        check_device_support(self.precision, self.device)
        self._compiler = check_compile_toolchain(self.device) if cfg.compile else ""
        if cfg.memory_snapshot and self.device.type != "cuda":
            raise UsageError("--memory-snapshot records the CUDA caching allocator and needs a CUDA device")
        dist.init(self.device.type, cfg.dist_timeout)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", dist.local_rank())
        self.is_main = dist.is_main()
        self.world = dist.world_size()
        self.run_dir = Path(cfg.run_dir)
        self.files = RunDir(self.run_dir)
        self.ckpt_dir = self.files.ckpt
        self.write_outputs = write_outputs and self.is_main
        self._saves = write_outputs  # the same on every rank (a sharded checkpoint is written by all of them)
        self.store = CheckpointStore(self.ckpt_dir, keep=cfg.keep_checkpoints)
        self.writer = CheckpointWriter(self.store, sharded=cfg.fsdp, background=cfg.async_checkpoint)
        self.progress = Progress()
        self._lock: RunDirLock | None = None
        self._claimed = False
        self._stop_at_step: int | None = None
        self._rss_at_start = 0
        self._skipped_in_a_row = 0
        self._data_wait_seconds: list[float] = []  # per full epoch, as the epoch times
        self._resumed_rng: dict[str, Any] | None = None
        self._bar = RunProgress(0, 0, cfg.batch_size, enabled=False, log_every=cfg.log_every)  # fit() opens its own
        self._throughput = Throughput(
            global_batch=cfg.batch_size,
            peak=device_peak(self.device, compute_name(self.precision)),
            count=not cfg.compile,
        )
        try:
            # Before anything is built: the run directory is this process's, and the relaunch rules allow this run.
            dist.raise_together(self._claim_run_dir)
            self._plan: RelaunchPlan = dist.raise_together(self._plan_relaunch)
            self.run: Assembly = self._assemble()
            if self._plan.kind == "resume":
                dist.raise_together(self._restore)
        except BaseException:
            self._release_run_dir()
            raise

    # ----------------------------------------------------------------------------------------------- set-up
    def _assemble(self) -> Assembly:
        cfg = self.config
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
        run = assemble(
            self.recipe,
            device=self.device,
            precision=self.precision,
            length_of=self._build_data,
            world=self.world,
            compile_models=cfg.compile,
            health_every=cfg.health_every,
            warn=self.is_main,
        )
        if run.compiled:
            log.info(
                "compile: %s of %s for training steps (deterministic kernels; evaluation stays eager)",
                self._compiler,
                ", ".join(run.compiled),
            )
        return run

    def _build_data(self, parts: TrainParts) -> RunLength:
        """The training data, its seeded resumable sampler and loader; the run's length follows from them."""
        cfg = self.config
        self.train_dataset = self.recipe.build_data(parts, self.device)
        self.dataset_size = len(self.train_dataset)  # type: ignore[arg-type]
        self.sampler, self.loader, options = training_loader(
            self.train_dataset, cfg, device_type=self.device.type, rank=dist.rank(), world=self.world
        )
        log.info("training loader: %s", options.describe())
        return run_length(self.sampler.steps_per_epoch, epochs=cfg.epochs, max_steps=cfg.max_steps)

    def _restore(self) -> None:
        plan = self._plan
        assert plan.state is not None and plan.path is not None
        restored = restore(plan.state, plan.path, self.recipe, self.run, dataset_size=self.dataset_size)
        self.progress = restored.progress
        # Set when fit() starts: what runs between the Trainer and fit (the demo trains its judge) must not consume
        # the resumed run's random numbers.
        self._resumed_rng = restored.rng
        if self.write_outputs and plan.path.parent == self.ckpt_dir:
            self.store.repair_best(plan.state, plan.path)
        plan.state = None  # the models, optimizers and counters hold it now
        log.info(
            "resumed from %s at step %d (epoch %d, step %d in epoch)",
            plan.path,
            self.progress.step,
            self.progress.epoch,
            self.progress.step_in_epoch,
        )

    # The assembled run, by the names recipes, tests and tools read.
    @property
    def parts(self) -> TrainParts:
        return self.run.parts

    @property
    def averaged(self) -> dict[str, nn.Module]:
        return self.run.averaged

    @property
    def phases(self) -> list[Phase]:
        return self.run.parts.phases

    @property
    def runner(self) -> StepRunner:
        return self.run.runner

    @property
    def wrapped(self) -> dict[str, nn.Module]:
        return self.run.wrapped

    @property
    def health(self) -> HealthMonitor | None:
        return self.run.health

    @property
    def scalers(self) -> dict[str, LossScaler]:
        return self.run.scalers

    @property
    def schedulers(self) -> dict[str, Scheduler]:
        return self.run.schedulers

    @property
    def length(self) -> RunLength:
        return self.run.length

    @property
    def steps_per_epoch(self) -> int:
        return self.run.length.steps_per_epoch

    # -------------------------------------------------------------------------------------------- run dir
    def _claim_run_dir(self) -> None:
        """Rank 0: a writable run directory, locked for this process (a second launch stops here, at once)."""
        self._claimed = True
        if not self.write_outputs:
            return
        self.files.prepare()
        self._lock = RunDirLock(self.run_dir)
        self._lock.acquire()
        self.store.clean_temp_files()

    def close(self) -> None:
        """Release the run directory of a Trainer that will not `fit` (one built to inspect its parts): `fit`
        releases it itself when it returns."""
        self._release_run_dir()

    def _release_run_dir(self) -> None:
        self._claimed = False
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _plan_relaunch(self) -> RelaunchPlan:
        return plan_relaunch(self.config, self.recipe.name, self.recipe.resume_may_change, self.store, self.run_dir)

    # ---------------------------------------------------------------------------------------- checkpoints
    def save(self, *, is_best: bool = False) -> None:
        """Write ckpt/last.pt (and best.pt); refuses weights or buffers with NaN / inf (except buffers declared inf by
        design), decided on every rank alike (BatchNorm statistics differ between ranks)."""
        if is_best:
            self.progress.best_step = self.progress.step
        bad = non_finite_weights({**self.parts.models, **self.averaged})
        if dist.any_rank(bool(bad), self.device):
            first = bad[0] if bad else "on another rank"
            raise NonFiniteWeightsError(
                f"training diverged: at step {self.progress.step} {len(bad) or 'some'} weight / buffer tensor(s) hold "
                f"NaN or inf (first: {first}); the last finite checkpoint is kept: lower the learning rate and resume"
            )
        gone = self._lock is not None and not self._lock.in_place()
        if dist.any_rank(gone, self.device):  # a save there now would make a new, partial run directory
            raise UsageError(
                f"the run directory {self.run_dir} was removed or moved while the run trained (its .lock is not there "
                f"any more): step {self.progress.step} is not saved; the checkpoints saved before went with the folder"
            )
        if not self._saves:
            return
        state = training_state(self.recipe, self.run, self.progress, self.dataset_size, whole=not self.writer.sharded)
        # waited for by every rank (the side group's long timeout, not --dist-timeout); a full disk stops every rank
        # with its one line
        with deferring_interrupts():  # a second Ctrl-C now would cut the file being written
            self.writer.write(state, is_best=is_best)

    def step_info(self) -> StepInfo:
        """The `StepInfo` of the next optimizer step."""
        step = self.progress.step
        return StepInfo(
            step=step,
            total_steps=self.length.total_steps,
            steps_per_epoch=self.length.steps_per_epoch,
            epoch=self.progress.epoch,
            log_now=self._logs_step(step + 1) or step + 1 == self.length.stop_step,
            num_micro_steps=self.config.grad_accumulation,
        )

    def _logs_step(self, step: int) -> bool:
        """Whether metrics are logged after `step` optimizer steps."""
        return step % self.config.log_every == 0 or step == 1

    def _hit_max_steps(self) -> bool:
        """Whether --max-steps (not the end of the epochs) stops the run at the current step."""
        return self.config.max_steps > 0 and self.progress.step >= self.config.max_steps

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
        if self.write_outputs:
            carry_out(self._plan, self.store, self.files)
            write_config(self.run_dir, self.recipe.name, to_dict(cfg))
        self._plan = RelaunchPlan("fresh")  # done: a second fit() of this Trainer continues, it deletes nothing
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
        cfg, length = self.config, self.length
        self._stop_at_step = stop_at_step
        logger = dist.raise_together(self._open_outputs)
        dist.barrier()
        if self._resumed_rng is not None:
            set_rng_state(self._resumed_rng)
            self._resumed_rng = None
        start = {"steps_per_epoch": length.steps_per_epoch, "total_steps": length.total_steps}
        logger.log(
            "event", self.progress.step, self.progress.epoch, {"event": "start", **start, "stop_step": length.stop_step}
        )
        self._bar = RunProgress(
            length.stop_step,
            self.progress.step,
            cfg.batch_size,
            enabled=cfg.progress and self.is_main,
            log_every=cfg.log_every,
            rates=self._throughput.rates,
        )
        if self.is_main:
            log.info("%s", self._throughput.describe())
        if cfg.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        losses: list[float] = []
        evaluated: dict[str, float] = {}  # this call's latest evaluation
        epoch_seconds: list[float] = []
        samples_seen = 0
        status: FitStatus = "finished"
        reset_peak(self.device)
        self._rss_at_start = current_rss_bytes()
        try:
            with graceful_stop() as stop:
                if self.progress.eval_pending:  # stopped at an epoch end before its evaluation: run it now
                    evaluated = self._evaluate_epoch(logger)
                while self.progress.epoch < cfg.epochs and status == "finished":
                    if self._hit_max_steps():  # resumed a run that reached it
                        log.info("already at --max-steps %d: nothing left to train", cfg.max_steps)
                        status = "max_steps"
                        break
                    epoch = self._run_epoch(logger, stop, losses)
                    status = epoch.status
                    if epoch.seconds is not None:
                        epoch_seconds.append(epoch.seconds)
                        samples_seen += epoch.samples
                    if self.progress.step_in_epoch == 0:  # an epoch just completed
                        evaluated = self._end_of_epoch(logger, stop) or evaluated
            self.writer.wait()  # a checkpoint still being written in the background lands before fit returns
            if status != "interrupted" and length.reached_end(self.progress.step):
                dist.raise_together(self._on_fit_end)  # rank 0 exports; a full disk stops every rank alike
            logger.log(
                "summary",
                self.progress.step,
                self.progress.epoch,
                self._summary(epoch_seconds, samples_seen, evaluated),
            )
        finally:  # on an exception nothing is saved: the last good checkpoint stays as it was
            self.writer.close()  # (a background save already under way lands first)
            self._bar.close()
            logger.close()
        return FitResult(
            status,
            self.progress.step,
            self.progress.epoch,
            losses,
            dict(self.progress.last_eval),
            self.progress.last_eval_epoch,
        )

    def _rank0_models(self) -> dict[str, nn.Module]:
        """Every model by name for what rank 0 does alone; under --fsdp the sharded ones as whole copies on rank 0
        (collective: every rank calls it)."""
        models = self.run.all_models()
        if self.run.sharding is None:
            return models
        return self.run.sharding.whole(models, self.device, keep=self.is_main)

    def _on_fit_end(self) -> None:
        models = self._rank0_models()  # before the raise_together that wraps this: collective under --fsdp
        if self.is_main:
            self.recipe.on_fit_end(models)

    def _run_epoch(self, logger: MetricsLogger, stop: StopFlag, losses: list[float]) -> EpochResult:
        """Train from the current step to the epoch's end, a stop signal, --max-steps or `fit`'s `stop_at_step`."""
        cfg = self.config
        epoch = self.progress.epoch
        start = self.progress.step_in_epoch
        self.sampler.set_epoch(epoch, start_step=start)
        set_epoch = getattr(self.train_dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        for model in self.parts.models.values():
            model.train()  # frozen and averaged models stay in eval mode
        iterator = DataWaitClock(iter(self.loader))
        self._throughput.start_window(self.progress.step)
        synchronize(self.device)
        t0 = time.perf_counter()
        if self._on_mark is not None:
            self._on_mark(StepMark(self.progress.step, True, iterator.waited))
        steps_done = 0
        status: FitStatus = "finished"
        first_loss_key = "loss" if len(self.phases) == 1 else f"{self.phases[0].name}/loss"
        try:
            while self.progress.step_in_epoch < self.steps_per_epoch:
                info = self.step_info()
                try:
                    metrics = self._throughput.run_step(partial(self.runner.run, iterator, info), epoch, info.step)
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
                if self._on_mark is not None:
                    self._on_mark(StepMark(self.progress.step, False, iterator.waited))
                if self.progress.step == 3 and cfg.memory_snapshot:
                    self._dump_memory_snapshot()
                if self._logs_step(self.progress.step) or self.progress.step == self.length.stop_step:
                    averaged = dist.all_reduce_mean(metrics, self.device)
                    seconds, averaged["data_wait_fraction"] = iterator.window()
                    averaged.update(self._throughput.window(self.progress.step, seconds))
                    logger.log("train", self.progress.step, epoch, averaged)
                stop_now = dist.any_rank(stop.requested, self.device)
                reached_max = self._hit_max_steps() or (
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
                at_epoch_end = self.progress.step_in_epoch == self.steps_per_epoch  # the end-of-epoch save follows
                if cfg.checkpoint_every and self.progress.step % cfg.checkpoint_every == 0 and not at_epoch_end:
                    self.save()  # (a save here would record the epoch's last step before the epoch is counted)
        finally:
            synchronize(self.device)
        elapsed = time.perf_counter() - t0
        full_epoch = start == 0 and self.progress.step_in_epoch == self.steps_per_epoch
        if full_epoch:
            self._data_wait_seconds.append(iterator.waited)
        if self.progress.step_in_epoch == self.steps_per_epoch:
            self.progress.epoch += 1
            self.progress.step_in_epoch = 0
        return EpochResult(status, elapsed if full_epoch else None, steps_done * cfg.batch_size)

    def _log_health(self, logger: MetricsLogger, info: StepInfo) -> None:
        """The health metrics of an observed step (every --health-every steps), averaged over ranks, and the
        warnings they call for (engine/health.py)."""
        if self.health is None:
            return
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

    def _end_of_epoch(self, logger: MetricsLogger, stop: StopFlag) -> dict[str, float]:
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

        models = self._rank0_models()

        def evaluate() -> dict[str, float]:
            if not self.is_main:
                return {}
            for name in self.parts.models:
                models[name].eval()
            with torch.no_grad(), self.precision.autocast(self.device.type):
                return self.recipe.evaluate(models, self.device, epoch)

        metrics = dist.raise_together(evaluate)  # an evaluation error on rank 0 stops every rank alike
        models.clear()  # rank 0's whole copies under --fsdp: freed before the save
        metrics = dist.broadcast_object(metrics)  # type: ignore[assignment]
        if metrics:
            logger.log("eval", self.progress.step, epoch, metrics)
            self._bar.log_eval(epoch, metrics)
        is_best = False
        key = self.recipe.best_metric
        if key and key in metrics and math.isfinite(metrics[key]):  # a NaN would never be bettered
            score = metrics[key]
            best = self.progress.best_score
            better = best is None or (score > best if self.recipe.best_mode == "max" else score < best)
            if better:
                self.progress.best_score = score
                is_best = True
        self.progress.eval_pending = False
        if metrics:
            self.progress.last_eval = {k: float(v) for k, v in metrics.items() if _is_number(v)}
            self.progress.last_eval_epoch = epoch
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
            rates = self._throughput.rates(self.steps_per_epoch / summary["seconds_per_epoch"])
            summary.update({k: v for k, v in rates.items() if k != "images_per_second"})
            if self._throughput.flops_per_step is not None:
                summary["flops_per_step"] = self._throughput.flops_per_step
            waited = self._data_wait_seconds[-len(timed) :]
            if len(waited) == len(timed):
                summary["data_wait_fraction"] = sum(waited) / sum(timed)
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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _overflows_weight_dtype(err: RuntimeError) -> bool:
    """c10's checked scalar conversion: a Python number (the optimizer's `-lr * ...` alpha, a loss scale) that does not
    fit the tensor's dtype (fp16's largest is 65504), e.g. `param.add_(grad, alpha=-lr)` with lr 1e6 on fp16 weights.
    It is raised before the tensor is written; the run has diverged as surely as with a NaN loss."""
    return "cannot be converted to type" in str(err) and "without overflow" in str(err)
