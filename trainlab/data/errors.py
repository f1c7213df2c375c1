"""The data path's one error type: a `UsageError` that stays one line when raised inside a DataLoader worker.

A `DataLoader` with workers re-raises a worker's exception in the main process as `type(err)(text)`, where `text` is
PyTorch's "Caught DataError in DataLoader worker process 0.\\nOriginal Traceback (most recent call last): ..." followed
by the worker's whole traceback, the original message on its last line. `DataError`'s constructor recognises that
text and keeps only the original message, so the user reads the same one line with or without workers, from any
loader (the engine's, a recipe's evaluation loader, torch-fidelity's). Every error the data readers raise on purpose
while a loader iterates (an unreadable image, a folder of unreadable images) is a `DataError`.
"""

from __future__ import annotations

import re

from trainlab.errors import UsageError

# PyTorch's wrapping (torch/_utils.py, ExceptionWrapper.reraise): "Caught <Type> in DataLoader worker process <N>."
_WORKER_WRAPPING = re.compile(r"^Caught \w+ in DataLoader worker process \d+\.\nOriginal Traceback")


class DataError(UsageError):
    """A problem with the user's data, one line naming the file and the fix (CLI exit code 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(worker_message(message, type(self)))


def worker_message(text: str, error_type: type[BaseException]) -> str:
    """The original message of `error_type` inside PyTorch's worker wrapping `text`; `text` itself otherwise.

    The wrapped traceback ends with the line `<module>.<qualname>: <message>` (Python's `format_exception`); the
    message is what follows the last such marker. Text without the wrapping comes back unchanged.
    """
    if not _WORKER_WRAPPING.match(text):
        return text
    marker = f"\n{error_type.__module__}.{error_type.__qualname__}: "
    at = text.rfind(marker)
    if at < 0:
        return text
    return text[at + len(marker) :].strip()
