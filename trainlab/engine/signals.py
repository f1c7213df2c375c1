"""Graceful stop on SIGTERM / SIGINT: the handler only sets a flag; the loop finishes the step, saves, exits."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger(__name__)


class StopFlag:
    """Set by SIGTERM/SIGINT. A second SIGINT restores the default handler's behaviour (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = name
        log.warning("%s received: finishing the current step, saving a checkpoint, then exiting", name)


@contextmanager
def graceful_stop() -> Iterator[StopFlag]:
    """Install SIGTERM/SIGINT handlers for the duration of training (main thread only; elsewhere a no-op)."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, flag._handle)
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
