"""The process's malloc policy while ortrain trains on the CPU (glibc only).

glibc serves a block from its heap instead of mmap once a block of that size was freed (its
"dynamic mmap threshold" rises up to 32 MiB), and keeps freed heap blocks unless 2x that size is
free at the top of the heap. A training step frees and allocates tens of MB-sized blocks (torch's
fresh gradient tensors, 23 MB each for the tutorial's embedding and LM head), so the heap keeps
whatever the step's interleaving leaves between them: on the tutorial the process grew by a further
20-45 MiB over the first ten steps. A fixed threshold (which also turns the dynamic rule off)
gives blocks of 4 MiB and more back to the system when freed, and a trim threshold of 8 MiB
returns the top of the heap. At most 2 malloc arenas (set before the engine's threads start):
each thread arena otherwise kept ~7 MiB of fragments (6 MiB less growth on the tutorial). The cost: blocks that large get fresh pages at every allocation (the
engine's own large buffers are allocated once and reused: the arena; the matmul packing buffers
stay below the threshold, see backend/cpu/matmul.rs).

`ORTRAIN_MALLOC_POLICY=0` leaves the process's malloc alone.
"""
from __future__ import annotations

import ctypes
import os
import sys

MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 8 << 20
ARENA_MAX = 2
_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_applied: bool | None = None


def apply() -> bool:
    """Sets the policy once per process; True when it is in effect."""
    global _applied
    if _applied is None:
        _applied = False
        if os.environ.get("ORTRAIN_MALLOC_POLICY", "1") != "0" and sys.platform.startswith("linux") \
                and _glibc():
            try:
                libc = ctypes.CDLL("libc.so.6")
                _applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
                    bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
                libc.mallopt(_M_ARENA_MAX, ARENA_MAX)
            except (OSError, AttributeError):
                _applied = False
    return _applied


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False
