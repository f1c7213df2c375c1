"""The one source of augmentation randomness: draws that are a pure function of (seed, epoch, sample index), and
the epoch counter datasets share with their loader workers.

No global RNG, no worker id, no library version enters a draw, which is what makes resumed runs and runs with a
different number of loader workers see the same pixels.
"""

from __future__ import annotations

import hashlib
import struct

import torch


def augment_draws(seed: int, epoch: int, index: int) -> tuple[int, int]:
    """Two independent 64-bit words, a pure function of (seed, epoch, index) (BLAKE2b of the packed integers)."""
    digest = hashlib.blake2b(struct.pack("<qqq", seed, epoch, index), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")


class EpochCounter:
    """The current epoch in shared memory, so loader worker processes see `set` without being restarted."""

    def __init__(self) -> None:
        self._value = torch.zeros((), dtype=torch.int64).share_memory_()

    def set(self, epoch: int) -> None:
        self._value.fill_(epoch)

    def get(self) -> int:
        return int(self._value.item())
