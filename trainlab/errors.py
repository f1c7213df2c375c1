"""User-facing errors.

`UsageError` is the one exception type the CLI turns into a single line on stderr and exit code 2. Raise it for
anything the user can fix (bad flag, missing file, wrong checkpoint); keep `assert` for internal invariants.
"""

from __future__ import annotations


class UsageError(Exception):
    """A problem with the user's input. The message is one line naming the problem and the fix."""

    exit_code = 2


class TrainingStopped(UsageError):
    """A run that cannot go on (it diverged: NaN / inf loss or weights). One line on stderr, exit code 1; the last
    good checkpoint is left as it was."""

    exit_code = 1
