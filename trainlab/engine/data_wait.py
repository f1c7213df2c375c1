"""How much of the training time is spent waiting for data: the time inside the loader iterator's `next()` (the
main process blocked until a batch is ready: reading and augmenting it without workers, or waiting for a worker)
over the wall time of the steps.

The engine wraps each epoch's loader iterator in a `DataWaitClock`, logs `data_wait_fraction` with the training
metrics (the fraction since the previous log row, this process's) and in the summary (over the timed epochs, the
same epochs as `images_per_second`). Near 0: the model sets the pace; near 1: the data pipeline does (more loader
workers, `trainlab bench data RECIPE` to measure the pipeline per core).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class DataWaitClock(Generic[T]):
    """An iterator over `iterator`'s items that adds up the seconds spent in its `next()`.

    Attributes:
        waited: seconds spent waiting for items since this clock was made.
    """

    def __init__(self, iterator: Iterator[T]) -> None:
        self._iterator = iterator
        self.waited = 0.0
        self._window_start = time.perf_counter()
        self._window_waited = 0.0

    def __iter__(self) -> DataWaitClock[T]:
        return self

    def __next__(self) -> T:
        began = time.perf_counter()
        try:
            return next(self._iterator)
        finally:
            self.waited += time.perf_counter() - began

    def window_fraction(self) -> float:
        """The fraction of the wall time spent waiting since the previous call (or since the clock was made)."""
        return self.window()[1]

    def window(self) -> tuple[float, float]:
        """The wall seconds since the previous call (or since the clock was made) and the fraction of them spent
        waiting; the next window starts now (the loop's throughput uses the same window: `engine.throughput`)."""
        now = time.perf_counter()
        elapsed, waited = now - self._window_start, self.waited - self._window_waited
        self._window_start, self._window_waited = now, self.waited
        return elapsed, (min(waited / elapsed, 1.0) if elapsed > 0 else 0.0)
