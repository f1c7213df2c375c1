"""The CUDA caching allocator model, case by case from the allocator's rules (reference B.2)."""

from __future__ import annotations

from trainlab.memory.allocator import MIB, CachingAllocatorModel, replay, round_size, segment_size


def test_one_byte_takes_a_512_byte_block_in_a_2_mib_segment() -> None:
    model = CachingAllocatorModel()
    block = model.malloc(1)
    assert block.size == 512 and round_size(1) == 512
    assert model.stats.reserved_bytes == 2 * MIB and model.stats.allocated_bytes == 512


def test_segment_sizes() -> None:
    assert segment_size(round_size(int(1.5 * MIB))) == 20 * MIB
    assert segment_size(round_size(11 * MIB)) == 12 * MIB
    assert segment_size(round_size(MIB)) == 2 * MIB  # 1 MiB is still the small pool


def test_large_block_is_not_split_when_the_remainder_is_at_most_1_mib() -> None:
    model = CachingAllocatorModel()
    first = model.malloc(11 * MIB)  # a 12 MiB segment, 1 MiB left: not split
    assert first.size == 12 * MIB and model.stats.allocated_bytes == 12 * MIB
    model.free(first)
    second = model.malloc(int(10.5 * MIB))  # the cached 12 MiB block; remainder 1.5 MiB > 1 MiB: split
    assert model.stats.reserved_bytes == 12 * MIB and second.size == int(10.5 * MIB)


def test_small_pool_splits_and_merges_on_free() -> None:
    model = CachingAllocatorModel()
    a, b, c = model.malloc(1000), model.malloc(1000), model.malloc(1000)
    assert (a.offset, b.offset, c.offset) == (0, 1024, 2048)
    model.free(a)
    model.free(b)  # merges with a
    big = model.malloc(2048)  # fits the merged 2048-byte hole at offset 0, no new segment
    assert big.offset == 0 and model.stats.reserved_bytes == 2 * MIB


def test_best_fit_picks_the_smallest_cached_block() -> None:
    model = CachingAllocatorModel()
    blocks = [model.malloc(s) for s in (4096, 512, 2048, 512)]
    model.free(blocks[0])  # 4096 hole
    model.free(blocks[2])  # 2048 hole
    chosen = model.malloc(2000)
    assert chosen.offset == blocks[2].offset


def test_replay_reserved_peak_and_oom_retry() -> None:
    sizes = [15 * MIB, 15 * MIB, 15 * MIB]
    events = [(1, 0), (-1, 0), (1, 1), (1, 2)]  # 0's segment is reused by 1; 2 needs a new one
    stats = replay(events, sizes)
    assert stats.peak_reserved_bytes == 32 * MIB and stats.peak_allocated_bytes == 32 * MIB
    small_then_large = replay([(1, 0), (-1, 0), (1, 1)], [11 * MIB, 19 * MIB], capacity_bytes=25 * MIB)
    assert small_then_large.retries == 1 and small_then_large.peak_reserved_bytes == 20 * MIB
