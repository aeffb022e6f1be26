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

A held stream (``gated``: the simulated device holds a kernel there until its answer is
computed, issue 37) gets no new job in ``single`` mode and no new virtual stream in
``sticky`` mode: they go to the next stream without a gate, as in the kernel cores
(``kernel_core._ungated``), so one client's held kernel does not hold everyone. A job's
ops stay on one stream. (``pool`` never hands out a held stream: it is not free.)

Named streams (:meth:`StreamMap.pin`): a submitter may bind its jobs to a real stream
of their own, reserved under a name (DVABatch binds each stage executor to one, as the
paper does), in ``pool`` and ``sticky`` mode; ``single`` keeps everything on stream 0.
A pinned stream leaves the pool for good, so nobody else's op lands on it. At most half
of the streams are reserved; more names share the reserved ones round-robin (logged by
the caller), so the pool never runs dry.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from .ops import Op

MODES = ("pool", "sticky", "single")


def next_ungated(gated: Callable[[int], bool] | None, s: int, n: int) -> int:
    """``s``, or the next of the ``n`` streams after it for which ``gated`` is false (a
    device holding none: ``gated`` None; every stream held: ``s``, behind the first)."""
    if gated is None:
        return s
    for k in range(n):
        t = (s + k) % n
        if not gated(t):
            return t
    return s


def every_stream_gated(gated: Callable[[int], bool] | None, n: int) -> bool:
    """Whether each of the ``n`` streams holds a gate (False for a device holding none:
    ``gated`` None): a job that needs a stream of its own then waits (``must_wait``)."""
    return gated is not None and all(gated(t) for t in range(n))


class StreamMap:
    __slots__ = ("n", "mode", "free", "busy", "_rr", "pinned", "gated")

    def __init__(self, n_streams: int, mode: str = "pool"):
        self.n = n_streams
        self.free: deque[int] = deque(range(n_streams))   # kept in pool mode only
        self.busy = [0] * n_streams          # ops in flight per real stream
        self._rr = 0
        self.pinned: dict[str, int] = {}     # name -> its reserved real stream
        #: ``gated(s) -> bool``: the device holds a kernel in stream ``s`` (the real-time
        #: simulator's ``Gpu.stream_gated``); None: no device holds any.
        self.gated: Callable[[int], bool] | None = None
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

    def pin(self, name: str) -> tuple[int, bool]:
        """The real stream reserved for ``name`` (reserved now if it is new), and
        whether it is ``name``'s alone (False: the reservable half is used up and it
        shares one with another name).

        Trick (labelled): a reserved stream keeps one extra count in ``busy`` for good,
        so its count never falls to 0 and the dispatcher's inlined ``done`` never puts
        it back on the free list -- no test on the per-kernel path for it."""
        s = self.pinned.get(name)
        if s is not None:
            return s, list(self.pinned.values()).count(s) == 1
        own = set(self.pinned.values())
        if len(own) < self.n // 2:
            # the least recently freed stream not reserved yet (the free list's tail)
            candidates = [x for x in reversed(self.free) if x not in own] or \
                [x for x in range(self.n - 1, -1, -1) if x not in own]
            s = candidates[0]
            if s in self.free:
                self.free.remove(s)
            self.busy[s] += 1                # the sentinel count (see above)
            self.pinned[name] = s
            return s, True
        if not own:                          # a single-stream device: share stream 0
            self.pinned[name] = 0
            return 0, False
        shared = sorted(own)[len(self.pinned) % len(own)]
        self.pinned[name] = shared
        return shared, False

    def assign(self, op: Op, behind: Op | None = None) -> int:
        """Pick the real stream for ``op`` and count it in flight there. ``behind``: a
        released op ``op`` is queued behind (lookahead), whose stream it shares (the
        modes other than ``pool`` give it that stream anyway)."""
        mode = self.mode
        pin = op.job.pin if op.job is not None else -1
        if pin >= 0 and mode != "single":
            s = pin
        elif mode == "pool":
            s = behind.stream if behind is not None else self.free.popleft()
        elif mode == "single":
            s = 0
            job = op.job
            if self.gated is not None and job is not None:
                s = job.home
                if s < 0:
                    s = job.home = self.ungated(0)
        else:
            vs = op.vstream
            s = vs.real
            if s < 0:
                s = vs.real = self.ungated(self._rr)
                self._rr = (s + 1) % self.n
        self.busy[s] += 1
        op.stream = s
        return s

    def must_wait(self, op: Op) -> bool:
        """``op`` would take its job's first real stream (sticky: its virtual stream's)
        while every stream holds a gate, in the modes where jobs share streams (single,
        sticky): the dispatcher holds it until a stream has none, rather than queue it
        behind a gate that may hold for another client's answer (issue 37; the kernel
        cores' ``must_wait`` says why)."""
        gated, mode = self.gated, self.mode
        job = op.job
        if gated is None or mode == "pool" or job is None or (job.pin >= 0 and mode != "single"):
            return False
        if (job.home if mode == "single" else op.vstream.real) >= 0:
            return False
        return every_stream_gated(gated, self.n)

    def ungated(self, s: int) -> int:
        """``s``, or the next stream after it that holds no gate (:func:`next_ungated`)."""
        return next_ungated(self.gated, s, self.n)

    def done(self, op: Op) -> None:
        """``op`` finished on its real stream."""
        s = op.stream
        self.busy[s] -= 1
        if self.busy[s] == 0 and self.mode == "pool":
            self.free.append(s)
