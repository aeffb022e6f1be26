"""One virtual-time driver: the loop that steps a dispatcher on a simulated clock, for
the experiments, the benchmarks, the batchers' and the step scheduler's own drivers, and
the tests.

In virtual time nothing happens between two device events unless the loop makes it
happen, so the loop must never spin: when an iteration changed nothing, the clock jumps
to the next thing that can happen (a device event, an arrival, a front stage's
deadline), as trio's ``MockClock(autojump_threshold=0)`` jumps trio's own loop to its
next timer when every task is blocked. Every driver of this project is this one loop;
what differs between them is said by arguments, not by a copy of the loop:

* ``front``: work in front of the dispatcher (a batching stage, a DVABatch pipeline,
  the step scheduler) that holds requests, forms jobs from them and may want to be
  stepped at a time of its own (:class:`FrontStage`). It is stepped after the
  dispatcher, as the daemon's loop steps its batching stage.
* ``skip_unobserved``: True (the default) jumps over device events the dispatcher could
  not see (``device.run_until_observed``), which is exact for a policy that acts on what
  it observes (every built-in one: bit for bit the points of stepping at every event)
  and much faster. False steps at every device event, as a busy-polling loop would:
  needed where the step's CPU is charged to the clock (each idle poll is then part of
  what is measured) or for a plug-in policy that acts on time alone.
* ``charge``: the step's cost in virtual seconds (the harness's measured CPU times
  ``cpu_scale``, a benchmark's fixed cost per launch). It runs the step it is given and
  returns what it cost; the clock then moves by at least that much.
* ``on_stall``: what to try when work is left and nothing can ever happen (no device
  event, no arrival, no deadline); it returns True if it did something (a batching
  stage starts what it holds), else the driver raises :class:`RuntimeError`.

The driver reads only the dispatcher's public view (:class:`DispatcherView`) and the
virtual-time device's clock methods (:class:`VirtualDevice`).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

INF = float("inf")

#: ``charge(step)``: run ``step`` (one iteration's dispatcher and front stage steps) and
#: return the virtual seconds it cost.
Charge = Callable[[Callable[[], None]], float]


class VirtualDevice(Protocol):
    """The clock of a virtual-time device (the simulated GPU)."""

    def now(self) -> float: ...

    def next_event_time(self) -> float: ...

    def run_until(self, t: float) -> bool: ...

    def run_until_observed(self, t: float) -> bool: ...


class DispatcherView(Protocol):
    """What the driver reads of a :class:`~paella.dispatcher.core.Dispatcher`."""

    device: Any
    in_flight: int          # requests submitted and not finished
    idle: bool              # the last step changed nothing

    @property
    def pending_arrivals(self) -> int: ...

    def step(self) -> Any: ...


class FrontStage(Protocol):
    """Work in front of the dispatcher: it holds requests and submits jobs for them."""

    @property
    def busy(self) -> bool:
        """It holds work the dispatcher does not have yet (the drive goes on)."""
        ...

    def step(self) -> Any:
        """Do what is due at the device's current time (submit the jobs formed)."""
        ...

    def deadline(self) -> float | None:
        """The earliest device time it wants :meth:`step` called; None: none."""
        ...


class VirtualDriver:
    """Steps ``disp`` (and ``front``) in virtual time; see the module docstring."""

    def __init__(self, disp: DispatcherView, front: FrontStage | None = None, *,
                 skip_unobserved: bool = True, charge: Charge | None = None,
                 on_stall: Callable[[], bool] | None = None,
                 name: str = "virtual-time driver"):
        dev = disp.device
        if getattr(dev, "realtime", False) or not hasattr(dev, "run_until_observed"):
            raise ValueError(f"{name}: {type(dev).__name__} does not run in virtual time "
                             f"(a simulated GPU with realtime=False does)")
        if charge is not None and skip_unobserved:
            raise ValueError(f"{name}: a charged step needs skip_unobserved=False (the idle "
                             f"polls between device events are part of what is charged)")
        self.disp = disp
        self.device: VirtualDevice = dev
        self.front = front
        self.skip_unobserved = skip_unobserved
        self.charge = charge
        self.on_stall = on_stall
        self.name = name
        self._step = self._stepper()

    def run(self, arrivals: Sequence[float] = (), submit: Callable[[range], None] | None = None,
            until: Callable[[], bool] | None = None) -> bool:
        """Drive until nothing is left: every arrival submitted, nothing in flight, the
        front stage not busy. ``arrivals``: sorted device times; ``submit(due)`` gets the
        indices of those due at each instant (one call per instant, so that requests
        arriving together can be handled together). ``until()``, asked before each
        iteration, stops the drive early when it returns True. Returns False if
        ``until`` stopped it, True if everything finished."""
        disp, dev, front = self.disp, self.device, self.front
        n, i = len(arrivals), 0
        if n and submit is None:
            raise ValueError(f"{self.name}: arrivals without a submit callback")
        advance = self._jump_observed if self.skip_unobserved else self._jump_every_event
        left = self._left
        while i < n or left():
            if until is not None and until():
                return False
            now = dev.now()
            if i < n and arrivals[i] <= now:
                j = i + 1
                while j < n and arrivals[j] <= now:
                    j += 1
                submit(range(i, j))
                i = j
            cost = self._step()
            if i == n and not left():
                break                        # done: the clock stays where the work ended
            advance(now, cost, arrivals[i] if i < n else INF)
        return True

    def _left(self) -> bool:
        """Work the dispatcher or the front stage still has."""
        disp, front = self.disp, self.front
        return bool(disp.in_flight or disp.pending_arrivals or (front is not None and front.busy))

    def _stepper(self) -> Callable[[], float]:
        """One iteration's steps (the dispatcher, then the front stage), charged or not:
        built once, so the loop makes one call per iteration."""
        disp_step = self.disp.step
        front = self.front
        if front is None:
            step = disp_step
        else:
            front_step = front.step

            def step() -> None:
                disp_step()
                front_step()
        charge = self.charge
        if charge is None:
            def free() -> float:
                step()
                return 0.0
            return free
        return lambda: charge(step)

    def _deadline(self) -> float:
        d = self.front.deadline() if self.front is not None else None
        return INF if d is None else d

    def _jump_every_event(self, now: float, cost: float, next_arrival: float) -> None:
        """The clock moves by the step's cost; an idle dispatcher waits for (at least)
        the next device event, arrival or deadline."""
        disp, dev = self.disp, self.device
        t = now + cost
        if disp.idle and not disp.pending_arrivals:
            nxt = min(dev.next_event_time(), next_arrival, self._deadline())
            if disp.pending_arrivals:
                pass                         # the front stage's deadline() started work
            elif nxt == INF:
                self._stalled()
            else:
                t = max(t, nxt)
        dev.run_until(t)

    def _jump_observed(self, now: float, cost: float, next_arrival: float) -> None:
        """Fire what is due now; if the dispatcher can do nothing until the device shows
        something, skip to the first event it can observe, or to the next arrival or
        deadline, whichever comes first."""
        disp, dev = self.disp, self.device
        observed = dev.run_until(now)
        if disp.idle and not observed and not disp.pending_arrivals:
            limit = min(next_arrival, self._deadline())
            if disp.pending_arrivals:        # the front stage's deadline() started work
                return
            if limit > dev.now() and not dev.run_until_observed(limit) and limit == INF:
                self._stalled()

    def _stalled(self) -> None:
        """Nothing can ever happen again: fine if nothing is left, else ask ``on_stall``
        (which returns True if it made something happen), else raise."""
        disp, front = self.disp, self.front
        if not self._left() or (self.on_stall is not None and self.on_stall()):
            return
        raise RuntimeError(f"{self.name} stalled: {disp.in_flight} request(s) in flight"
                           f"{' and work held in front' if front is not None and front.busy else ''}, "
                           f"but no device event, arrival or deadline is left")
