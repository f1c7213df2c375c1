"""The one source of augmentation randomness: draws that are a pure function of (seed, epoch, sample index), and
the epoch counter datasets share with their loader workers.

No global RNG, no worker id, no library version enters a draw, which is what makes resumed runs and runs with a
different number of loader workers see the same pixels.

A draw is BLAKE2b of the three integers packed as little-endian signed 64-bit (`struct.pack("<qqq", ...)`), read as
`num_words` little-endian 64-bit words. The digest size is one of BLAKE2b's parameters, so a 1-word and a 2-word
draw of the same (seed, epoch, index) are unrelated: every dataset keeps its word count fixed, since changing it
changes every augmentation (and the golden losses).

    pad_crop_flip (CIFAR)                  1 word: crop top, crop left, flip as mixed-radix digits
    two_views (MoCo)                       1 word: seeds the `random.Random` that draws both views
    var_resize_crop, random_resized_crop   2 words (`augment_draws`): word 0 places the random crop, the low bit
    _flip, in-memory flips, token-cache    of word 1 is the random flip (`decide_flip`)
    variants
"""

from __future__ import annotations

import hashlib
import struct
from typing import Literal

import torch

FlipMode = Literal["none", "random", "always"]

_WORD_BYTES = 8


def draw_words(seed: int, epoch: int, index: int, *, num_words: int) -> tuple[int, ...]:
    """`num_words` uniform 64-bit words, a pure function of (seed, epoch, index, num_words).

    Args:
        seed: the run's data seed.
        epoch: 0-based epoch.
        index: index of the sample in the dataset.
        num_words: 1 to 8 (BLAKE2b digests are at most 64 bytes); part of the hash, see the module docstring.

    Returns:
        The words, each in [0, 2**64).
    """
    digest = hashlib.blake2b(struct.pack("<qqq", seed, epoch, index), digest_size=_WORD_BYTES * num_words).digest()
    return tuple(int.from_bytes(digest[i : i + _WORD_BYTES], "little") for i in range(0, len(digest), _WORD_BYTES))


def augment_draws(seed: int, epoch: int, index: int) -> tuple[int, int]:
    """The two-word draw of the image datasets: word 0 places a random crop, word 1 decides a random flip."""
    crop_word, flip_word = draw_words(seed, epoch, index, num_words=2)
    return crop_word, flip_word


def mixed_radix_digits(word: int, *bases: int) -> tuple[int, ...]:
    """The lowest digits of `word` in the mixed radix `bases`: (word % b0, word // b0 % b1, ...).

    For a uniform 64-bit word each digit is uniform in [0, b) up to a bias below prod(bases) / 2**64.
    """
    digits = []
    for base in bases:
        word, digit = divmod(word, base)
        digits.append(digit)
    return tuple(digits)


def decide_flip(mode: FlipMode, draws: tuple[int, int]) -> bool:
    """Whether to mirror a sample: never, always, or ("random") when the low bit of `draws[1]` is set.

    Args:
        mode: "none", "random" or "always".
        draws: `augment_draws(seed, epoch, index)` of the sample (read only for "random").
    """
    return mode == "always" or (mode == "random" and (draws[1] & 1) == 1)


class EpochCounter:
    """The current epoch in shared memory, so loader worker processes see `set` without being restarted.

    Set it before `iter(loader)` for that epoch: workers, persistent ones included, read the new value on their next
    `get`.
    """

    def __init__(self) -> None:
        self._value = torch.zeros((), dtype=torch.int64).share_memory_()

    def set(self, epoch: int) -> None:
        """Makes `epoch` the value every process sharing this counter reads."""
        self._value.fill_(epoch)

    def get(self) -> int:
        """The epoch last `set` (0 before any `set`)."""
        return int(self._value.item())
