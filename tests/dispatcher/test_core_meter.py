"""The kernel core's meter (``core.meter``, ``core.metered``): the time inside its two
entry points, ``step`` and ``admit``, apart from the loop that calls them (the kernel
core benchmark's "alone" figure). What must hold, on both cores: metering changes no
event; it counts every entry-point call and only while on; switching it on starts
afresh; off, the count stays readable and stops growing."""
from __future__ import annotations

import numpy as np
import pytest

from paella.benchmarks import bench_kernel_core as bench
from paella.dispatcher import kernel_core as kc


class _Counting:
    """The core, its entry points counted (the meter must count the same calls)."""

    def __init__(self, core):
        self.core, self.calls, self.events = core, 0, []

    def __getattr__(self, name):
        return getattr(self.core, name)

    def admit(self, *args):
        self.calls += 1
        return self.core.admit(*args)

    def step(self, now):
        self.calls += 1
        ev = self.core.step(now)
        self.events.extend(ev or ())
        return ev


def _run(impl: str, meter: bool, jobs: int = 40) -> tuple[_Counting, list]:
    dev, core, m, cm, _ = bench.setup("single", impl)
    core.meter = meter
    counting = _Counting(core)
    bench.drive(dev, counting, m, cm, jobs)
    return counting, [tuple(e) for e in counting.events]


@pytest.mark.parametrize("impl", ["c", "python"])
def test_metering_counts_every_entry_call_and_changes_no_event(impl):
    plain, events = _run(impl, meter=False)
    assert plain.core.metered == (0.0, 0)
    metered, metered_events = _run(impl, meter=True)
    assert metered_events == events
    assert sum(1 for e in events if e[0] == kc.FINISHED) == 40
    seconds, calls = metered.core.metered
    assert calls == metered.calls
    assert 0.0 < seconds < 5.0


@pytest.mark.parametrize("impl", ["c", "python"])
def test_the_meter_stops_when_off_and_starts_afresh_when_on(impl):
    counting, _ = _run(impl, meter=True, jobs=5)
    core = counting.core
    core.meter = False
    assert core.meter is False
    stopped = core.metered
    assert core.step(1.0) is None and core.metered == stopped
    core.meter = True
    assert core.meter is True and core.metered == (0.0, 0)
    core.step(1.0)
    assert core.metered[1] == 1


def test_the_c_meter_cannot_be_deleted():
    dev, core, *_ = bench.setup("single", "c")
    with pytest.raises(TypeError, match="meter cannot be deleted"):
        del core.meter


def test_the_c_step_takes_a_time_of_any_real_type_and_refuses_what_is_not_one():
    # The C entry point reads an exact float without the conversion's error test; an
    # int or a numpy float still converts, and a string is refused, not read as -1.
    dev, core, *_ = bench.setup("single", "c")
    assert core.step(0) is None
    assert core.step(np.float64(0.5)) is None
    with pytest.raises(TypeError):
        core.step("soon")
