"""What a process knows about torchrun before torch is imported, and `trainlab launch`.

torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, TORCHELASTIC_ERROR_FILE) is read here without importing torch,
so the CLI can print a usage error on rank 0 only, record it for the launcher's summary and end every rank with the
same exit code without paying for torch's import (`tests/test_cli_startup.py`). The process group itself, and the
collectives, are `trainlab.dist`'s. `launch` imports torch's launcher when it runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Collection, Sequence
from typing import NoReturn

from trainlab.errors import UsageError
from trainlab.launch_options import as_given, check_options

log = logging.getLogger(__name__)


def launched_rank() -> int:
    """This process's rank from torchrun's RANK (0 in a single process): valid before the process group exists and
    after it is destroyed (the CLI prints errors on rank 0 only). Never raises: without a valid RANK below a valid
    WORLD_SIZE the process counts as alone (rank 0), so it prints the error its damaged environment causes; so does
    a process no launcher started (`launched_by_torchrun`), whatever RANK a shell left exported."""
    if not launched_by_torchrun():
        return 0
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0
    return rank if 0 <= rank < world else 0


def local_rank() -> int:
    """Rank on this machine, from torchrun's LOCAL_RANK (0 in a single process): picks the CUDA device.

    Raises:
        UsageError: LOCAL_RANK is set to something other than a non-negative integer.
    """
    return torchrun_variable("LOCAL_RANK")


def torchrun_variable(name: str, default: int = 0) -> int:
    """One of torchrun's integer variables (RANK, WORLD_SIZE, LOCAL_RANK), `default` where it is not set.

    Raises:
        UsageError: the variable holds something other than a non-negative integer (a damaged launch environment).
    """
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(
            f"the environment variable {name}={text!r} is not a rank or process count; launch with torchrun (or "
            "trainlab launch), or unset RANK, WORLD_SIZE and LOCAL_RANK for one process"
        )
    return value


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets for every worker


def launched_by_torchrun() -> bool:
    """Whether a launcher's environment is set: RANK and WORLD_SIZE, and the address the process group meets at
    (MASTER_ADDR, MASTER_PORT). torchrun sets all four; RANK and WORLD_SIZE alone, left exported in a shell, are no
    launch (`stray_launch_variables`)."""
    return all(name in os.environ for name in LAUNCH_VARIABLES)


def stray_launch_variables() -> list[str]:
    """`NAME=value` of RANK / WORLD_SIZE set in a process no launcher started (empty under torchrun)."""
    if launched_by_torchrun():
        return []
    return [f"{name}={os.environ[name]}" for name in ("RANK", "WORLD_SIZE") if name in os.environ]


def record_error_for_launcher(line: str) -> None:
    """Write `line` to torchrun's error file of this worker (TORCHELASTIC_ERROR_FILE, set by torchrun), in the format
    of torch.distributed.elastic's `ErrorHandler`: the launcher's failure summary then shows this one line as the
    worker's error instead of a link to the documentation. Nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError as err:  # the error itself was already printed; the summary then shows torchrun's own text
        log.warning("could not write torchrun's error file %s (%s)", path, err.strerror)


WORKER_EXIT_WAIT_S = 10.0  # how long a failed rank > 0 waits for the launcher to stop it after rank 0 left


def exit_failed_worker(exit_code: int) -> None:
    """Under torchrun, end this failed worker now with `exit_code` (after its error line was printed); else return.

    Every rank of a failed run must exit with the run's code, but torchrun stops the remaining workers with SIGTERM as
    soon as the first one exits, and a normal interpreter exit with torch loaded takes seconds. So rank 0 (the one
    that printed the line) leaves at once with `os._exit`; the other ranks turn the launcher's SIGTERM into the same
    exit code and wait for it (at most `WORKER_EXIT_WAIT_S`, then leave on their own).
    """
    if not launched_by_torchrun():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if launched_rank() != 0:
        expect_launcher_stop(exit_code)
        time.sleep(WORKER_EXIT_WAIT_S)
    os._exit(exit_code)


def expect_launcher_stop(exit_code: int) -> None:
    """Under torchrun, on ranks > 0 of a failed run: the launcher's SIGTERM (sent once rank 0 exited) ends this rank
    with `exit_code`. Called as soon as a rank knows it fails, before its clean-up, so rank 0 is always first out."""
    if launched_by_torchrun() and launched_rank() != 0:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(exit_code))


_PROGRAM_FLAGS = {"module": "-m", "no_python": "--no-python", "run_path": "--run-path"}  # torchrun's: what to run
_PET_FLAGS = ("PET_STANDALONE", "PET_MODULE", "PET_NO_PYTHON", "PET_RUN_PATH", "PET_VIRTUAL_LOCAL_RANK")


def launch(argv: Sequence[str], commands: Collection[str]) -> int:
    """`trainlab launch [torchrun options] COMMAND ...`: torchrun's launcher (`torch.distributed.run`) runs
    `python -m trainlab COMMAND ...` in every worker, in this process, and returns the workers' exit code.

    The first word after torchrun's options (`argv`) must be one of `commands`: torchrun's training script is always
    trainlab. torchrun's options are checked before anything starts (`launch_options.check_options`): a bad value,
    or a contradiction such as `--standalone --nnodes 2` that would wait forever for other nodes, is one line naming
    the option.

    Plain `torchrun` turns any worker's non-zero exit into a `ChildFailedError` traceback and exit code 1; here the
    first failed worker's exit code is returned as it is (2: a user error, whose one line rank 0 printed; 1: a
    diverged run or a crash, whose message the worker printed; 128 + N: a worker killed by signal N, said in one
    line). The launcher's own log lines about the failed worker are left out (the worker said what happened). SIGTERM
    or Ctrl-C to the launcher reaches the workers (torchrun passes it on and waits for them), which save as they do
    without a launcher; the launcher then says so in one line and exits 0, as `trainlab train` does.

    Raises:
        UsageError: no trainlab command to run, an option torchrun does not know or refuses, one that names another
            program to run, or options that contradict each other.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = _parse(argv, commands)
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.run")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        check_options(args)
        torchrun.run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode
        print(
            f"trainlab launch: error: rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}",
            file=sys.stderr,
        )
        return 128 - failure.exitcode
    except SignalException as err:  # a stop signal to the launcher: torchrun has passed it on and waited
        name = signal.Signals(err.sigval).name
        if err.sigval == getattr(signal, "SIGQUIT", None):  # the workers' default action: no save
            print(
                f"trainlab launch: {name} received: passed on to the workers, which stop at once without saving "
                "(SIGTERM saves); run the same command again to resume from the last checkpoint",
                file=sys.stderr,
            )
            return 128 + err.sigval
        print(
            f"trainlab launch: {name} received: passed on to the workers, which finish their step, save and stop; "
            "run the same command again to resume",
            file=sys.stderr,
        )
        return 0
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return 0


def _parse(argv: Sequence[str], commands: Collection[str]) -> argparse.Namespace:
    """torchrun's options and the trainlab command from `argv`, as torchrun's arguments for `python -m trainlab`."""
    from torch.distributed import run as torchrun

    choices = ", ".join(commands)
    try:
        parser = torchrun.get_args_parser()
    except ValueError:  # torchrun reads its flags' defaults from PET_* variables with int()
        bad = next((f"{name}={shlex.quote(os.environ[name])}" for name in _PET_FLAGS if name in os.environ), "PET_*")
        raise UsageError(f"{bad} in the environment is no torchrun flag value; set it to 0 or 1, or unset it") from None
    parser.prog = "trainlab launch"

    def refuse(message: str) -> NoReturn:
        if "training_script" in message:  # the positional argument is missing: no command after the options
            raise UsageError(f"no command to launch; name one of: {choices} (after the torchrun options)")
        raise UsageError(f"{message}; see `torchrun --help` for the launcher's options")

    parser.error = refuse  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    for dest, flag in _PROGRAM_FLAGS.items():
        if getattr(args, dest):
            raise UsageError(
                f"{as_given(flag, dest=dest)} names the program to run; `trainlab launch` always runs trainlab: drop it"
            )
    if args.training_script not in commands:
        raise UsageError(
            f"{args.training_script!r} is not a trainlab command; `trainlab launch` runs `python -m trainlab COMMAND` "
            f"in every worker: name one of {choices} after the torchrun options"
        )
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script, args.module = "trainlab", True
    return args
