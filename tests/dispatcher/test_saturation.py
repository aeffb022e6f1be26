"""The saturation rule: past ``saturation_backlog`` jobs waiting for a release, the
occupancy gate (the +B rule, paella's order and hold rules) is lifted and only flow
control applies, on the dispatcher's own path and on both kernel cores alike (their
event-for-event agreement with the rule on is in test_kernel_core.py)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from paella.dispatcher import kernel_core as kc
from paella.dispatcher.adaptor import PlanAdaptor
from paella.dispatcher.core import MIN_SATURATION_BACKLOG, Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice

from paella.experiments.harness import adaptor_for
from paella.models.synthetic import chain_job

from test_kernel_core import arrivals


def wide_plan():
    """Four dependent kernels of 48 blocks x 256 threads, 50 us each: two of them fill
    the simulated GTX 1660 SUPER (22 SMs x 4 such blocks), so the gate holds some back."""
    return adaptor_for(chain_job("wide", 4, 48, 256, 32, 50e-6), 64, 64)().plan


def serve(backlog, policy="paella", kernel_core=None, n=60, gap=20e-6, classes=False):
    """``n`` jobs of :func:`wide_plan` arriving ``gap`` apart, at B = 0: (the most unplaced blocks the
    tracker held at any pass, the largest queue seen, the last completion's time)."""
    dev = SimDevice("gtx1660s", n_streams=64, notifq_slots=1 << 12, seed=1)
    d = Dispatcher(dev, policy, extra_blocks=0, profile_runs=1, kernel_core=kernel_core,
                   saturation_backlog=backlog)
    plan = wide_plan()
    mid = d.register_model(plan.name, PlanAdaptor(plan))
    m = d.models[mid]
    times = arrivals(n, 3, gap)
    done: dict[int, float] = {}
    t0, i, unplaced, queue = dev.now(), 0, 0, 0
    while i < n or d.in_flight or d.pending_arrivals:
        while i < n and t0 + times[i] <= dev.now():
            d.submit(Request(i, i % 4, mid, np.zeros(m.adaptor.io_bytes, np.uint8),
                             priority=(1 + i % 2) if classes else 0,
                             on_complete=lambda r, s, e: done.__setitem__(r.req_id, dev.now())))
            i += 1
        d.step()
        unplaced = max(unplaced, d.tracker.unplaced)
        queue = max(queue, d.core.queued if d.core is not None else d._queued)
        if d.idle and not d.pending_arrivals:
            dev.run_until(min(dev.next_event_time(), t0 + times[i] if i < n else np.inf))
    assert len(done) == n
    return unplaced, queue, max(done.values())


@pytest.mark.parametrize("kernel_core", (None, "python", "c"))
def test_past_the_backlog_the_gate_is_lifted(kernel_core):
    """At B = 0 the gate releases a kernel only when all of it can be placed: nothing
    waits unplaced. Past a backlog of 2 queued jobs, kernels go whenever flow control
    allows, and blocks wait in the hardware queues; with the rule off (0) or a backlog
    never reached, the gate holds as before."""
    gated, queue, t_gated = serve(0, kernel_core=kernel_core)
    assert queue > 2                          # the workload does queue past the backlog
    lifted, _, t_lifted = serve(2, kernel_core=kernel_core)
    assert lifted > gated + 100, (gated, lifted)
    never, _, t_never = serve(10 * queue, kernel_core=kernel_core)
    assert (never, t_never) == (gated, t_gated)
    # Here, where each job's kernels leave SMs idle between them, lifting it nearly
    # halves the time to serve the burst (12.4 -> 7.0 ms when written).
    assert t_lifted < 0.8 * t_gated, (t_lifted, t_gated)


@pytest.mark.parametrize("kernel_core", (None, "python", "c"))
@pytest.mark.parametrize("policy", ("paella", "priority"))
def test_with_two_classes_the_gate_stays(kernel_core, policy):
    """A more urgent class's bounded wait needs the gate: once jobs of two classes have
    been seen, the rule never fires (the same burst, alternate requests urgent)."""
    assert serve(2, policy, kernel_core, classes=True) == serve(0, policy, kernel_core,
                                                                  classes=True)


def test_the_property_says_when_the_rule_holds():
    dev = SimDevice("gtx1660s", n_streams=16, seed=1)
    d = Dispatcher(dev, "paella", profile_runs=1)
    # the default: half the SMs, at least 16 (the GTX 1660 SUPER has 22)
    assert d.saturation_backlog == max(MIN_SATURATION_BACKLOG, dev.props.sm_count // 2) == 16
    d._queued = d.saturation_backlog
    assert not d.saturated
    d._queued += 1
    assert d.saturated
    d.saturation_backlog = 0                                  # off
    assert not d.saturated
    d.saturation_backlog = 1
    d._saw_class(128)
    assert d.saturated
    d._saw_class(1)                                           # a second class: off for good
    assert not d.saturated
    d._queued = 0


@pytest.mark.parametrize("bad", (-1, 1.5, "8", True))
def test_a_bad_backlog_is_refused_naming_the_setting(bad):
    dev = SimDevice("gtx1660s", n_streams=16, seed=1)
    with pytest.raises(ValueError, match="saturation_backlog must be an int >= 0"):
        Dispatcher(dev, "paella", saturation_backlog=bad)


@pytest.mark.parametrize("impl", ("python", "c"))
def test_the_cores_refuse_a_negative_backlog(impl):
    dev = SimDevice("gtx1660s", n_streams=16, seed=1)
    d = Dispatcher(dev, "paella", profile_runs=1)
    with pytest.raises(ValueError, match="backlog must be >= 0"):
        kc.make_core(impl, d.tracker, dev, "paella", saturation_backlog=-1)
