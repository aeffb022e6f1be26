"""Virtual streams to real streams (§5.2: "a carefully replaced stream identifier").

Three mappings, one per kind of policy:

* ``pool`` (Paella and the kernel-granularity policies): every released op takes a
  real stream that has nothing in flight, so two independent ops never share a real
  stream, and a released kernel never waits behind another in its stream's FIFO. When
  no stream is free the op waits in the dispatcher (:meth:`StreamMap.available` is
  False), not in a hardware queue. Free streams are reused least-recently-freed first,
  which spreads consecutive releases over the hardware queues.
* ``sticky`` (CUDA-MS, ``ms-jbj``): a virtual stream binds to one real stream, chosen
  round-robin over the pool at its first release, for its whole life, as a CUDA stream
  created per job would. Jobs beyond the pool size share streams, as on the GPU.
* ``single`` (CUDA-SS / Paella-SS, ``fifo``): everything goes to real stream 0.
"""
from __future__ import annotations

from collections import deque

from .ops import Op

MODES = ("pool", "sticky", "single")


class StreamMap:
    __slots__ = ("n", "mode", "free", "busy", "_rr")

    def __init__(self, n_streams: int, mode: str = "pool"):
        self.n = n_streams
        self.free: deque[int] = deque(range(n_streams))   # kept in pool mode only
        self.busy = [0] * n_streams          # ops in flight per real stream
        self._rr = 0
        self.set_mode(mode)

    def set_mode(self, mode: str) -> None:
        """Switch mapping (a policy fallback). Leaving pool mode abandons the free list;
        the only switch the dispatcher makes is to ``single``, which needs none."""
        if mode not in MODES:
            raise ValueError(f"unknown stream mode {mode!r}; use one of {', '.join(MODES)}")
        self.mode = mode

    def available(self) -> bool:
        """Can an op be released now without sharing a stream (pool mode)?"""
        return self.mode != "pool" or bool(self.free)

    def assign(self, op: Op) -> int:
        """Pick the real stream for ``op`` and count it in flight there."""
        mode = self.mode
        if mode == "pool":
            s = self.free.popleft()
        elif mode == "single":
            s = 0
        else:
            vs = op.vstream
            s = vs.real
            if s < 0:
                s = vs.real = self._rr
                self._rr = (self._rr + 1) % self.n
        self.busy[s] += 1
        op.stream = s
        return s

    def done(self, op: Op) -> None:
        """``op`` finished on its real stream."""
        s = op.stream
        self.busy[s] -= 1
        if self.busy[s] == 0 and self.mode == "pool":
            self.free.append(s)
