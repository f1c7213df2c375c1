"""A model of PyTorch's CUDA caching allocator (default settings, one stream): what `memory_reserved` will be.

Rules, from `c10/cuda/CUDACachingAllocator.cpp` (reference/engine-and-memory.md B.2):

* every request is rounded up to a multiple of 512 B (at least 512 B);
* requests of at most 1 MiB use the small pool, larger ones the large pool;
* a request no cached block can serve gets a new segment (cudaMalloc): 2 MiB for the small pool, 20 MiB for
  requests under 10 MiB, else the request rounded up to a multiple of 2 MiB;
* reuse is best fit: the smallest free cached block of the pool at least as large as the request;
* a block larger than the request is split (the request takes the front) when the remainder is at least 512 B in the
  small pool, or more than 1 MiB in the large pool; otherwise the whole block is handed out;
* a freed block merges with free neighbours of its segment; segments are never returned to CUDA, except when a
  new segment would exceed the device's capacity: then the fully free cached segments are released and the request
  is retried (the allocator's OOM retry), and if it still does not fit the run is out of memory.

Not modelled: `max_split_size_mb`, `roundup_power2_divisions`, `expandable_segments`, several streams.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
MIN_BLOCK_SIZE = 512  # kMinBlockSize
SMALL_SIZE = 1 * MIB  # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: small-pool segment
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: segment for large requests under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge


def round_size(size: int) -> int:
    """The block size of a request: a multiple of 512 B, at least 512 B."""
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * ((size + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def segment_size(block_size: int) -> int:
    """The cudaMalloc size for a (rounded) request that no cached block serves."""
    if block_size <= SMALL_SIZE:
        return SMALL_BUFFER
    if block_size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((block_size + ROUND_LARGE - 1) // ROUND_LARGE)


class Block:
    """A block of a segment: free (cached) or handed out; `previous` / `next` are its neighbours in the segment."""

    __slots__ = ("allocated", "next", "offset", "previous", "segment", "size", "small")

    def __init__(
        self,
        segment: int,
        offset: int,
        size: int,
        small: bool,
        previous: Block | None = None,
        next: Block | None = None,
    ) -> None:
        self.segment, self.offset, self.size, self.small = segment, offset, size, small
        self.allocated = False
        self.previous, self.next = previous, next


class OutOfMemory(Exception):
    """The model ran out of the device capacity it was given."""


@dataclass
class AllocatorStats:
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    segments_allocated: int = 0
    retries: int = 0
    segment_sizes: list[int] = field(default_factory=list)


class CachingAllocatorModel:
    """Replays allocations and frees; `stats` holds allocated / reserved bytes and their peaks.

    Args:
        capacity_bytes: memory the allocator may reserve (None: unlimited); beyond it cached segments are released
            and the request retried once, then `OutOfMemory` is raised.
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.stats = AllocatorStats()
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # sorted keys per pool
        self._blocks: dict[tuple[int, int, int], Block] = {}
        self._segments: dict[int, Block] = {}  # segment id -> its first block
        self._segment_bytes: dict[int, int] = {}
        self._next_segment = 0

    # --------------------------------------------------------------------------------------- public
    def malloc(self, size: int) -> Block:
        """Allocate `size` bytes; returns the block (pass it to `free`)."""
        rounded = round_size(size)
        small = rounded <= SMALL_SIZE
        keys = self._free[small]
        i = bisect.bisect_left(keys, (rounded, -1, -1))  # best fit: the smallest cached block that serves it
        block = self._blocks.pop(keys.pop(i)) if i < len(keys) else self._new_segment(segment_size(rounded), small)
        remaining = block.size - rounded
        if (remaining >= MIN_BLOCK_SIZE) if small else (remaining > SMALL_SIZE):
            rest = Block(block.segment, block.offset + rounded, remaining, small, block, block.next)
            if block.next is not None:
                block.next.previous = rest
            block.next = rest
            block.size = rounded
            self._insert_free(rest)
        block.allocated = True
        stats = self.stats
        stats.allocated_bytes += block.size
        if stats.allocated_bytes > stats.peak_allocated_bytes:
            stats.peak_allocated_bytes = stats.allocated_bytes
        return block

    def free(self, block: Block) -> None:
        assert block.allocated, "double free"
        block.allocated = False
        self.stats.allocated_bytes -= block.size
        previous, following = block.previous, block.next
        if previous is not None and not previous.allocated:
            self._remove_free(previous)
            self._merge(block, previous)
        if following is not None and not following.allocated:
            self._remove_free(following)
            self._merge(block, following)
        self._insert_free(block)

    # -------------------------------------------------------------------------------------- internals
    def _insert_free(self, block: Block) -> None:
        key = (block.size, block.segment, block.offset)
        bisect.insort(self._free[block.small], key)
        self._blocks[key] = block

    def _remove_free(self, block: Block) -> None:
        key = (block.size, block.segment, block.offset)
        keys = self._free[block.small]
        i = bisect.bisect_left(keys, key)
        assert i < len(keys) and keys[i] == key
        del keys[i]
        del self._blocks[key]

    @staticmethod
    def _merge(block: Block, neighbour: Block) -> None:
        if neighbour is block.previous:
            block.offset = neighbour.offset
            block.previous = neighbour.previous
            if block.previous is not None:
                block.previous.next = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.previous = block
        block.size += neighbour.size

    def _new_segment(self, size: int, small: bool) -> Block:
        if self.capacity_bytes is not None and self.stats.reserved_bytes + size > self.capacity_bytes:
            self.stats.retries += 1
            self._release_free_segments()
            if self.stats.reserved_bytes + size > self.capacity_bytes:
                raise OutOfMemory(f"needs a {size} B segment with {self.stats.reserved_bytes} B reserved")
        segment = self._next_segment
        self._next_segment += 1
        block = Block(segment, 0, size, small)
        self._segments[segment] = block
        self._segment_bytes[segment] = size
        self.stats.reserved_bytes += size
        self.stats.segments_allocated += 1
        self.stats.segment_sizes.append(size)
        self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self.stats.reserved_bytes)
        return block

    def _release_free_segments(self) -> None:
        for pool in (True, False):
            for key in list(self._free[pool]):
                block = self._blocks[key]
                if block.previous is None and block.next is None:  # the whole segment is one free block
                    self._remove_free(block)
                    self.stats.reserved_bytes -= self._segment_bytes.pop(block.segment)
                    del self._segments[block.segment]


def replay(events: list[tuple[int, int]], sizes: list[int], capacity_bytes: int | None = None) -> AllocatorStats:
    """Replay (+1 / -1, storage index) events of storages of `sizes[index]` bytes through the allocator model."""
    model = CachingAllocatorModel(capacity_bytes)
    malloc, free = model.malloc, model.free
    live: dict[int, Block] = {}
    for kind, index in events:
        if kind > 0:
            size = sizes[index]
            if size > 0:  # an empty storage takes no block (the allocator returns a null pointer)
                live[index] = malloc(size)
        else:
            block = live.pop(index, None)
            if block is not None:
                free(block)
    return model.stats
