"""The shared augmentation randomness: pinned draws (a change would change every dataset's pixels and the golden
losses) and the shared-memory epoch counter seen by DataLoader workers."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from trainlab.data.augment import EpochCounter, augment_draws, decide_flip, draw_words, mixed_radix_digits
from trainlab.data.transforms import pad_crop_flip_draws


def _reference_words(seed: int, epoch: int, index: int, num_words: int) -> tuple[int, ...]:
    """The documented formula, written out independently of `draw_words`."""
    digest = hashlib.blake2b(struct.pack("<qqq", seed, epoch, index), digest_size=8 * num_words).digest()
    return tuple(int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(num_words))


def test_draws_are_pinned() -> None:
    assert augment_draws(0, 0, 0) == (9819966136895938196, 1760945046568759569)
    assert augment_draws(7, 3, 12345) == (6694361850513634371, 10834220965568200055)
    assert draw_words(0, 0, 0, num_words=1) == (2891389769238885931,)
    assert draw_words(7, 3, 17, num_words=1) == (17114712969277745315,)
    # CIFAR's crop offsets and flip come from the 1-word draw (top, left in [0, 8], flip)
    assert pad_crop_flip_draws(0, 0, 0) == (1, 0, False)
    assert pad_crop_flip_draws(7, 3, 17) == (8, 1, False)
    assert pad_crop_flip_draws(7, 3, 18) == (3, 8, True)


@pytest.mark.parametrize("num_words", [1, 2, 4])
def test_draws_are_a_pure_function_of_seed_epoch_index(num_words: int) -> None:
    torch.manual_seed(0)  # no global RNG enters a draw
    for seed, epoch, index in [(0, 0, 0), (1, 2, 3), (-5, 0, 2**40), (2**62, 7, 49_999)]:
        words = draw_words(seed, epoch, index, num_words=num_words)
        assert words == _reference_words(seed, epoch, index, num_words)
        assert len(words) == num_words and all(0 <= w < 2**64 for w in words)
    assert augment_draws(3, 1, 4) == draw_words(3, 1, 4, num_words=2)
    # the word count is part of the hash: a 1-word draw is not the first word of a 2-word draw
    assert draw_words(3, 1, 4, num_words=1)[0] != augment_draws(3, 1, 4)[0]
    # every argument matters
    base = augment_draws(0, 0, 0)
    assert len({base, augment_draws(1, 0, 0), augment_draws(0, 1, 0), augment_draws(0, 0, 1)}) == 4


def test_mixed_radix_digits() -> None:
    assert mixed_radix_digits(0, 9, 9, 2) == (0, 0, 0)
    assert mixed_radix_digits(1 + 2 * 9 + 1 * 81, 9, 9, 2) == (1, 2, 1)
    assert mixed_radix_digits(2**64 - 1, 5, 7) == ((2**64 - 1) % 5, (2**64 - 1) // 5 % 7)
    assert mixed_radix_digits(123) == ()


def test_decide_flip() -> None:
    odd, even = (0, 3), (5, 2)
    assert decide_flip("random", odd) and not decide_flip("random", even)
    assert decide_flip("always", even) and not decide_flip("none", odd)
    flips = [decide_flip("random", augment_draws(7, 3, i)) for i in range(12345, 12350)]
    assert flips == [True, True, False, True, False]


class _EpochProbe(Dataset[torch.Tensor]):
    """Sample i is the epoch the worker reading it sees."""

    def __init__(self) -> None:
        self.epoch = EpochCounter()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(self.epoch.get())


def test_epoch_counter_is_seen_by_persistent_loader_workers() -> None:
    probe = _EpochProbe()
    assert probe.epoch.get() == 0
    loader = DataLoader(probe, batch_size=2, num_workers=2, persistent_workers=True)
    seen = []
    for epoch in (0, 3, 5):
        probe.epoch.set(epoch)  # after the workers were started (persistent: they keep their dataset copy)
        seen.append(torch.cat(list(loader)).tolist())
    assert seen == [[0] * 4, [3] * 4, [5] * 4]
