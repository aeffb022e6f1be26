"""The simulator's discrete-event loop (after SimPy's core).

A heap of ``(time, seq, callback, arg)``: the ``seq`` tiebreak orders equal times by
scheduling order, so a run is a pure function of its inputs and seed. ``step()`` fires
one event; the virtual loop is stepped by its caller, and the real-time loop differs
only in where "now" comes from: :meth:`RealTimeLoop.poll` runs every event that is due
by the wall clock.
"""
from __future__ import annotations

import heapq
import itertools
import time
from typing import Any, Callable

INF = float("inf")


class EventLoop:
    """Virtual time: ``now`` moves only when the caller steps or runs the loop."""

    __slots__ = ("now", "_heap", "_seq")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        if t < self.now:
            raise ValueError(f"cannot schedule an event in the past ({t} < now {self.now})")
        heapq.heappush(self._heap, (t, next(self._seq), fn, arg))

    def peek(self) -> float:
        """Time of the next event, or inf when nothing is scheduled."""
        return self._heap[0][0] if self._heap else INF

    def step(self) -> None:
        t, _, fn, arg = heapq.heappop(self._heap)
        self.now = t
        fn(arg)

    def run_until(self, t: float) -> None:
        """Fire every event due at or before ``t``, then set the clock to ``t``."""
        if t < self.now:
            raise ValueError(f"time cannot go backwards ({t} < now {self.now})")
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= t:
            # self.step(), inlined (the loop's hot path)
            self.now, _, fn, arg = pop(heap)
            fn(arg)
        self.now = t

    def run(self) -> None:
        """Run until no event is left."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            self.now, _, fn, arg = pop(heap)
            fn(arg)

    def sync(self) -> None:
        """Bring the clock up to date before the caller submits work (no-op here)."""


class RealTimeLoop(EventLoop):
    """Real time: the clock follows ``time.perf_counter()``, scaled by ``speed``.

    The caller (the dispatcher loop) calls :meth:`poll` every iteration; no thread or
    process of its own, so the simulator never competes for a core with the clients.
    """

    __slots__ = ("_t0", "speed")

    def __init__(self, speed: float = 1.0) -> None:
        super().__init__()
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self.speed = speed
        self._t0 = time.perf_counter()

    def wall(self) -> float:
        return (time.perf_counter() - self._t0) * self.speed

    def poll(self) -> None:
        self.run_until(max(self.wall(), self.now))

    sync = poll

    def seconds_until_next(self) -> float:
        """Wall seconds until the next event is due (0 if overdue, inf if none)."""
        nxt = self.peek()
        if nxt == INF:
            return INF
        return max(0.0, (nxt - self.wall()) / self.speed)
