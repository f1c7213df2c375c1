"""Each fact once: the planner builds the recipe for every trace, and the build's log lines would repeat."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Once(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


@contextmanager
def each_message_once() -> Iterator[None]:
    """Within: a log message already emitted (same logger, level and text) is dropped by the root's handlers."""
    once = _Once()
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(once)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(once)
