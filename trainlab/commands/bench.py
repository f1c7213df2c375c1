"""`trainlab bench precision`: the CIFAR-10 precision lab (`trainlab bench data`: `trainlab.commands.bench_data`).

Trains the same model under every precision mode the device can run (x seeds), each in a fresh process so peak
memory is that run's own (CUDA max allocated/reserved on GPU, peak RSS on CPU), then writes a results table
(markdown + CSV: RUN_DIR/results.md, results.csv) and comparison plots (RUN_DIR/plots/) through `trainlab report`'s
own code, and `bench.json` (its runs, by mode): `trainlab report RUN_DIR` later updates those same files. Each run
is a run directory under RUN_DIR/runs/; launched again, the bench skips the finished ones and resumes the others.
Extra `trainlab train cifar` flags can follow `--`. The run directory is checked and locked before the first run
(a second bench on it stops at once); a warning that every mode would print (fp16 on a CPU) is printed once, with
the modes it concerns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from trainlab.config import option, parse
from trainlab.data.cifar_config import CifarData, upgrade_fake_data
from trainlab.engine.device import DEVICE_HELP
from trainlab.engine.precision_names import LAB_PRECISIONS, PrecisionName
from trainlab.engine.run_dir import RunDir
from trainlab.engine.run_lock import RunDirLock
from trainlab.errors import Terminated, UsageError, check_output_path
from trainlab.models.names import FORMER_CIFAR_NAMES, CifarModel

log = logging.getLogger(__name__)

SHOWN_ENV = "TRAINLAB_BENCH_SHOWN"  # JSON list of the warnings the bench printed once for all of its runs


@dataclasses.dataclass(kw_only=True)
class PrecisionBenchConfig:
    """Run the CIFAR-10 recipe under every precision mode, then tabulate and plot."""

    model: CifarModel = option(
        "cifar_resnet18", "the CIFAR recipe's --model (registry name)", deprecated_values=FORMER_CIFAR_NAMES
    )
    epochs: int = option(30, "epochs per run", ge=1)
    num_seeds: int = option(
        1, "seeds per precision mode, 0 .. N-1 (mean ± std across them)", metavar="N", ge=1, deprecated=("--seeds",)
    )
    modes: list[PrecisionName] = option(list(LAB_PRECISIONS), "precision modes to run")
    run_dir: Path = option(
        Path("runs/bench-precision"),
        "the bench's folder: its runs (runs/), results table, plots and bench.json; launched again, it resumes",
        metavar="DIR",
        deprecated=("--out-dir",),
    )
    device: str = option("auto", DEVICE_HELP)
    batch_size: int = option(128, "global batch size", gt=0)
    learning_rate: float = option(0.1, "peak learning rate", gt=0)
    data: CifarData = option(CifarData(), "which images (as `trainlab train cifar`; fake: quick checks)")
    max_steps: int = option(-1, "stop each run after this many optimizer steps (-1: all epochs)", ge=1, sentinels=(-1,))
    log_every: int = option(10, "training-metric logging interval (steps)", ge=1)
    num_workers: int = option(2, "DataLoader workers per run", ge=0)
    fake_data: int = option(
        0, "former spelling (until the next release): N > 0 is --data.kind fake --data.fake-size N", ge=0
    )

    def validate(self) -> None:
        self.data, self.fake_data = upgrade_fake_data(self.data, self.fake_data), 0
        repeated = sorted({mode for mode in self.modes if self.modes.count(mode) > 1})
        if repeated:  # one run per mode and seed: a repeat would be counted as another seed
            raise UsageError(f"--modes lists {', '.join(repeated)} more than once; name each mode once")


class _Collect(logging.Handler):
    """Keeps WARNING records instead of printing them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _collect_warnings() -> Iterator[_Collect]:
    """Warnings of trainlab's loggers inside the block are kept in the handler, not printed."""
    logger = logging.getLogger("trainlab")
    handler, propagate = _Collect(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def runnable_modes(modes: Sequence[str], device_name: str) -> tuple[list[str], list[str]]:
    """The modes this device can run (the others are skipped with a logged reason, never silently), and the warnings
    their checks gave, each logged once with the modes it concerns (rather than once per mode and again per run)."""
    from trainlab.engine.device import resolve_device
    from trainlab.engine.precision import Precision, check_device_support

    device = resolve_device(device_name)
    keep = []
    shown: dict[str, list[str]] = {}
    for mode in modes:
        with _collect_warnings() as collected:
            try:
                check_device_support(Precision.parse(mode), device)
            except UsageError as err:
                log.warning("skipping %s: %s", mode, err)
                continue
        for record in collected.records:
            shown.setdefault(record.getMessage(), []).append(mode)
        keep.append(mode)
    for message, which in shown.items():
        log.warning("%s (modes %s; said once for all their runs)", message, ", ".join(which))
    return keep, list(shown)


class _Drop(logging.Filter):
    """Drops records whose message is one of `messages`."""

    def __init__(self, messages: Sequence[str]) -> None:
        super().__init__()
        self.messages = set(messages)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.messages


def child_main(argv: list[str]) -> int:
    """One run of the bench: `trainlab` itself (`python -m trainlab.commands.bench train cifar ...`), except that the
    warnings the bench already printed once ($TRAINLAB_BENCH_SHOWN) are not printed again. The run directory records
    the command as `python -m trainlab train cifar ...`, which reproduces it."""
    import trainlab
    from trainlab.cli import main, setup_logging

    setup_logging()
    drop = _Drop(json.loads(os.environ.get(SHOWN_ENV, "[]")))
    for handler in logging.getLogger().handlers:
        handler.addFilter(drop)
    sys.argv = [str(Path(trainlab.__file__).with_name("__main__.py")), *argv]
    return main(argv)


def _train_command(cfg: PrecisionBenchConfig, mode: str, seed: int, run_dir: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "trainlab.commands.bench", "train", "cifar",
        "--model", cfg.model, "--precision", mode, "--seed", str(seed), "--epochs", str(cfg.epochs),
        "--batch-size", str(cfg.batch_size), "--optim.learning-rate", str(cfg.learning_rate), "--device", cfg.device,
        "--data.kind", cfg.data.kind, "--data.root", str(cfg.data.root), "--data.fake-size", str(cfg.data.fake_size),
        "--data.train-limit", str(cfg.data.train_limit), "--data.eval-limit", str(cfg.data.eval_limit),
        "--data.download", str(cfg.data.download).lower(), "--max-steps", str(cfg.max_steps),
        "--log-every", str(cfg.log_every), "--num-workers", str(cfg.num_workers), "--run-dir", str(run_dir),
        "--resume", "auto", *extra,
    ]  # fmt: skip


# What each run's command sets from the bench's own settings: extra flags may not change them.
_SET_BY_BENCH = (
    "model", "precision", "seed", "epochs", "batch_size", "optim.learning_rate", "device", "data", "max_steps",
    "log_every", "num_workers", "run_dir", "resume",
)  # fmt: skip


def check_extra_flags(cfg: PrecisionBenchConfig, extra: list[str]) -> None:
    """Refuse extra `trainlab train cifar` flags that change what the bench sets (a `-- --precision fp16` would train
    the run labelled fp32 in fp16), whatever their spelling: both commands are resolved and compared.

    Raises:
        UsageError: an extra flag changes one of `_SET_BY_BENCH`, or is not a flag of the CIFAR recipe.
    """
    if not extra:
        return
    from trainlab.recipes import get_recipe

    recipe = get_recipe("cifar")
    args = _train_command(cfg, cfg.modes[0], 0, cfg.run_dir / "runs" / "check", [])[5:]
    prog = "trainlab train cifar"  # the extra flags are its flags
    alone = parse(recipe.config_class, args, prog=prog)
    extended = parse(recipe.config_class, [*args, *extra], prog=prog)
    for name in _SET_BY_BENCH:
        head, _, tail = name.partition(".")
        mine, theirs = getattr(alone, head), getattr(extended, head)
        if tail:
            mine, theirs = getattr(mine, tail), getattr(theirs, tail)
        if mine != theirs:
            raise UsageError(
                f"the extra flags after `--` change {name} ({mine} -> {theirs}), which the bench sets for each run: "
                "pass it as a bench option (`trainlab bench precision --help`), not after `--`"
            )


def _run_child(command: list[str], env: dict[str, str]) -> int:
    """Run one mode's training to its end; stopped by SIGTERM or Ctrl-C, the run stops as it would alone (it
    finishes its step and saves: Ctrl-C reaches it from the terminal, SIGTERM is passed on) before the bench stops.
    A later `trainlab bench precision` resumes it."""
    with subprocess.Popen(command, env=env) as child:
        try:
            return child.wait()
        except KeyboardInterrupt as stop:
            if isinstance(stop, Terminated):
                child.terminate()
            child.wait()
            raise


def run_precision_bench(cfg: PrecisionBenchConfig, extra: list[str]) -> Path:
    """Run every mode x seed not finished yet, then write the report; the bench's run directory is locked throughout
    (taken before anything runs: a second bench on the same folder stops at once)."""
    check_output_path("--run-dir", cfg.run_dir, is_dir=True)  # before minutes of training, not after
    with RunDirLock(cfg.run_dir):
        return _run_locked(cfg, extra)


def _run_locked(cfg: PrecisionBenchConfig, extra: list[str]) -> Path:
    import torch

    from trainlab.commands.report import BENCH_MANIFEST, ReportPlan, write_report

    modes, shown = runnable_modes(cfg.modes, cfg.device)
    if not modes:
        raise UsageError("none of the requested precision modes can run on this device")
    groups: dict[str, list[Path]] = {}
    for mode in modes:
        for seed in range(cfg.num_seeds):
            run_dir = cfg.run_dir / "runs" / f"{cfg.model}-{mode}-seed{seed}"
            if not RunDir(run_dir).is_finished():  # an interrupted run resumes
                log.info("bench: %s seed %d -> %s", mode, seed, run_dir)
                env = dict(os.environ, TRAINLAB_BENCH="1", **{SHOWN_ENV: json.dumps(shown)})
                code = _run_child(_train_command(cfg, mode, seed, run_dir, extra), env)
                if code != 0:
                    raise UsageError(
                        f"the {mode} run (seed {seed}) failed with exit code {code}; see its output above and {run_dir}"
                    )
            groups.setdefault(mode, []).append(run_dir)
    manifest = {label: [str(d.relative_to(cfg.run_dir)) for d in dirs] for label, dirs in groups.items()}
    (cfg.run_dir / BENCH_MANIFEST).write_text(json.dumps({"groups": manifest}, indent=2) + "\n")
    run_dirs = [d for dirs in groups.values() for d in dirs]
    paths = write_report(ReportPlan(run_dirs, groups, cfg.run_dir / "plots", cfg.run_dir))
    device = "cuda: " + torch.cuda.get_device_name(0) if torch.cuda.is_available() and cfg.device != "cpu" else "cpu"
    (cfg.run_dir / "environment.txt").write_text(
        f"device: {device}\ntorch: {torch.__version__}\nthreads: {torch.get_num_threads()}\n"
    )
    print((cfg.run_dir / "results.md").read_text())
    for path in paths:
        if path.suffix == ".png":
            print(path)
    return cfg.run_dir


def main(argv: list[str]) -> int:
    if not argv:
        raise UsageError("name a benchmark: precision or data; `trainlab bench --help` describes them")
    if argv[0] in ("-h", "--help"):
        print("usage: trainlab bench precision [options] [-- extra `trainlab train cifar` flags]")
        print("       trainlab bench data RECIPE [--num-workers N] [--seconds S] [--json] [RECIPE's training flags]")
        print("`trainlab bench precision --help` and `trainlab bench data --help` list the options.")
        return 0
    if argv[0] == "data":
        from trainlab.commands import bench_data

        return bench_data.main(argv[1:])
    if argv[0] != "precision":
        raise UsageError(f"unknown benchmark {argv[0]!r}; available: precision, data")
    rest = argv[1:]
    extra: list[str] = []
    if "--" in rest:
        cut = rest.index("--")
        rest, extra = rest[:cut], rest[cut + 1 :]
    cfg = parse(PrecisionBenchConfig, rest, prog="trainlab bench precision")
    check_extra_flags(cfg, extra)
    run_precision_bench(cfg, extra)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
