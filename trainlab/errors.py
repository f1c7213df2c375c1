"""User-facing errors.

`UsageError` is the one exception type the CLI turns into a single line on stderr and exit code 2. Raise it for
anything the user can fix (bad flag, missing file, wrong checkpoint); keep `assert` for internal invariants.

Helpers for writing those lines: `first_line(err)` (an exception reduced to its type and first line, the one way to
quote a library's error inside a UsageError) and `check_output_path(flag, path)` (refuse an output location that
cannot be written before any work starts).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

FIRST_LINE_LIMIT = 200  # characters of a quoted library error kept in a one-line message


class UsageError(Exception):
    """A problem with the user's input. The message is one line naming the problem and the fix."""

    exit_code = 2


class TrainingStopped(UsageError):
    """A run that cannot go on (it diverged: NaN / inf loss or weights). One line on stderr, exit code 1; the last
    good checkpoint is left as it was."""

    exit_code = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM outside the training loop (imports, building, evaluation commands): raised by the CLI's handler where
    Ctrl-C would raise KeyboardInterrupt, so both end the same way (one line; the training loop installs its own
    handlers, which save first)."""


def first_line(err: BaseException, limit: int = FIRST_LINE_LIMIT) -> str:
    """`TypeName: first non-empty line of the message`, at most `limit` characters (an ellipsis marks a cut).

    The form in which a UsageError quotes an exception raised by a library (torch, safetensors, PIL, yaml).
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def printable(text: str) -> str:
    """`text` without lone surrogates: a file name's undecodable bytes (Python keeps them as U+DC80..U+DCFF) become
    `\\xff`, any other lone surrogate (from a JSON escape) `\\ud800`, so the text can be drawn or written as UTF-8."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that stands for no byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def missing_file(path: str | os.PathLike[str]) -> str:
    """Why `path` is no file to read, in the words of a one-line error: "not found", or what is there instead (a
    folder, a FIFO, a broken or looping symbolic link), so a user does not look for a file that exists."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as err:
        if path.is_symlink():
            return "is a symbolic link that loops" if err.errno == errno.ELOOP else "is a broken symbolic link"
        if err.errno == errno.ELOOP:
            return "is a symbolic link that loops"
        return "not found" if err.errno in (errno.ENOENT, errno.ENOTDIR) else f"cannot be read ({err.strerror})"
    for check, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if check(mode):
            return f"is {kind}, not a regular file"
    return "is not a regular file (a device?)" if not stat.S_ISREG(mode) else "is a file"


def check_output_path(flag: str, path: str | os.PathLike[str], *, is_dir: bool) -> None:
    """Refuse an output location that cannot be written, before the work that would fill it (minutes to hours).

    The path itself must not be of the other kind (a file where a folder is wanted, or the reverse), and the nearest
    folder on its way that exists must be a directory in which a file can be created (checked by creating and
    deleting a temporary file there: this also catches read-only mounts and works as root).

    Args:
        flag: how the user named it (`--out-dir`, `--run-dir`), for the message.
        path: the output file or folder (it need not exist yet).
        is_dir: whether `path` is a folder (else a file).

    Raises:
        UsageError: one line naming the flag, the path, what is wrong and the fix.
    """
    path = Path(path)
    wanted = "a directory" if is_dir else "a file path"
    if path.exists() and path.is_dir() != is_dir:
        kind = "a directory" if path.is_dir() else "a file"
        raise UsageError(f"{flag} {path} is {kind}; pass {wanted}")
    if path.exists() and not is_dir and not path.is_file():  # a FIFO would block the write, a device swallow it
        raise UsageError(f"{flag} {path} {missing_file(path)}; pass {wanted} (a regular file or a new name)")
    existing = path if is_dir else path.parent
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # a dangling link: creating the folder would fail
            raise UsageError(f"{flag} {path}: {existing} is a broken symbolic link; pass {wanted} in a writable folder")
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {path}: {existing} is not a directory; pass {wanted} in a writable folder")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".trainlab-write-test-"):
            pass
    except OSError as err:
        reason = err.strerror or first_line(err)
        raise UsageError(
            f"{flag} {path} cannot be written ({existing}: {reason}); pass {wanted} in a writable folder"
        ) from None
