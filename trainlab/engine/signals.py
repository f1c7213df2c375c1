"""Graceful stop on SIGTERM / SIGINT / SIGHUP: the handler only sets a flag; the loop finishes the step, saves, exits.

SIGHUP is what a closed terminal or a dropped SSH session sends: it stops the run like SIGTERM (the step since the
last checkpoint is not lost), unless the process ignores it (`nohup` sets that, and it is kept). The terminal is gone
by then, so the standard streams that were a terminal are pointed at /dev/null first: a progress bar's next write
would otherwise fail (EIO) before the checkpoint is written.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger(__name__)

STANDARD_STREAMS = (1, 2)  # stdout, stderr


class StopFlag:
    """Set by SIGTERM / SIGINT / SIGHUP. A second SIGINT restores the default handler's behaviour
    (KeyboardInterrupt)."""

    def __init__(self, terminal_fds: tuple[int, ...] = ()) -> None:
        self.requested = False
        self.signal_name = ""
        self._terminal_fds = terminal_fds  # the standard streams that were a terminal when training began
        self.saving = False  # a checkpoint is being written: a second SIGINT waits for it (`deferring_interrupts`)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            if self.saving:  # raised inside torch.save it would cut the file and surface as a RuntimeError
                log.warning("SIGINT again: the checkpoint being written is finished first, then the run exits")
                return
            raise KeyboardInterrupt
        first = not self.requested
        self.requested = True
        self.signal_name = self.signal_name or name
        if first:
            log.warning("%s received: finishing the current step, saving a checkpoint, then exiting", name)
        if signum == getattr(signal, "SIGHUP", None):
            detach_terminal(self._terminal_fds)


def detach_terminal(fds: tuple[int, ...]) -> None:
    """Point `fds` at /dev/null (their terminal hung up: writes to it fail with EIO)."""
    if not fds:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            os.dup2(null, fd)
    finally:
        os.close(null)


def stop_signals() -> list[signal.Signals]:
    """SIGTERM and SIGINT, and SIGHUP where the platform has it and the process does not ignore it (`nohup`)."""
    wanted = [signal.SIGTERM, signal.SIGINT]
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is not None and signal.getsignal(hangup) is not signal.SIG_IGN:
        wanted.append(hangup)
    return wanted


def _terminal_fds() -> tuple[int, ...]:
    fds = []
    for fd in STANDARD_STREAMS:
        try:
            if os.isatty(fd):
                fds.append(fd)
        except OSError:
            pass
    return tuple(fds)


@contextmanager
def graceful_stop() -> Iterator[StopFlag]:
    """Install the stop handlers for the duration of training (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield StopFlag()
        return
    global _ACTIVE
    flag = StopFlag(_terminal_fds())
    previous = {s: signal.getsignal(s) for s in stop_signals()}
    for s in previous:
        signal.signal(s, flag._handle)
    _ACTIVE = flag
    try:
        yield flag
    finally:
        _ACTIVE = None
        for s, handler in previous.items():
            signal.signal(s, handler)


_ACTIVE: StopFlag | None = None  # the flag of the training loop in progress (main thread)


@contextmanager
def deferring_interrupts() -> Iterator[None]:
    """While a checkpoint is written: a second Ctrl-C does not interrupt the write (the run exits right after it, as
    the first Ctrl-C asked); outside training, nothing changes."""
    flag = _ACTIVE
    if flag is None:
        yield
        return
    flag.saving = True
    try:
        yield
    finally:
        flag.saving = False
