"""What reading a CPU clock costs the window it measures.

Charging a step's CPU time to a simulated clock (the experiments' ``cpu_scale``, the step
scheduler's host cost) brackets the step with two ``time.thread_time`` reads, a system
call each: the end of the first and the start of the second fall inside the window, on
every step measured (0.44 us here, about 1 us per Figure 2 job near its knee). That is
the meter's cost, not the measured code's, and whoever charges takes it out.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable


def clock_overhead(clock: Callable[[], float] = time.thread_time, n: int = 2000) -> float:
    """What a ``clock()`` pair adds to the window it brackets: the median of back-to-back
    calls. ``time.thread_time`` is a system call; the end of the first call and the start
    of the second fall inside the window (0.44 us here), on every step measured."""
    d = []
    for _ in range(n):
        c0 = clock()
        d.append(clock() - c0)
    return float(statistics.median(d))


__all__ = ["clock_overhead"]
