"""Device memory for the simulator: address ranges backed by lazily-zeroed numpy arrays.

Backing the memory lets copies round-trip real bytes (H2D then D2H returns what was
sent), which tests and the functional mode rely on. ``np.zeros`` is calloc-backed, so
large parameter buffers cost nothing until touched.
"""
from __future__ import annotations

import bisect
import mmap

import numpy as np

from paella.dispatcher.devices.base import DeviceError, OutOfMemory

ALIGN = 256
BASE = 0x7000_0000_0000
#: Allocations from this size up get pages of their own (see :func:`_zeros`).
MMAP_MIN = 1 << 20


def _zeros(nbytes: int) -> np.ndarray:
    """Zeroed bytes that cost no memory until written. ``np.zeros`` is calloc, which is
    lazy only for a fresh mmap: once a program has freed large blocks, glibc raises its
    mmap threshold (up to 32 MB) and serves calloc from the heap, *writing* the zeros. A
    simulated BERT-base's buffer sets (11-40 MB each, most never written: the simulator
    times kernels without running them) then cost real memory, gigabytes at overload.
    An anonymous mapping is always lazy and goes back to the system when freed."""
    if nbytes < MMAP_MIN:
        return np.zeros(nbytes, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


class SimMemory:
    """The simulated GPU's DRAM: ``capacity`` bytes (the preset's ``mem_bytes``; 0: no
    limit). An allocation beyond it raises :class:`OutOfMemory`, as ``cuMemAlloc`` does,
    so that the dispatcher's handling of a full GPU is exercised here too."""

    def __init__(self, capacity: int = 0, gpu: str = "the simulated GPU") -> None:
        self.capacity = capacity
        self._gpu = gpu
        self._next = BASE
        self._bases: list[int] = []
        self._arrays: dict[int, np.ndarray] = {}
        self._used = 0

    def alloc(self, nbytes: int) -> int:
        if self.capacity and self._used + nbytes > self.capacity:
            raise OutOfMemory(f"out of device memory: {nbytes} B asked, {self._used} of "
                              f"{self.capacity} B in use on {self._gpu}")
        self._used += nbytes
        ptr = self._next
        self._next += -(-nbytes // ALIGN) * ALIGN + ALIGN   # a guard gap between buffers
        bisect.insort(self._bases, ptr)
        self._arrays[ptr] = _zeros(nbytes)
        return ptr

    def free(self, ptr: int) -> None:
        if ptr not in self._arrays:
            raise DeviceError(f"free of {ptr:#x}: not the start of a live allocation")
        self._used -= self._arrays.pop(ptr).size
        self._bases.remove(ptr)

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        """The bytes ``[ptr, ptr+nbytes)``; raises if they leave one allocation."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            base = self._bases[i]
            arr = self._arrays[base]
            off = ptr - base
            if off + nbytes <= arr.size:
                return arr[off:off + nbytes]
        raise DeviceError(f"device range [{ptr:#x}, +{nbytes}) is outside every allocation; "
                          f"check the buffer sizes in the launch plan")

    @property
    def allocated(self) -> int:
        return self._used
