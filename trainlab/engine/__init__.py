"""The shared training engine: one home per concept, never naming a recipe.

recipe.py          the contract: TrainConfig, TrainParts (models / frozen / averaged), Phase, StepInfo, Recipe
assemble.py        everything a run needs before its first step (used by the Trainer and the memory planner)
loop.py            the Trainer: epochs, evaluation, best/last checkpoints, logging, stop signals
step.py            one optimizer step: micro-batches, no_sync, unscale / clip / step, hooks, averaged copies
ema.py             averaged weights (EMA of a trained model), kept by the engine for a recipe
run_length.py      how long a run is: the schedule's horizon and the step it stops at
resume.py          relaunch and resume rules; the Trainer's state into and out of a checkpoint
checkpoint.py      the checkpoint format and its readers; atomic files, keep-last-K, best.pt
checkpoint_fields.py  a checkpoint's top-level fields read without torch (`trainlab runs`)
run_dir.py         a run directory's paths and the readers of its files (no torch)
run_lock.py        one process per run directory
precision.py       precision modes, loss scaling, autocast (their names: precision_names.py, no torch)
device.py          `--device` resolved to a torch.device, for every command
health.py          training health every --health-every steps: per-block gradient norm, update ratio, dead units
                   (the limits it warns past: health_limits.py, no torch)
sampler.py         the seeded, resumable data order (2 x 8 is 1 x 16)
schedule.py        learning-rate and weight-decay schedules
debug.py           `--debug`: the stop / save / reload / finish check
metrics.py         metrics.jsonl, TensorBoard, W&B, progress lines
seeding.py, signals.py, compile.py, runinfo.py, peak_memory.py, host_allocator.py
"""
