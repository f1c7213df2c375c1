"""`trainlab bench data RECIPE [flags of trainlab train RECIPE] [--num-workers N] [--seconds S] [--json]`: how fast the
recipe's real training loader delivers samples, in total and per CPU core.

The recipe is built as `trainlab train RECIPE` with the same flags would build it (on the CPU: only its data is
used), then its training dataset is iterated through the engine's own loader (`trainlab.engine.sampler`: the step
sampler, the seeded workers) for `--seconds` after one warm-up batch (worker start-up and file cache are not
timed), epoch after epoch. `--num-workers 0` reads in this process with one torch thread: the per-core rate of the
pipeline itself. With N workers the per-core rate is samples/s / N (each worker is one process on its own core when
the machine has N free cores; on fewer cores the division understates it).

Printed: samples/s, samples/s per core, the workers, and each sample tensor's shape (the batch dimension left out);
`--json` gives the same as `samples_per_second`, `samples_per_second_per_core`, `workers`, `sample_shapes` (name ->
shape), `batches`, `seconds`. No model is trained and nothing is logged to the run directory (a recipe's data
preparation writes what it writes for training, e.g. the CIFAR-format files of kind fake).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from trainlab.commands.plan import take_options
from trainlab.config import flags_help, option, parse
from trainlab.errors import UsageError
from trainlab.json_out import dumps_json
from trainlab.recipes import check_recipe, get_recipe, list_recipes

USAGE = "usage: trainlab bench data RECIPE [--num-workers N] [--seconds S] [--json] [flags of `trainlab train RECIPE`]"


@dataclasses.dataclass(kw_only=True)
class DataBenchOptions:
    """The data bench's own flags (the others are the recipe's, as `trainlab train RECIPE` takes them: the loader's
    workers are the recipe's `--num-workers`, 0 by default: read in this process with one torch thread)."""

    seconds: float = option(10.0, "seconds to iterate the loader after one warm-up batch", metavar="S", gt=0, le=86400)
    json: bool = option(False, "print the result as JSON instead of the lines")


def take_bench_options(argv: list[str]) -> tuple[DataBenchOptions, list[str]]:
    """The bench's flags (typed and range-checked) and the rest of `argv` (the recipe's flags)."""
    return take_options(DataBenchOptions, argv)


def measure_loader(loader: Any, dataset: Any, seconds: float) -> dict[str, Any]:
    """Iterate `loader` (epoch after epoch, `set_epoch` on the dataset and sampler) for `seconds` after one warm-up
    batch: samples/s, the batches timed and each sample tensor's shape."""
    epoch = 0

    def epochs() -> Any:
        nonlocal epoch
        while True:
            for target in (dataset, loader.batch_sampler):
                if hasattr(target, "set_epoch"):
                    target.set_epoch(epoch)
            yield from loader
            epoch += 1

    batches = epochs()
    first = next(batches)
    shapes = {name: list(value.shape[1:]) for name, value in first.items()}
    samples = count = 0
    began = time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds:
        batch = next(batches)
        samples += len(next(iter(batch.values())))
        count += 1
    return {"samples_per_second": samples / elapsed, "sample_shapes": shapes, "batches": count, "seconds": elapsed}


def run(name: str, options: DataBenchOptions, config: Any) -> dict[str, Any]:
    import torch

    threads = torch.get_num_threads()
    if config.num_workers == 0:
        torch.set_num_threads(1)  # the per-core rate; restored below (the command may run in-process)
    try:
        return _measure(name, options, config)
    finally:
        torch.set_num_threads(threads)


def _measure(name: str, options: DataBenchOptions, config: Any) -> dict[str, Any]:
    import torch

    from trainlab.engine.sampler import training_loader

    cpu = torch.device("cpu")
    recipe = get_recipe(name)(config)
    dataset = recipe.build_data(recipe.build(cpu), cpu)
    _, loader, _ = training_loader(dataset, config, device_type="cpu", rank=0, world=1)
    result = measure_loader(loader, dataset, options.seconds)
    cores = max(config.num_workers, 1)
    return {
        "recipe": name,
        "samples_per_second": round(result["samples_per_second"], 2),
        "samples_per_second_per_core": round(result["samples_per_second"] / cores, 2),
        "workers": config.num_workers,
        **{k: v for k, v in result.items() if k != "samples_per_second"},
    }


def _run_beside_its_run_dir(name: str, options: DataBenchOptions, config: Any) -> dict[str, Any]:
    """`run`, holding the run directory's lock where it exists: a recipe's data may write there (VAR's token cache),
    so a run training in it, or another recipe's run, is refused as a second `trainlab train` would be."""
    from pathlib import Path

    from trainlab.engine.run_dir import RunDir
    from trainlab.engine.run_lock import RunDirLock

    run_dir = Path(config.run_dir)
    if not run_dir.is_dir():
        return run(name, options, config)
    recorded = RunDir(run_dir).recipe()
    if recorded is not None and recorded != name:
        raise UsageError(
            f"--run-dir {run_dir} holds a {recorded!r} run; `bench data {name}` may write its data caches there: pass "
            "another --run-dir"
        )
    with RunDirLock(run_dir):
        return run(name, options, config)


def main(argv: list[str]) -> int:
    if not argv:
        raise UsageError(f"name a recipe: {', '.join(list_recipes())}; `trainlab bench data --help` for the flags")
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        print(f"\nbench flags:\n{flags_help(DataBenchOptions)}")
        print(f"\nrecipes: {', '.join(list_recipes())}; `trainlab bench data RECIPE --help` adds the recipe's flags")
        return 0
    name = argv[0]
    check_recipe(name)
    options, rest = take_bench_options(argv[1:])  # checked before the recipe (and torch) is imported
    config = parse(
        get_recipe(name).config_class,
        rest,
        prog=f"trainlab bench data {name}",
        description=f"{__doc__.split(chr(10) + chr(10))[1]}\n\nbench flags:\n{flags_help(DataBenchOptions)}",
        usage=USAGE.removeprefix("usage: ").replace("RECIPE", name),
    )
    result = _run_beside_its_run_dir(name, options, config)
    if options.json:
        print(dumps_json(result, indent=2))
        return 0
    shapes = ", ".join(f"{k} {tuple(v)}" for k, v in result["sample_shapes"].items())
    print(
        f"{name}: {result['samples_per_second']:.1f} samples/s, {result['samples_per_second_per_core']:.1f} per core "
        f"({result['workers']} worker(s), {result['batches']} batches in {result['seconds']:.1f} s); samples: {shapes}"
    )
    return 0
