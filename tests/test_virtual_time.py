"""The one virtual-time driver (dispatcher/virtual_time.py): what it submits and when,
where it moves the clock, how it stops, and that skipping unobserved device events gives
a built-in policy the same schedule as stepping at every event."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from paella.dispatcher.adaptor import PlanAdaptor, synthetic_plan
from paella.dispatcher.core import STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.virtual_time import VirtualDriver


class Clock:
    """A device with nothing on it: the clock moves only when told."""

    def __init__(self, events: tuple[float, ...] = ()):
        self.t = 0.0
        self.events = sorted(events)

    def now(self) -> float:
        return self.t

    def next_event_time(self) -> float:
        return self.events[0] if self.events else float("inf")

    def run_until(self, t: float) -> bool:
        fired = False
        while self.events and self.events[0] <= t:
            self.events.pop(0)
            fired = True
        if t != float("inf"):
            self.t = max(self.t, t)
        return fired

    def run_until_observed(self, t: float) -> bool:
        if self.events and self.events[0] <= t:
            self.t = self.events.pop(0)
            return True
        if t != float("inf"):
            self.t = t
        return False


class Idle:
    """A dispatcher that never does anything: its in-flight count is set by the test."""

    def __init__(self, device: Clock, in_flight: int = 0):
        self.device = device
        self.in_flight = in_flight
        self.idle = True
        self.pending_arrivals = 0
        self.steps = 0

    def step(self) -> bool:
        self.steps += 1
        return self.in_flight > 0


def test_arrivals_are_submitted_once_per_instant_at_their_time():
    dev = Clock()
    seen = []
    VirtualDriver(Idle(dev)).run([1.0, 1.0, 2.5, 4.0, 4.0, 4.0],
                                 lambda due: seen.append((dev.now(), list(due))))
    assert seen == [(1.0, [0, 1]), (2.5, [2]), (4.0, [3, 4, 5])]


def test_a_front_stages_deadline_stops_the_clock_and_its_busy_keeps_the_drive_going():
    dev = Clock()
    front = SimpleNamespace(busy=True, times=[], deadline=lambda: 3.0)

    def step():
        front.times.append(dev.now())
        if dev.now() >= 3.0:
            front.busy = False
    front.step = step
    assert VirtualDriver(Idle(dev), front).run() is True
    assert front.times == [0.0, 3.0] and dev.now() == 3.0


def test_a_charged_step_moves_the_clock_by_its_cost():
    dev = Clock()
    d = Idle(dev)
    times = []
    d.step = lambda: times.append(dev.now())
    d.idle = False                                  # (busy: no jump to the next event)
    VirtualDriver(d, skip_unobserved=False, charge=lambda step: (step(), 0.25)[1]).run(
        [0.0, 1.0], lambda due: None, until=lambda: dev.now() >= 1.0)
    assert times == [0.0, 0.25, 0.5, 0.75]


def test_until_stops_the_drive_early():
    dev = Clock(events=(1.0, 2.0, 3.0))
    d = Idle(dev, in_flight=1)
    assert VirtualDriver(d, skip_unobserved=False).run(until=lambda: dev.now() >= 2.0) is False
    assert dev.now() == 2.0 and d.in_flight == 1


def test_a_stall_raises_unless_on_stall_makes_something_happen():
    dev = Clock()
    with pytest.raises(RuntimeError, match="test driver stalled: 1 request.* in flight.*no device "
                                           "event, arrival or deadline"):
        VirtualDriver(Idle(dev, in_flight=1), name="test driver").run()
    d = Idle(dev, in_flight=1)

    def unstall() -> bool:
        d.in_flight = 0                             # (a stage starting what it held)
        return True
    for skip in (True, False):
        d.in_flight = 1
        assert VirtualDriver(d, skip_unobserved=skip, on_stall=unstall).run() is True


def test_it_refuses_what_it_cannot_drive():
    with pytest.raises(ValueError, match="does not run in virtual time"):
        VirtualDriver(Idle(SimpleNamespace(realtime=True, run_until_observed=None)))
    with pytest.raises(ValueError, match="charged step needs skip_unobserved=False"):
        VirtualDriver(Idle(Clock()), charge=lambda step: 0.0)


def _completions(skip: bool, policy: str) -> list[float]:
    """Lognormal-ish arrivals of two kernels' jobs on the simulated GPU; completion times."""
    dev = SimDevice("t4", n_streams=64, seed=3)
    d = Dispatcher(dev, policy, profile_runs=1)
    rows_a = [("a1", 1000, 128, 32, 40e-6), ("a2", 333, 256, 32, 25e-6)]
    rows_b = [("b1", 2100, 128, 64, 90e-6)]
    mids = [d.register_model(n, PlanAdaptor(synthetic_plan(n, rows, 256, 256)))
            for n, rows in (("a", rows_a), ("b", rows_b))]
    io = np.zeros(d.models[mids[0]].adaptor.io_bytes, np.uint8)      # (both: 256 B in, 256 out)
    arrivals = dev.now() + np.cumsum(np.random.default_rng(5).exponential(60e-6, 200))
    done = np.full(len(arrivals), np.nan)
    status = np.full(len(arrivals), -1)

    def complete(req, st, err):
        done[req.req_id], status[req.req_id] = dev.now(), st

    def submit(due: range) -> None:
        for i in due:
            d.submit(Request(i, i % 3, mids[i % 2], io, on_complete=complete))
    VirtualDriver(d, skip_unobserved=skip).run(arrivals, submit)
    assert not d.in_flight and (status == STATUS_OK).all()
    return done.tolist()


@pytest.mark.parametrize("policy", ["paella", "fifo"])
def test_skipping_unobserved_events_is_exact_for_a_built_in_policy(policy):
    assert _completions(True, policy) == _completions(False, policy)


def test_clock_overhead_is_what_a_pair_of_reads_adds():
    """A clock read that itself takes 3 ticks puts 3 into any window it brackets; the
    median of back-to-back pairs finds it (the harness and the step runtime subtract it)."""
    from paella.cpu_clock import clock_overhead
    t = [0.0]

    def clock() -> float:
        t[0] += 3.0
        return t[0]
    assert clock_overhead(clock, n=50) == 3.0
    import time
    assert 0.0 < clock_overhead(time.thread_time, n=200) < 1e-4

