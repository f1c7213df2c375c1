"""One process per run directory: an exclusive `flock` on `run_dir/.lock`, holding the owner's pid, host and start.

The lock lives as long as the process (the kernel drops it on exit or SIGKILL, so a crashed run never leaves a
stale lock behind). A second launch on the same run directory fails at once with a one-line error naming the owner.
Under torchrun only rank 0 takes it (the ranks of one job share the directory by design).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import IO

from trainlab.errors import UsageError

LOCK_NAME = ".lock"


class RunDirLock:
    """Exclusive, non-blocking lock of a run directory; release() or process exit frees it."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self._file: IO[str] | None = None
        self._text = ""  # what this process wrote into the lock file

    def acquire(self) -> None:
        """Take the lock or raise a UsageError naming the process that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # noqa: SIM115 - held open for the lock's lifetime
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = _describe(handle.read())
            handle.close()
            raise UsageError(
                f"run directory {self.path.parent} is in use by {owner}; wait for it to finish, stop it, or pass "
                "another --run-dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        self._text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        handle.write(self._text)
        handle.flush()
        self._file = handle

    def in_place(self) -> bool:
        """Whether the locked file is still at `path` (False: the run directory, or the lock, was removed or moved)."""
        if self._file is None:
            return True
        try:
            here, held = os.stat(self.path), os.fstat(self._file.fileno())
            if (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino):
                return True
            # a file system whose inode numbers do not hold still (some FUSE mounts): the file's text decides
            return self.path.read_text() == self._text
        except (OSError, UnicodeDecodeError):
            return False

    def release(self) -> None:
        """Free the lock (idempotent)."""
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_owner(run_dir: Path) -> str | None:
    """'pid P on HOST' when `run_dir`'s lock is held by a live process, else None (never creates the lock file)."""
    try:  # without blocking, and only a regular file: a FIFO named .lock must not hang a listing
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # no trainer holds it: a trainer's lock is a regular file
        os.close(fd)
        return None
    handle = os.fdopen(fd)
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with a trainer's LOCK_EX
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                return None
            try:
                info = json.loads(handle.read() or "{}")
            except (ValueError, RecursionError):
                info = {}
            if not isinstance(info, dict):
                info = {}
            return f"pid {info.get('pid', '?')} on {info.get('host', '?')}"
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    return None


def _describe(text: str) -> str:
    try:
        owner = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(owner["started"])))
        return f"pid {owner['pid']} on host {owner['host']} (started {started})"
    except (ValueError, KeyError, TypeError):
        return "another process"
