"""Stream-semantics scenarios: which ops are active at each point (CUDA programming
guide: in-order streams, the legacy default stream, non-blocking streams, events)."""
from __future__ import annotations

import numpy as np
import pytest

from paella.dispatcher.devices.base import D2H, KERNEL
from paella.dispatcher.instruments import Instrument
from paella.dispatcher.job import Job
from paella.dispatcher.ops import Op
from paella.dispatcher.replay import ReplayPlan
from paella.dispatcher.waitlist import Event, Waitlist

from dispatch_helpers import Recorder, chain


class Scenario:
    """A waitlist plus a log of activations, with ops named for readable asserts."""

    def __init__(self, eager: bool = False):
        self.active: list[str] = []
        self.wl = Waitlist(lambda op: self.active.append(op.key))
        self.wl.eager = eager
        self.ops: dict[str, Op] = {}

    def op(self, name: str, stream=None, kind: int = KERNEL) -> Op:
        op = Op(kind, None, stream or self.wl.default)
        op.key = name
        self.ops[name] = op
        return self.wl.issue(op)

    def finish(self, name: str) -> None:
        op = self.ops[name]
        assert op.key in self.active, f"{name} finished while not active"
        self.wl.finish(op)

    def record(self, event: Event, stream=None) -> None:
        event.marker = self.wl.record(stream or self.wl.default)

    def wait(self, stream, event: Event) -> None:
        self.wl.wait_event(stream or self.wl.default, event)


def test_one_stream_runs_in_order():
    s = Scenario()
    a = s.wl.create_stream()
    s.op("A", a), s.op("B", a), s.op("C", a)
    assert s.active == ["A"]
    s.finish("A")
    assert s.active == ["A", "B"]
    s.finish("B")
    assert s.active == ["A", "B", "C"]
    s.finish("C")
    assert s.wl.pending == 0 and a.idle()


def test_blocking_streams_are_independent_of_each_other():
    s = Scenario()
    a, b = s.wl.create_stream(), s.wl.create_stream()
    s.op("A1", a), s.op("B1", b), s.op("A2", a)
    assert s.active == ["A1", "B1"]


def test_default_stream_waits_for_blocking_streams_and_they_wait_for_it():
    s = Scenario()
    a, b = s.wl.create_stream(), s.wl.create_stream()
    s.op("A", a), s.op("B", b)
    s.op("D", None)                       # legacy stream 0: behind A and B
    s.op("A2", a)                         # blocking stream: behind D
    assert s.active == ["A", "B"]
    s.finish("A")
    assert s.active == ["A", "B"]         # D still waits for B
    s.finish("B")
    assert s.active == ["A", "B", "D"]
    s.finish("D")
    assert s.active == ["A", "B", "D", "A2"]


def test_non_blocking_stream_ignores_the_default_stream():
    s = Scenario()
    nb = s.wl.create_stream(non_blocking=True)
    a = s.wl.create_stream()
    s.op("D", None)
    s.op("N", nb)                         # not behind D
    s.op("A", a)                          # behind D
    s.op("N2", nb)
    s.op("D2", None)                      # behind A (blocking) but not behind N/N2
    assert s.active == ["D", "N"]
    s.finish("D")
    assert s.active == ["D", "N", "A"]
    s.finish("A")
    assert s.active == ["D", "N", "A", "D2"]


def test_event_orders_work_across_streams():
    s = Scenario()
    a, b = s.wl.create_stream(), s.wl.create_stream()
    e = Event()
    s.op("A", a)
    s.record(e, a)
    s.op("A2", a)                         # after the record: not covered by the event
    s.wait(b, e)
    s.op("B", b)
    assert s.active == ["A"] and not e.done()
    s.finish("A")
    assert e.done()
    assert s.active == ["A", "A2", "B"]   # B ran without waiting for A2


def test_wait_on_a_never_recorded_event_is_a_no_op():
    s = Scenario()
    b = s.wl.create_stream()
    e = Event()
    assert e.done()
    s.wait(b, e)
    s.op("B", b)
    assert s.active == ["B"]


@pytest.mark.parametrize("recorded", [False, True])
def test_wait_on_the_legacy_default_stream_is_a_barrier_even_with_nothing_to_wait_for(recorded):
    """cudaStreamWaitEvent on stream 0 is an operation of the legacy default stream: work
    issued to a blocking stream after it waits for every blocking stream's earlier work,
    whether the event completed long ago or was never recorded."""
    s = Scenario()
    a, b = s.wl.create_stream(), s.wl.create_stream()
    e = Event()
    if recorded:
        s.record(e, b)                    # recorded and completed at once (b is idle)
        assert e.done()
    s.op("A", a)
    s.wait(None, e)                       # on the default stream
    s.op("B", b)
    assert s.active == ["A"]              # B waits for the barrier, which waits for A
    s.finish("A")
    assert s.active == ["A", "B"]


def test_wait_on_a_non_blocking_stream_with_nothing_to_wait_for_adds_nothing():
    s = Scenario()
    a, nb = s.wl.create_stream(), s.wl.create_stream(non_blocking=True)
    e = Event()
    s.op("A", a)
    s.wait(nb, e)
    s.op("N", nb)
    assert s.active == ["A", "N"]
    assert s.wl.pending == 2              # no MARKER was issued


def test_wait_captures_the_record_current_at_the_call():
    s = Scenario()
    a, b = s.wl.create_stream(), s.wl.create_stream()
    e = Event()
    s.op("A", a)
    s.record(e, a)
    s.wait(b, e)                          # captures the record after A
    s.op("A2", a)
    s.record(e, a)                        # re-record: later waits would need A2
    s.op("B", b)
    s.finish("A")
    assert "B" in s.active and not e.done()


def test_event_on_default_stream_covers_blocking_streams():
    s = Scenario()
    a = s.wl.create_stream()
    e = Event()
    s.op("A", a)
    s.record(e)                           # on stream 0: implicitly behind A
    assert not e.done()
    s.finish("A")
    assert e.done()


def test_eager_release_activates_the_stream_successor_before_completion():
    s = Scenario(eager=True)
    a = s.wl.create_stream()
    s.op("A", a), s.op("B", a)
    assert s.active == ["A"]
    s.wl.released(s.ops["A"])
    assert s.active == ["A", "B"]         # the real stream keeps the order
    s.wl.finish(s.ops["A"])
    assert s.active == ["A", "B"]         # no double activation


def test_eager_marker_still_waits_for_completion():
    s = Scenario(eager=True)
    a = s.wl.create_stream()
    e = Event()
    s.op("A", a)
    s.record(e, a)
    s.wl.released(s.ops["A"])
    assert not e.done()
    s.wl.finish(s.ops["A"])
    assert e.done()


def test_destroyed_stream_rejects_new_work_and_drains():
    s = Scenario()
    a = s.wl.create_stream()
    s.op("A", a)
    s.wl.destroy_stream(a)
    with pytest.raises(ValueError, match="destroyed"):
        s.wl.check_stream(a)
    s.op("D", None)
    assert s.active == ["A"]              # pending work of a destroyed stream still counts
    s.finish("A")
    assert s.active == ["A", "D"]
    assert a not in s.wl.blocking


def test_default_stream_cannot_be_destroyed():
    s = Scenario()
    with pytest.raises(ValueError, match="default stream"):
        s.wl.destroy_stream(s.wl.default)


def test_drop_unreleased_keeps_released_ops():
    s = Scenario()
    a = s.wl.create_stream()
    s.op("A", a), s.op("B", a), s.op("C", None, kind=D2H)
    s.wl.released(s.ops["A"])
    ready = s.wl.drop_unreleased()
    assert ready == []                    # A is released; B and C waited
    assert s.wl.pending == 1
    s.wl.finish(s.ops["A"])
    assert s.wl.pending == 0 and s.active == ["A"]


def test_finished_ops_keep_no_link_back():
    """No reference cycle outlives the work: a finished op drops its predecessor and
    its stream's ``last`` (both mean "nothing to wait for"), so finished jobs and ops
    are freed by reference counting rather than by the cyclic gc."""
    s = Scenario()
    a = s.wl.create_stream()
    e = Event()
    s.op("A", a), s.record(e, a), s.op("B", a), s.wait(s.wl.default, e), s.op("C", None)
    for name in ("A", "B", "C"):
        s.finish(name)
    assert s.wl.pending == 0 and a.last is None and s.wl.default.last is None
    assert all(op.pred is None for op in s.ops.values()) and e.done()
    s.op("D", a)                          # an idle stream: D has nothing to wait for
    assert s.active[-1] == "D" and s.ops["D"].pred is None


@pytest.mark.parametrize("compiled", [False, True])
def test_replayed_plan_ops_equal_the_ops_of_the_same_calls(make, compiled):
    """A replayed plan issues, step by step, the op the job API would make for the same
    call (launch record, bound arguments, io views, the wake-up mark, its state after
    the issue): checked through the op_issued instrument. The compiled replay keeps the
    dependency counts in C (``deps`` is the reference waitlist's own)."""
    dev, d = make("paella")
    mid = d.register_model("c", chain("c", 3))
    model = d.models[mid]
    model.replay = ReplayPlan(model.adaptor.plan, model.adaptor.funcs, d.kernel_launch,
                              compiled=compiled)

    class Issued(Instrument):
        def __init__(self):
            self.ops = []

        def op_issued(self, op):
            self.ops.append(op)

    seen = Issued()
    d.instruments.add(seen)
    rec = Recorder()
    req = rec.request(0, mid, model.adaptor.io_bytes)
    job = Job(d, model, [req], req.io, 1)
    job.bindings = model.pool.acquire()
    model.replay.issue(job)
    d.instruments.remove(seen)
    ref = Job(d, model, [req], req.io, 2)
    bound, io = job.bindings.bound, req.io
    plan = model.adaptor.plan
    mine = []
    for i, pop in enumerate(plan.ops):
        if i == model.replay.steps.index(next(s for s in model.replay.steps if s.almost_finished)):
            ref.almost_finished()
        if pop.kind == "launch":
            mine.append(ref.launch(model.adaptor.funcs[pop.kernel], pop.grid, pop.block,
                                   dyn_smem=pop.dyn_smem, args=bound[i]))
        elif pop.kind == "h2d":
            mine.append(ref.memcpy_htod(bound[i], io[pop.io_offset:pop.io_offset + pop.nbytes]))
        else:
            mine.append(ref.memcpy_dtoh(io[pop.io_offset:pop.io_offset + pop.nbytes], bound[i]))
    assert len(seen.ops) == len(mine) == 5
    for a, b in zip(seen.ops, mine):
        for slot in ("kind", "launch", "key", "args", "dptr", "almost_finished", "state",
                     *(() if compiled else ("deps",))):
            assert getattr(a, slot) == getattr(b, slot), slot
        assert (a.host is None) == (b.host is None)
        if a.host is not None:
            assert np.shares_memory(a.host, b.host) and a.host.shape == b.host.shape
    assert sum(op.kind == KERNEL for op in seen.ops) == 3
    assert sum(op.kind == D2H for op in seen.ops) == 1
    assert [op.almost_finished for op in seen.ops] == [False, False, False, False, True]
