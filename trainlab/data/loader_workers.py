"""What every DataLoader worker process of trainlab does first: leave the stop signals to the process it serves.

A SIGTERM sent to the whole process group (`docker stop`, Slurm's `scancel`, systemd, `kill -TERM -PGID`), a
terminal's SIGHUP or a Ctrl-C's SIGINT reaches the loader workers too. Killed by it, they take the batches the
training process still needs with them, and the loader raises "DataLoader worker ... is killed by signal" before the
step in progress ends and is saved. Ignoring them here lets the training process finish its step, save and exit; the
workers then stop as the loader shuts down (or, stuck, when torch's watchdog sees their parent gone).
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader `worker_init_fn` (or the start of one): SIGTERM, SIGINT and SIGHUP are the parent's to handle."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
