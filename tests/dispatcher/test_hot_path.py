"""The hot path's shortcuts behave exactly like the general path they replace: plan
templates (no greenlet) against the PlanAdaptor's own run() in a greenlet, the
pair-indexed notifQ drain, the tracker's lazily flattened footprints."""
from __future__ import annotations

import numpy as np
import pytest

from paella.dispatcher.adaptor import Plan, PlanAdaptor, PlanOp
from paella.dispatcher.core import STATUS_CANCELLED, STATUS_ERROR, STATUS_OK
from paella.dispatcher.devices.base import KernelInfo
from paella.dispatcher.job import RUNNING
from paella.dispatcher.occupancy import Tracker
from paella.gpus import preset
from paella import protocol

from dispatch_helpers import Recorder, TwoStreams, chain


class GreenletPlan(PlanAdaptor):
    """The same plan, forced through the greenlet (an override of run())."""

    def run(self, io):
        super().run(io)


def fork_plan() -> Plan:
    """Two plan streams that join on the default stream: not a straight line."""
    ks = [KernelInfo(f"fp_{c}", 32, duration=30e-6) for c in "abc"]
    ops = [PlanOp("h2d", buffer="in", io_offset=0, nbytes=64),
           PlanOp("launch", stream=1, kernel="fp_a", grid=(12,), block=(128,)),
           PlanOp("launch", stream=2, kernel="fp_b", grid=(7,), block=(64,)),
           PlanOp("launch", kernel="fp_c", grid=(3,), block=(256,)),
           PlanOp("d2h", stream=1, buffer="out", io_offset=64, nbytes=32)]
    return Plan("forkplan", ks, ops, {"in": 64, "out": 32}, 96)


def timeline(make, policy, adaptors, n=30):
    """Run a mix; returns (status, t_done) per request and release times per kernel."""
    dev, d = make(policy)
    mids = [d.register_model(f"m{i}", a) for i, a in enumerate(adaptors)]
    rec = Recorder()
    for i in range(n):
        mid = mids[i % len(mids)]
        req = rec.request(i, mid, d.models[mid].adaptor.io_bytes, client=i % 3)
        d.submit(req)
        if i % 4 == 3:
            d.step()
            dev.run_until(dev.now() + 40e-6)
    d.run_until_idle()
    return {k: (v[0], v[2]) for k, v in rec.done.items()}, sorted(rec.almost), d


@pytest.mark.parametrize("policy", ["paella", "fifo", "ms-jbj", "ms-kbk"])
def test_plan_template_matches_the_greenlet_run(make, policy):
    plans = [lambda: chain("a", 4).plan, lambda: chain("b", 9, grid=30).plan, fork_plan]
    fast, fast_almost, d = timeline(make, policy, [PlanAdaptor(p()) for p in plans])
    assert all(m.template is not None for m in d.models)
    assert not d.models[2].template.straight and d.models[0].template.straight
    slow, slow_almost, d2 = timeline(make, policy, [GreenletPlan(p()) for p in plans])
    assert all(m.template is None for m in d2.models)
    assert fast == slow and fast_almost == slow_almost
    assert all(st == STATUS_OK for st, _ in fast.values())


def test_user_adaptors_keep_their_greenlet(make):
    dev, d = make("paella")
    mid = d.register_model("fork", TwoStreams())
    assert d.models[mid].template is None
    rec = Recorder()
    for i in range(5):
        d.submit(rec.request(i, mid, 64))
    d.run_until_idle()
    assert [rec.done[i][0] for i in range(5)] == [STATUS_OK] * 5


def test_plan_template_fails_a_short_io_buffer_like_run_does(make):
    dev, d = make("paella")
    mid = d.register_model("c", chain("c", 3))
    rec = Recorder()
    d.submit(rec.request(0, mid, 10))                 # the plan needs 256 + 64 bytes
    d.submit(rec.request(1, mid, 320))
    d.run_until_idle()
    assert rec.done[0][0] == STATUS_ERROR
    assert rec.done[0][1] == "ValueError: io buffer of 10 bytes is smaller than model 'c' needs (320)"
    assert rec.done[1][0] == STATUS_OK
    assert d.tracker.in_flight() == 0 and not d.jobs


def test_drain_refuses_an_entry_of_no_launch_in_flight_after_consuming_it():
    spec = preset("gtx1660s")
    ring = np.zeros(64, np.uint64)
    t = Tracker(spec, ring, extra_blocks=22, group=1, counter_pairs=8)
    ring[0] = protocol.encode(protocol.PLACEMENT, 0, 1, 5)
    with pytest.raises(RuntimeError, match="not in flight"):
        t.drain(0.0, lambda op: None)
    assert ring[0] == 0 and t.head == 1


def test_drain_applies_a_batch_and_reports_completions_in_order(make):
    """group 2, two kernels: every placement and completion is counted, and a stale
    launch id (same pair, older generation) is not mistaken for the live one."""
    from paella.dispatcher.waitlist import KERNEL, Op, VStream
    from paella.occupancy import footprint
    spec = preset("gtx1660s")
    ring = np.zeros(64, np.uint64)
    t = Tracker(spec, ring, extra_blocks=22, group=2, counter_pairs=2)
    ops = []
    for blocks in (2, 1):
        op = Op(KERNEL, None, VStream(0, True))
        op.fp, op.blocks = footprint(spec, 128, 32), blocks
        op.launch_id = -1
        t.release(op)
        ops.append(op)
    a, b = ops
    words = [(protocol.PLACEMENT, 3, 2, a), (protocol.PLACEMENT, 4, 1, b),
             (protocol.COMPLETION, 4, 1, b), (protocol.COMPLETION, 3, 1, a)]
    for i, (kind, sm, n, op) in enumerate(words):
        ring[i] = protocol.encode(kind, sm, n, op.launch_id)
    done = []
    assert t.drain(1.5, done.append) == 4
    assert done == [b] and a.placed == 2 and a.ended == 1 and a.t_first == 1.5
    assert t.blocks == 1 and t.sm_blocks[3] == 1 and t.sm_blocks[4] == 0
    assert t.unplaced == 0 and t.in_flight() == 1 and list(t.launches) == [a.launch_id]
    stale = (a.launch_id + (1 << 1)) & protocol.LAUNCH_MASK   # a's pair, another generation
    ring[4] = protocol.encode(protocol.COMPLETION, 3, 1, stale)
    with pytest.raises(RuntimeError, match="not in flight"):
        t.drain(2.0, done.append)


def test_a_straight_plan_makes_one_op_at_a_time(make):
    """Under a non-eager policy a straight-line plan is started lazily: each job holds
    only its active op; an eager policy gets the whole plan issued at once."""
    for policy, lazy in (("paella", True), ("ms-kbk", True), ("ms-jbj", False), ("fifo", False)):
        dev, d = make(policy)
        mid = d.register_model("c", chain("c", 6))
        rec = Recorder()
        for i in range(8):
            d.submit(rec.request(i, mid, 320))
        seen = 0
        while d.step() or d._arrivals:
            for job in d.jobs:
                if job.state == RUNNING and job.returned:      # started, not finished
                    seen += 1
                    assert (job.plan is not None) == lazy, policy
                    if lazy:
                        assert job.waitlist.pending == 1
            if d.idle:
                dev.run_until(dev.next_event_time())
        assert seen and sorted(rec.done) == list(range(8))
        assert all(v[0] == STATUS_OK for v in rec.done.values())


def test_cancelling_a_lazily_started_job_makes_no_further_step(make):
    dev, d = make("paella")
    mid = d.register_model("c", chain("c", 8))
    rec = Recorder()
    for i in range(6):
        d.submit(rec.request(i, mid, 320, client=i % 2))
    for _ in range(6):                    # a few kernels into every job
        d.step()
        dev.run_until(dev.next_event_time())
    victims = [j for j in d.jobs if j.client_id == 1]
    assert victims and all(j.plan is not None for j in victims)
    cursors = {j.req.req_id: j.cursor for j in victims}
    assert d.cancel_client(1) == 3
    d.run_until_idle()
    assert all(j.cursor == cursors[j.req.req_id] and j.plan is None for j in victims)
    assert {i for i, v in rec.done.items() if v[0] == STATUS_CANCELLED} == {1, 3, 5}
    assert {i for i, v in rec.done.items() if v[0] == STATUS_OK} == {0, 2, 4}
    assert d.tracker.in_flight() == 0 and not d.jobs and d._queued == 0
