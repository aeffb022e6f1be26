"""Allocation of io regions inside the client's shared-memory arena.

Regions are what a request's ``[io_offset, io_offset + length)`` points at. A small
first-fit free list is enough: a client has at most a few hundred requests in flight,
and a region is freed when its result has been read.
"""
from __future__ import annotations

import bisect
import threading

from paella.client.errors import ArenaFull

ALIGN = 64   # one cache line: inputs of different requests never share a line


class ArenaAllocator:
    """First-fit allocator over ``[0, size)``; thread-safe (its own lock)."""

    def __init__(self, size: int):
        self.size = size
        self._starts: list[int] = [0]        # free extents, sorted by start
        self._lens: list[int] = [size]
        self._used: dict[int, int] = {}      # offset -> length
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int:
        """Offset of a fresh region of ``nbytes`` (rounded up to 64); ArenaFull if none fits."""
        if nbytes <= 0:
            raise ValueError(f"region size must be positive, got {nbytes}")
        n = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            for i, ln in enumerate(self._lens):
                if ln >= n:
                    off = self._starts[i]
                    if ln == n:
                        del self._starts[i], self._lens[i]
                    else:
                        self._starts[i] += n
                        self._lens[i] -= n
                    self._used[off] = n
                    return off
        raise ArenaFull(f"no free region of {nbytes} bytes in the {self.size}-byte arena "
                        f"({self.free_bytes} bytes free in {len(self._lens)} pieces); read "
                        f"results to free regions, or connect with a larger arena_bytes")

    def free(self, offset: int) -> None:
        with self._lock:
            n = self._used.pop(offset, None)
            if n is None:
                raise ValueError(f"offset {offset} is not an allocated region")
            i = bisect.bisect(self._starts, offset)
            # merge with the following extent, then with the preceding one
            if i < len(self._starts) and offset + n == self._starts[i]:
                n += self._lens[i]
                del self._starts[i], self._lens[i]
            if i > 0 and self._starts[i - 1] + self._lens[i - 1] == offset:
                self._lens[i - 1] += n
            else:
                self._starts.insert(i, offset)
                self._lens.insert(i, n)

    @property
    def free_bytes(self) -> int:
        return sum(self._lens)
