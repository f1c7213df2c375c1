"""Each fact once: the planner builds the recipe for every trace, and the build's log lines would repeat.

A message a trace worker logged (`memory.trace_workers`: the one job that logs the recipe's facts) counts as emitted
here too (`emitted_elsewhere`), so that a build in the planner's own process later does not repeat it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

MessageKey = tuple[str, int, str]  # logger name, level, text


def message_key(record: logging.LogRecord) -> MessageKey:
    return (record.name, record.levelno, record.getMessage())


class _Once(logging.Filter):
    """Passes a message's first record (to every handler it is attached to) and drops later records of it."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[MessageKey, object] = {}  # message -> its first record (a sentinel: logged elsewhere)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.first.setdefault(message_key(record), record) is record


@contextmanager
def each_message_once() -> Iterator[None]:
    """Within: a log message already emitted (same logger, level and text) is dropped by the root's handlers."""
    once = _Once()
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(once)
    _ACTIVE.append(once)
    try:
        yield
    finally:
        _ACTIVE.remove(once)
        for handler in handlers:
            handler.removeFilter(once)


_ACTIVE: list[_Once] = []


def emitted_elsewhere(keys: list[MessageKey]) -> None:
    """Messages another process wrote to the same stream: within `each_message_once`, they are not repeated."""
    for once in _ACTIVE:
        for key in keys:
            once.first.setdefault(key, _ELSEWHERE)


_ELSEWHERE = object()
