"""The `trainlab` command: a thin dispatcher. Each subcommand's flags come from its typed config or its module.

    trainlab train RECIPE [--config file.yaml] [--field value ...]   (flags generated from the recipe's config)
    trainlab plan RECIPE [--gpu NAME|GiB] [--gpus N] [--json] ...    (will the run fit? traced on fake tensors)
    trainlab bench precision ...                                     (every precision mode, then plots)
    trainlab report RUN_DIR [RUN_DIR ...]                            (plots and tables from run directories)
    trainlab sample --tokenizer-weights PATH --var-weights PATH ...  (sample from VAR weights)
    trainlab demo [--quick]                                          (tokenizer + VAR on bundled digits, judged)
    trainlab launch [torchrun options] COMMAND ...                   (torchrun, exiting with the workers' code)
    trainlab doctor [RECIPE [train flags]] [--json]                  (checks this machine before a long run)

Flags are one vocabulary across commands (`trainlab/vocabulary.py`). The dispatcher imports a command's module when
it runs, and a command imports torch when it needs it: `--help`, `runs`, `report` and usage errors load no torch.

One error boundary for every command: a user error (`UsageError`), an OS error (full disk, read-only or missing
path, a file where a folder is expected, ...) and running out of memory (a device's or the host's, or the address
space to load torch's library) print one line `trainlab CMD: error: ...` and exit with code 2 (a diverged run: 1);
a collective that fails because another process of the run died is one line with exit code 1; anything else is a
bug and keeps its traceback. Under torchrun only rank 0 prints the line (every rank exits with the code) and the
line goes to torchrun's error file for its summary. SIGTERM outside the training loop (whose own handlers save
first) ends a command as Ctrl-C does: one line, exit code 143 (Ctrl-C: 130).
`--help` on any subcommand documents every field.
"""

from __future__ import annotations

import errno
import gc
import importlib
import logging
import os
import resource
import select
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

from trainlab import launcher
from trainlab.engine.host_allocator import configure_host_allocator
from trainlab.errors import Terminated, UsageError

log = logging.getLogger("trainlab")

_COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("trainlab.commands.train:main", "train a recipe on the shared engine (trainlab train --help)"),
    "plan": ("trainlab.commands.plan:main", "GPU memory planner: will RECIPE fit? (trainlab plan RECIPE --gpu 48GiB)"),
    "bench": (
        "trainlab.commands.bench:main",
        "benchmarks: `bench precision` (every precision mode), `bench data RECIPE` (loader samples/s per core)",
    ),
    "report": ("trainlab.commands.report:main", "plots and tables from one or more run directories"),
    "runs": ("trainlab.commands.runs:main", "every run under a folder: status, step, last metrics, resume command"),
    "sample": ("trainlab.commands.sample:main", "sample images from VAR weights (official or trainlab-trained)"),
    "edit": ("trainlab.commands.edit:main", "in-paint / out-paint / class-edit an image with VAR weights (zero-shot)"),
    "eval": ("trainlab.commands.eval:main", "MoCo backbones (`eval knn|linear-probe`), samples (`eval fid|judge`)"),
    "demo": ("trainlab.commands.demo:main", "tokenizer + VAR trained on bundled digits, then judged (--quick: 2 min)"),
    "doctor": ("trainlab.commands.doctor:main", "check the machine before a long run: GPUs, versions, shm, disk, data"),
}
LAUNCH_HELP = "torchrun for trainlab: `trainlab launch --nproc-per-node 2 train toy ...` exits with the workers' code"

# What to do about an OS error, by errno (the error's own text says what went wrong and where).
_OS_ERROR_FIX = {
    errno.ENOSPC: "free disk space or write somewhere else",
    errno.EDQUOT: "free disk space (quota exceeded) or write somewhere else",
    errno.EFBIG: "the file grew past the size this system allows: write somewhere else",
    errno.EROFS: "that location is read-only: pass a writable path",
    errno.EACCES: "no permission there: pass a path you can write (or read)",
    errno.EPERM: "not permitted there: pass a path you can write (or read)",
    errno.ENOTDIR: "a file is in the way of a folder: remove it or pass another path",
    errno.EISDIR: "a folder is in the way of a file: remove it or pass another path",
    errno.EEXIST: "something of that name is in the way: remove it or pass another path",
    errno.ENOENT: "no such file or folder: check the path",
    errno.ENOTEMPTY: "the folder is not empty: empty it or pass another path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n) or lower --num-workers",
    errno.ENFILE: "too many open files on this system: close some, or lower --num-workers",
    errno.ENOMEM: "out of memory: lower the batch size or other sizes, or free memory",
    errno.EIO: "the disk reported an I/O error: check it, or write somewhere else",
}


def setup_logging() -> None:
    rank = launcher.launched_rank()  # a damaged RANK is refused inside the command, as one line
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
    lines += [f"  {'launch':<8} {LAUNCH_HELP}"]
    lines += ["", "Run `trainlab COMMAND --help` for the options of a command."]
    return "\n".join(lines)


def _load(target: str) -> Callable[[list[str]], int]:
    module_name, func = target.split(":")
    command: Callable[[list[str]], int] = getattr(importlib.import_module(module_name), func)
    return command


def describe_os_error(err: OSError) -> str:
    """One line for an OS error: what failed, on which path, and what to do about it."""
    reason = err.strerror or str(err) or type(err).__name__
    where = ""
    if err.filename is not None:
        where = f": {os.fsdecode(err.filename)}"
        if err.filename2 is not None:
            where += f" -> {os.fsdecode(err.filename2)}"
    fix = _OS_ERROR_FIX.get(err.errno or -1, "check the path, its permissions and the free disk space")
    if err.errno == errno.ENOENT and err.filename is not None:
        missing = _missing_folder(os.fsdecode(err.filename))
        if missing is not None:  # e.g. the run directory, removed or moved under a running command
            fix = f"the folder {missing} does not exist (removed or moved while the command ran?): check the path"
    return f"{reason}{where}; {fix}"


def _missing_folder(path: str) -> str | None:
    """The outermost missing folder above `path` (None where its parent folder exists)."""
    missing = None
    folder = os.path.dirname(os.path.abspath(path))
    while folder and not os.path.isdir(folder):
        missing = folder
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return missing


# What torch's CPU allocator raises (a plain RuntimeError) when the host cannot give it memory.
_HOST_ALLOCATOR_FAILURES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")
# What a collective raises when another process of the run died under it (gloo; NCCL's watchdog says it its own way).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited or there was a network")


def _out_of_memory(err: BaseException) -> bool:
    """MemoryError (host), torch's OutOfMemoryError (a device's allocator) or its CPU allocator's RuntimeError."""
    if isinstance(err, MemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err) for text in _HOST_ALLOCATOR_FAILURES)


def _library_not_mapped(err: ImportError) -> bool:
    """The loader could not map a shared library (torch's) into memory: an address-space limit, not a bad install."""
    text = str(err).lower()
    return "failed to map segment" in text or "cannot allocate memory" in text


def _head(err: BaseException) -> str:
    """The first line of an error's message (its type where it has none), at most 200 characters."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _address_space_message(err: ImportError) -> str:
    first = _head(err)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    limit = "" if soft == resource.RLIM_INFINITY else f" (ulimit -v {soft // 1024} KiB)"
    return (
        f"out of memory while loading a library ({first}): the process's address-space limit{limit} or the free "
        "memory is too small for torch; raise the limit (ulimit -v unlimited) or free memory"
    )


def _peer_lost(err: BaseException) -> bool:
    """A collective's error because another process of a torchrun run died (that process's failure is the news)."""
    return launcher.launched_by_torchrun() and any(text in str(err) for text in _PEER_LOST)


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def _after_the_line(unraisable: sys.UnraisableHookArgs) -> None:
    """`sys.unraisablehook` once a command's one line is out: what fails in a finaliser while the command's objects
    are let go (a half-started DataLoader iterator's `__del__`, ...) is a consequence of that error, not news."""


def _thread_failed(args: threading.ExceptHookArgs) -> None:
    """A background thread's OS error (a log writer whose run directory was deleted) in one line: the command's own
    error boundary says what it means for the run. Anything else is a bug: the default hook prints its traceback."""
    if isinstance(args.exc_value, OSError):
        thread = args.thread.name if args.thread is not None else "a thread"
        log.error("%s stopped: %s", thread, describe_os_error(args.exc_value))
        return
    threading.__excepthook__(args)


def _fail(name: str, message: str, exit_code: int) -> int:
    """Print the one line (rank 0 only under torchrun), hand it to torchrun's error file, return the exit code."""
    sys.unraisablehook = _after_the_line
    line = f"trainlab {name}: error: {' '.join(message.split())}"
    if launcher.launched_rank() == 0:
        print(line, file=sys.stderr)
    launcher.record_error_for_launcher(line)
    return exit_code


def _launch(rest: list[str]) -> int:
    """`trainlab launch [torchrun options] COMMAND ...`: the first word after torchrun's options (torchrun's training
    script) must be a trainlab command, which every worker runs as `python -m trainlab COMMAND ...`."""
    if not rest:
        raise UsageError("no command to launch: trainlab launch [torchrun options] COMMAND [options]")
    if rest[0] in ("-h", "--help"):
        print("usage: trainlab launch [torchrun options] COMMAND [options]")
        print(f"  {LAUNCH_HELP}; the options are torchrun's (`torchrun --help`)")
        return 0
    return launcher.launch(rest, list(_COMMANDS))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(_usage(), file=sys.stderr)
        print(f"trainlab: error: no command given; choose one of: {', '.join([*_COMMANDS, 'launch'])}", file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        import trainlab

        print(f"trainlab {trainlab.__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in _COMMANDS and name != "launch":
        choices = ", ".join([*_COMMANDS, "launch"])
        print(f"trainlab: error: unknown command {name!r}; choose one of: {choices}", file=sys.stderr)
        return 2
    setup_logging()
    on_sigterm = signal.getsignal(signal.SIGTERM)
    if name != "launch" and on_sigterm is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)  # the main thread's: a command here is in it
    hooks = sys.unraisablehook, threading.excepthook
    threading.excepthook = _thread_failed
    try:
        return _run_command(name, rest)
    finally:
        sys.unraisablehook, threading.excepthook = hooks
        if signal.getsignal(signal.SIGTERM) is _raise_terminated:
            signal.signal(signal.SIGTERM, on_sigterm)


def _run_command(name: str, rest: list[str]) -> int:
    """The error boundary (module docstring) around one command."""
    try:
        if name == "launch":
            return _launch(rest)
        configure_host_allocator()
        return _load(_COMMANDS[name][0])(rest)
    except UsageError as err:
        return _fail(name, str(err), err.exit_code)
    except OSError as err:
        if isinstance(err, BrokenPipeError) and _stdout_closed():
            return STDOUT_CLOSED
        return _fail(name, describe_os_error(err), 2)
    except KeyboardInterrupt as err:
        terminated = isinstance(err, Terminated)
        sys.unraisablehook = _after_the_line
        if launcher.launched_rank() == 0:
            print(f"trainlab {name}: {'terminated (SIGTERM)' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    except ImportError as err:
        if not _library_not_mapped(err):
            raise  # a missing module or a bad install: the traceback names it
        return _fail(name, _address_space_message(err), 2)
    except (MemoryError, RuntimeError) as err:
        first = _head(err)
        if _peer_lost(err):
            return _fail(name, f"another process of the run is gone ({first}); see the launcher's message", 1)
        if not _out_of_memory(err):
            raise  # a bug: the traceback is what helps
        return _fail(name, f"out of memory ({first}); lower the batch size or other sizes, or free memory", 2)


STDOUT_CLOSED = 128 + signal.SIGPIPE  # what a shell reports for a program its pipe's reader left (`| head -1`)


def _stdout_closed() -> bool:
    """Whether stdout's reader has gone (a BrokenPipeError there): stdout is pointed at /dev/null, so the
    interpreter's last flush cannot fail again, and the command ends quietly: the reader asked for no more."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (captured in-process)
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    if not any(events & select.POLLERR for _, events in poller.poll(0)):  # a pipe without a reader: POLLERR
        return False
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return True


def _open_closed_standard_streams() -> None:
    """A standard stream the caller closed (`trainlab train ... 2>&-`) becomes /dev/null: Python leaves sys.stderr
    None (the progress bar's and the logger's checks then fail), and the next file the run opens would take the free
    descriptor and receive what is written to the stream."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        setattr(sys, name, open(fd, mode, buffering=1 if mode == "w" else -1, closefd=False))  # noqa: SIM115


def _never_fail_to_encode(stream: object) -> None:
    """Text a terminal's encoding cannot show (a non-ASCII run name under LANG=C, a file name's undecodable bytes) is
    written escaped (\\xfc) instead of ending the command with UnicodeEncodeError."""
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="backslashreplace")


def run() -> NoReturn:
    """The `trainlab` program (console script, `python -m trainlab`, `torchrun -m trainlab`): `main`, then exit.

    `main` only returns its exit code, so it can be called in-process; ending the process is done here. Under torchrun
    a failed rank ends at once with that code (`launcher.exit_failed_worker`), never by the launcher's signal.
    """
    _open_closed_standard_streams()
    _never_fail_to_encode(sys.stdout)
    try:
        exit_code = main()
    except BrokenPipeError:  # `trainlab --help | head -1`: outside a command's boundary
        if not _stdout_closed():
            raise
        exit_code = STDOUT_CLOSED
    if exit_code != 0:
        sys.unraisablehook = _after_the_line  # the line is out: a second Ctrl-C in an atexit callback is no news
        launcher.exit_failed_worker(exit_code)
    # What is alive now lives to the end of the process: the interpreter's last collection, which walks every object
    # of torch's modules (~0.75 s of each command on a 2-core CPU), is skipped. The command's files are closed by then
    # (the engine closes its logs and writers in `fit`), and atexit handlers still run.
    gc.freeze()
    sys.exit(exit_code)


if __name__ == "__main__":
    run()
