"""The simulator's clocks over the engine's event heap (``_engine.c``).

The engine keeps a heap of ``(time, sequence)``-ordered events: the sequence number
orders equal times by scheduling order, so a run is a pure function of its inputs and
seed. The virtual clock is stepped by its caller; the real-time clock differs only in
where "now" comes from: :meth:`RealTimeLoop.poll` fires every event that is due by the
wall clock.
"""
from __future__ import annotations

import time

INF = float("inf")


class EventLoop:
    """Virtual time: ``now`` moves only when the caller steps or runs the loop."""

    __slots__ = ("engine",)

    def __init__(self, engine) -> None:
        self.engine = engine

    @property
    def now(self) -> float:
        return self.engine.now

    def peek(self) -> float:
        """Time of the next event, or inf when nothing is scheduled."""
        return self.engine.peek()

    def step(self) -> None:
        self.engine.step()

    def run_until(self, t: float) -> bool:
        """Fire every event due at or before ``t``, then set the clock to ``t``; True if
        any of them wrote a notification or completed an op."""
        return self.engine.run_until(t)

    def run(self) -> None:
        """Run until no event is left."""
        self.engine.run()

    def sync(self) -> None:
        """Bring the clock up to date before the caller submits work (no-op here)."""


class RealTimeLoop(EventLoop):
    """Real time: the clock follows ``time.perf_counter()``, scaled by ``speed``.

    The caller (the dispatcher loop) calls :meth:`poll` every iteration; no thread or
    process of its own, so the simulator never competes for a core with the clients.
    """

    __slots__ = ("_t0", "speed")

    def __init__(self, engine, speed: float = 1.0) -> None:
        super().__init__(engine)
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self.speed = speed
        self._t0 = time.perf_counter()

    def wall(self) -> float:
        return (time.perf_counter() - self._t0) * self.speed

    def poll(self) -> None:
        """Fire every event due by the wall clock (one C call: ``perf_counter`` is
        ``CLOCK_MONOTONIC`` on Linux, which the engine reads itself)."""
        self.engine.poll_wall(self._t0, self.speed)

    sync = poll

    def seconds_until_next(self) -> float:
        """Wall seconds until the next event is due (0 if overdue, inf if none)."""
        nxt = self.engine.peek()
        if nxt == INF:
            return INF
        return max(0.0, (nxt - self.wall()) / self.speed)
