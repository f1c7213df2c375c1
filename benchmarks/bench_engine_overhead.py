"""Engine overhead: ResNet-18 (CIFAR stem) training steps through trainlab's engine vs a bare PyTorch loop.

Same model init, same in-memory data, same DataLoader order, same optimizer; the two are interleaved repeat by
repeat, alternating which goes first, so machine noise and order effects hit both alike. Each repeat times one
epoch of `--steps` optimizer steps (wall clock with device synchronisation, data loading included, evaluation and
checkpointing excluded for both). Reports the median per-step time of each, their ratio, and the median of the
per-repeat (paired) ratios.

    python benchmarks/bench_engine_overhead.py --steps 10 --repeats 5 --batch-size 32 --threads 2
    python benchmarks/bench_engine_overhead.py --same-model --repeats 40     # per-step overhead alone

Each run writes a JSON result (every repeat, and the environment) to results/ unless `--json ''`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
import torch.nn.functional as F
from _env import environment, result_path, settings, write_result
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainlab.data.tensors import NamedTensorDataset
from trainlab.engine.data import StepBatchSampler
from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts
from trainlab.models.registry import create_model

# Shape legend: N samples, B batch, 3/H/W image channels and side.


def make_data(num: int) -> NamedTensorDataset:
    g = torch.Generator().manual_seed(0)
    return NamedTensorDataset(
        image=torch.randn(num, 3, 32, 32, generator=g), label=torch.randint(10, (num,), generator=g)
    )


class BenchRecipe(Recipe):
    name = "bench-resnet18"
    config_class = TrainConfig

    def __init__(self, config: TrainConfig, data: NamedTensorDataset, model_name: str) -> None:
        super().__init__(config)
        self.data = data
        self.model_name = model_name

    def build(self, device: torch.device) -> TrainParts:
        model = create_model(self.model_name).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        return TrainParts(models={"model": model}, phases=[Phase("main", opt, ["model"])])

    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        return self.data

    def example_batch(self, batch_size: int) -> Batch:
        return {"image": torch.zeros(batch_size, 3, 32, 32), "label": torch.zeros(batch_size, dtype=torch.long)}

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        logits = models["model"](batch["image"])
        return {"loss": F.cross_entropy(logits.float(), batch["label"])}

    def debug_config(self) -> TrainConfig:
        return self.config


def initial_weights(model_name: str) -> dict[str, torch.Tensor]:
    """One set of initial weights that both variants start every repeat from (same arithmetic, same values)."""
    torch.manual_seed(0)
    return {k: v.clone() for k, v in create_model(model_name).state_dict().items()}


def time_engine(data: NamedTensorDataset, args: argparse.Namespace, run_dir: Path) -> float:
    cfg = TrainConfig(
        run_dir=run_dir,
        epochs=1,
        batch_size=args.batch_size,
        log_every=10,
        tensorboard=True,
        progress=False,
        device=args.device,
        precision=args.precision,
    )
    trainer = Trainer(BenchRecipe(cfg, data, args.model))
    trainer.parts.models["model"].load_state_dict(args.initial_weights)  # in place: the optimizer keeps its params
    logger_dir = run_dir
    from trainlab.engine.metrics import MetricsLogger
    from trainlab.engine.signals import graceful_stop

    logger = MetricsLogger(logger_dir, tensorboard=True)
    losses: list[float] = []
    with graceful_stop() as stop:
        t0 = time.perf_counter()
        trainer._run_epoch(logger, stop, losses)  # the training loop of one epoch, as `fit` runs it
        elapsed = time.perf_counter() - t0
    logger.close()
    return elapsed / trainer.steps_per_epoch


def time_bare(data: NamedTensorDataset, args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = create_model(args.model)
    model.load_state_dict(args.initial_weights)
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    sampler = StepBatchSampler(len(data), batch_size=args.batch_size, accumulation=1, rank=0, world=1, seed=0)
    loader = DataLoader(data, batch_sampler=sampler)
    model.train()
    t0 = time.perf_counter()
    for batch in loader:
        x, y = batch["image"].to(device), batch["label"].to(device)
        loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / sampler.steps_per_epoch


def same_model_steps(args: argparse.Namespace, run_dir: Path) -> dict[str, list[float]]:
    """Engine step vs bare step on ONE model, ONE optimizer and ONE fixed batch, alternating step by step.

    Nothing differs but the code around forward/backward/step, so this isolates the per-step overhead from data
    loading, logging and model placement in memory.
    """
    data = make_data(args.batch_size)
    cfg = TrainConfig(run_dir=run_dir, epochs=1, batch_size=args.batch_size, tensorboard=False, progress=False)
    trainer = Trainer(BenchRecipe(cfg, data, args.model))
    model, opt = trainer.parts.models["model"], trainer.phases[0].optimizer
    batch = data[: args.batch_size]  # type: ignore[index]  # a dict of tensor slices
    x, y = batch["image"], batch["label"]
    model.train()

    def bare() -> None:
        loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()

    def engine() -> None:
        trainer.runner.run(iter([batch]), trainer.step_info())  # what `fit` runs for one optimizer step

    for fn in (bare, engine, bare, engine):  # warm-up
        fn()
    times: dict[str, list[float]] = {"engine": [], "bare": []}
    for r in range(args.repeats):
        for name, fn in [("engine", engine), ("bare", bare)][:: 1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    e, b = statistics.median(times["engine"]), statistics.median(times["bare"])
    paired = statistics.median(x / y for x, y in zip(times["engine"], times["bare"]))
    print(f"same model, {args.repeats} alternating single steps: engine {e * 1e3:.1f} ms, bare {b * 1e3:.1f} ms")
    print(f"engine / bare {e / b:.3f}, median paired ratio {paired:.3f}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cifar_resnet18")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--same-model", action="store_true", help="single steps on one model (see same_model_steps)")
    parser.add_argument(
        "--json", default="auto", help="result file ('auto': results/engine_overhead_<...>_<date>.json)"
    )
    parser.add_argument("--label", default="", help="what distinguishes this run (e.g. idlemachine), in the auto name")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = environment()
    what = "same_model_single_steps" if args.same_model else f"epoch_{args.steps}steps"
    path = result_path(args.json, "engine_overhead", args.model, what, f"{args.device}{args.threads}t", args.label)
    config = settings(args)
    if args.same_model:
        with TemporaryDirectory() as tmp:
            times = same_model_steps(args, Path(tmp))
        results: dict[str, Any] = {"engine_s_per_step": times["engine"], "bare_s_per_step": times["bare"]}
        write_result(path, {"environment": env, "config": config, "results": results})
        return
    args.initial_weights = initial_weights(args.model)
    data = make_data(args.steps * args.batch_size)
    engine, bare = [], []
    with TemporaryDirectory() as tmp:
        time_bare(data, args)  # warm-up (allocator, kernels)
        for r in range(args.repeats):
            # alternate which variant goes first (engine-bare, bare-engine, ...) so order effects cancel
            if r % 2 == 0:
                engine.append(time_engine(data, args, Path(tmp) / f"r{r}"))
                bare.append(time_bare(data, args))
            else:
                bare.append(time_bare(data, args))
                engine.append(time_engine(data, args, Path(tmp) / f"r{r}"))
            first = "engine" if r % 2 == 0 else "bare"
            print(
                f"repeat {r} ({first} first): engine {engine[-1] * 1e3:.1f} ms/step, "
                f"bare {bare[-1] * 1e3:.1f} ms/step, ratio {engine[-1] / bare[-1]:.3f}",
                flush=True,
            )
    e, b = statistics.median(engine), statistics.median(bare)
    paired = statistics.median(x / y for x, y in zip(engine, bare))
    print(
        "\n| model | batch | device | threads | engine ms/step | bare ms/step | engine / bare | median paired ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.model} | {args.batch_size} | {args.device} | {args.threads} | {e * 1e3:.1f} | {b * 1e3:.1f} | "
        f"{e / b:.3f} | {paired:.3f} |"
    )
    print(f"(medians of {args.repeats} interleaved repeats of {args.steps} steps each, order alternating)")
    engine_first = [r % 2 == 0 for r in range(args.repeats)]
    results = {"engine_s_per_step": engine, "bare_s_per_step": bare, "engine_first": engine_first}
    write_result(path, {"environment": env, "config": config, "results": results})


if __name__ == "__main__":
    main()
