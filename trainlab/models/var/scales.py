"""The token layout of VAR's multi-scale sequence: scale k has pn_k x pn_k tokens, concatenated coarse to fine.

One home for the arithmetic every VAR component needs (sequence length, per-scale slices and ends, the scale index
of each position). Pure functions of `patch_nums`, e.g. (1, 2, 3, 4, 5, 6, 8, 10, 13, 16) for 256 px: L = 680.
"""

from __future__ import annotations

from collections.abc import Sequence


def tokens_per_scale(patch_nums: Sequence[int]) -> list[int]:
    """pn_k^2 for every scale k."""
    return [int(pn) * int(pn) for pn in patch_nums]


def sequence_length(patch_nums: Sequence[int]) -> int:
    """L = sum of pn_k^2: tokens of all scales."""
    return sum(tokens_per_scale(patch_nums))


def scale_ends(patch_nums: Sequence[int]) -> list[int]:
    """End position (exclusive) of every scale in the concatenated sequence."""
    ends, end = [], 0
    for n in tokens_per_scale(patch_nums):
        end += n
        ends.append(end)
    return ends


def scale_slices(patch_nums: Sequence[int]) -> list[slice]:
    """Positions of every scale in the concatenated sequence."""
    ends = scale_ends(patch_nums)
    return [slice(end - n, end) for end, n in zip(ends, tokens_per_scale(patch_nums))]


def scale_of_position(patch_nums: Sequence[int]) -> list[int]:
    """The scale index k of every position 0..L-1."""
    return [k for k, n in enumerate(tokens_per_scale(patch_nums)) for _ in range(n)]
