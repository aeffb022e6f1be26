"""Rate-limited logging for events a client (or a failing plug-in) can repeat at will."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class LogThrottle:
    """At most ``burst`` log lines per ``interval`` for one kind of event; the events
    beyond are only counted, and the next line (or :meth:`flush`) says how many.
    Why: one client writing bad entries in a loop wrote 65,815 INFO lines (8 MB), and
    clients connecting and leaving in a loop wrote two lines each (2.6 MB in 5 minutes
    of the fuzzer)."""
    interval: float
    burst: int = 1
    next_at: float = 0.0
    held: int = 0
    in_window: int = 0

    def admit(self) -> int | None:
        """None: stay quiet (the event is counted). Else log now; the value is the
        number of events held back since the last line."""
        now = time.monotonic()
        if now >= self.next_at:
            self.next_at, self.in_window = now + self.interval, 0
        if self.in_window >= self.burst:
            self.held += 1
            return None
        self.in_window += 1
        held, self.held = self.held, 0
        return held

    def flush(self) -> int:
        """Events held back and not yet reported (then forgotten)."""
        held, self.held = self.held, 0
        return held
