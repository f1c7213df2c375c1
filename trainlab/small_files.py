"""Small text files trainlab keeps for itself (the planner's stores in the cache folder): read as a regular file only,
without blocking and within a size bound, so a FIFO, a device or a runaway file in their place reads as "nothing
stored" instead of hanging the command or filling its memory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

STORE_LIMIT = 1 << 20  # a store holds a few lines of JSON


def read_small_text(path: Path, limit: int = STORE_LIMIT) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes.

    Raises:
        OSError: missing or unreadable, not a regular file (a FIFO, a device), or larger than `limit`.
        UnicodeDecodeError: not UTF-8 text.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO without a writer opens at once instead of waiting
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise OSError(f"{path} holds {info.st_size:,} bytes, more than a store's {limit:,}")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    return data.decode("utf-8")
