"""The `trainlab` command: a thin dispatcher. Each subcommand's flags come from its typed config or its module.

    trainlab train RECIPE [--config file.yaml] [--field value ...]   (flags generated from the recipe's config)
    trainlab bench precision ...                                     (every precision mode, then plots)
    trainlab report RUN_DIR [RUN_DIR ...]                            (plots and tables from run directories)
    trainlab sample --vae PATH --var PATH --classes ...              (sample from VAR weights)
    trainlab demo [--quick]                                          (tokenizer + VAR on bundled digits, judged)
    trainlab doctor [RECIPE [train flags]] [--json]                  (checks this machine before a long run)

Bad input prints one line and exits with code 2; `--help` on any subcommand documents every field.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence

from trainlab.errors import UsageError
from trainlab.host_memory import configure_host_allocator

log = logging.getLogger("trainlab")

_COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("trainlab.commands.train:main", "train a recipe on the shared engine (trainlab train --help)"),
    "plan": ("trainlab.commands.plan:main", "GPU memory planner: will RECIPE fit? (trainlab plan RECIPE --gpu 48GiB)"),
    "bench": ("trainlab.commands.bench:main", "benchmarks: `trainlab bench precision` runs every precision mode"),
    "report": ("trainlab.commands.report:main", "plots and tables from one or more run directories"),
    "runs": ("trainlab.commands.runs:main", "every run under a folder: status, step, last metrics, resume command"),
    "sample": ("trainlab.commands.sample:main", "sample images from VAR weights (official or trainlab-trained)"),
    "edit": ("trainlab.commands.edit:main", "in-paint / out-paint / class-edit an image with VAR weights (zero-shot)"),
    "eval": ("trainlab.commands.eval:main", "MoCo backbones (`eval knn|linear-probe`), samples (`eval fid|judge`)"),
    "demo": ("trainlab.commands.demo:main", "tokenizer + VAR trained on bundled digits, then judged (--quick: 2 min)"),
    "doctor": ("trainlab.commands.doctor:main", "check the machine before a long run: GPUs, versions, shm, disk, data"),
}


def setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {'' if rank == 0 else f'[rank {rank}] '}%(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def _usage() -> str:
    lines = ["usage: trainlab COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_text}" for name, (_, help_text) in _COMMANDS.items()]
    lines += ["", "Run `trainlab COMMAND --help` for the options of a command."]
    return "\n".join(lines)


def _load(target: str) -> Callable[[list[str]], int]:
    module_name, func = target.split(":")
    command: Callable[[list[str]], int] = getattr(importlib.import_module(module_name), func)
    return command


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        import trainlab

        print(f"trainlab {trainlab.__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in _COMMANDS:
        print(f"trainlab: error: unknown command {name!r}; choose one of: {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    setup_logging()
    try:
        configure_host_allocator()
        return _load(_COMMANDS[name][0])(rest)
    except UsageError as err:
        print(f"trainlab {name}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"trainlab {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
