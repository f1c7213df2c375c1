"""Host (CPU) memory policy of the `trainlab` command: freed memory stays in the process for the next step.

glibc's malloc hands every block above its mmap threshold (dynamic, at most 32 MiB) to the kernel with its own
mmap, returns it with munmap when the block is freed, and trims the top of its heap. A training or sampling step on
the CPU allocates and frees the same gigabytes of activations, logits and gradients every step, so the kernel maps,
page-faults and zeroes the same memory again every step. With `reuse` (the default), glibc serves every block from
its heaps and never trims them: after a few steps the heap stops growing and every step reuses the blocks the
previous one freed. Measured on the 2-core development CPU, `trainlab train var` at depth 4 (batch 8, fp32, two
epochs of 30 steps): 9.8 M minor page faults -> 0.41 M, 1.54 -> 1.36 s per step in the second epoch; the official
trainer's step gains about as much from it (1.88 -> 1.58 s; benchmarks/README.md, section 3). The price: the process
keeps its peak heap until it exits, and that heap is larger than glibc's own peak because freed blocks are not
always the right size for the next request (VAR-d4 over 80 steps: resident 2.67 GB, flat from the second step,
against 1.85-2.05 GB with the defaults).

The policy is chosen with the environment variable TRAINLAB_HOST_ALLOCATOR (`reuse` or `system`: glibc's own
defaults), applied once per process by the CLI and logged by `trainlab train` (on the CPU) and `trainlab sample`.
Outside glibc (macOS, musl) nothing is changed and the log says so. Library use (importing trainlab in one's own
script) changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from trainlab.errors import UsageError

ENV_VAR = "TRAINLAB_HOST_ALLOCATOR"
POLICIES = ("reuse", "system")

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (it has `gnu_get_libc_version`), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None
    return libc


_applied: str | None = None
_reusing = False

# `reuse` keeps up to about 1.3x glibc's peak resident (the VAR-d4 measurement above); a CPU plan against available
# RAM leaves that much room
REUSE_HEADROOM = 0.75


def reuses_freed_memory() -> bool:
    """Whether this process runs with the `reuse` policy in effect (glibc accepted it)."""
    return _reusing


def host_allocator() -> str:
    """What `configure_host_allocator` did in this process, as a line for the log."""
    return _applied or "host allocator: the C library's defaults (not configured: trainlab used as a library)"


def configure_host_allocator(policy: str | None = None) -> str:
    """Apply `policy` (default: $TRAINLAB_HOST_ALLOCATOR, else `reuse`); returns (and remembers) the line to log."""
    global _applied, _reusing
    _applied, _reusing = _apply(policy)
    return _applied


def _apply(policy: str | None) -> tuple[str, bool]:
    """The log line, and whether glibc now keeps freed memory."""
    policy = policy if policy is not None else os.environ.get(ENV_VAR, "reuse")
    if policy not in POLICIES:
        choices = ", ".join(POLICIES)
        raise UsageError(f"{ENV_VAR}={policy!r} is not a host allocator policy; set it to one of: {choices}")
    if policy == "system":
        return f"host allocator: the C library's defaults ({ENV_VAR}=system)", False
    libc = _glibc()
    if libc is None:
        return "host allocator: the C library's defaults (not glibc: the `reuse` policy applies to glibc only)", False
    # mallopt returns 1 on success; M_MMAP_MAX 0: no block gets its own mapping; M_TRIM_THRESHOLD at its maximum:
    # the heap top is not given back
    if libc.mallopt(_M_MMAP_MAX, 0) != 1 or libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX) != 1:
        return "host allocator: the C library's defaults (glibc refused mallopt)", False
    version = libc.gnu_get_libc_version().decode()
    line = f"host allocator: glibc {version} keeps freed memory for reuse (no mmap per block, no trim; "
    return line + f"{ENV_VAR}=system for its defaults)", True
