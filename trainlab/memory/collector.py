"""The garbage collector paused around the planner's bulk bookkeeping.

A fitted trace (`memory.batch_fit`) and its breakdown (`memory.breakdown`) build tens of thousands of small objects
(records, sets, allocator blocks) and no reference cycle; each burst of allocations starts the collector, whose
passes walk every young object, the traces just received from the trace workers included. Paused, a micro-batch
search step (a fitted VAR-d16 trace, its breakdown and allocator replay) takes ~75 ms instead of ~105 ms. Tracing
itself is never paused: a trace depends on when storages die.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    """No automatic collection within (a collector already disabled stays disabled)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
