"""Functional state that the effect workers compute on in place: bytes in a POSIX
shared-memory segment, mapped by the daemon and, by name, by each worker process.

A generation's KV cache is the case: every iteration reads and extends it, so shipping
it to a worker per iteration would cost more than the iteration. The segment is named
like every segment of the daemon (:func:`paella.segments.segment_name`), so one left by
a daemon killed with SIGKILL is removed by the next daemon's start-up sweep.
"""
from __future__ import annotations

import mmap
import os
from collections import OrderedDict

import numpy as np

from paella.segments import SHM_DIR, segment_name


class SharedArray:
    """``nbytes`` zeroed bytes (``array``, uint8) that worker processes map through
    :meth:`ref` and :func:`attach`. :meth:`close` unlinks the segment; the memory goes
    when the last mapping does."""

    def __init__(self, nbytes: int, what: str = "state"):
        if nbytes <= 0:
            raise ValueError(f"a shared array needs a positive size, got {nbytes}")
        self.path = os.path.join(SHM_DIR, segment_name(what).lstrip("/"))
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)         # zeroed, and lazy: pages come as they are written
            self._map = mmap.mmap(fd, nbytes)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    @property
    def ref(self) -> tuple[str, int]:
        """What a worker needs to map it (picklable)."""
        return self.path, self.nbytes

    def close(self) -> None:
        """Unlink the segment and unmap it (idempotent). Views made of ``array`` and still
        alive keep the mapping until they go (the memory goes with the last of them)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.array = None
        try:
            self._map.close()
        except BufferError:
            pass                             # (a view still alive holds it)


#: A worker's mappings, by path (least recently used first out).
_ATTACHED: "OrderedDict[tuple[str, int], np.ndarray]" = OrderedDict()
_MAX_ATTACHED = 16


def attach(ref: tuple[str, int]) -> np.ndarray:
    """The bytes of the shared array ``ref`` names, mapped once per process."""
    a = _ATTACHED.get(ref)
    if a is None:
        # A segment unlinked since (its model reloaded or gone) is let go here, or every
        # reload would leave this worker one more mapping nobody can see or reclaim.
        for old in [r for r in _ATTACHED if not os.path.exists(r[0])]:
            del _ATTACHED[old]
        path, nbytes = ref
        fd = os.open(path, os.O_RDWR)
        try:
            a = np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
        finally:
            os.close(fd)
        _ATTACHED[ref] = a
        while len(_ATTACHED) > _MAX_ATTACHED:
            _ATTACHED.popitem(last=False)
    _ATTACHED.move_to_end(ref)
    return a
