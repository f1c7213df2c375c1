"""Building a recipe for its shapes only: the memory planner traces on fake tensors and never reads a weight value.

Inside `shapes_only()`, a recipe's `build` may make a frozen model from its registered architecture without its
weights file (the planner's `--tokenizer-model vqvae_official` with no `--tokenizer-weights`), and read only the
names and shapes of a file that is given. Outside it (training, evaluation), weights are required as always.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_SHAPES_ONLY: ContextVar[bool] = ContextVar("shapes_only", default=False)


@contextmanager
def shapes_only() -> Iterator[None]:
    """Within: models are built for their shapes; weight values are neither needed nor read."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def weights_needed() -> bool:
    """False inside `shapes_only()`."""
    return not _SHAPES_ONLY.get()
