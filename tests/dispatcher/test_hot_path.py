"""The hot path behaves exactly like the general path: a replayed plan (no greenlet)
against the same calls made through the job API in a greenlet, and the pair-indexed
notifQ drain."""
from __future__ import annotations

import numpy as np
import pytest

from paella.dispatcher import cudart
from paella.dispatcher.adaptor import JobAdaptor, Plan, PlanAdaptor, PlanOp
from paella.dispatcher.core import STATUS_CANCELLED, STATUS_ERROR, STATUS_OK
from paella.dispatcher.devices.base import KernelInfo
from paella.dispatcher.instruments import Instrument
from paella.dispatcher.job import current
from paella.dispatcher.tracker import Tracker
from paella.gpus import preset
from paella import protocol

from dispatch_helpers import Recorder, TwoStreams, chain


class PlanByHand(JobAdaptor):
    """The same plan's calls made by code through the job API, in a greenlet: the
    reference that replay must equal."""

    def __init__(self, plan: Plan):
        self.inner = PlanAdaptor(plan)
        self.name, self.io_bytes = plan.name, plan.io_bytes

    def init(self, device):
        self.inner.init(device)
        self.buffer_pool = self.inner.buffer_pool

    def run(self, io):
        plan, funcs = self.inner.plan, self.inner.funcs
        if io.size < self.io_bytes:
            raise ValueError(f"io buffer of {io.size} bytes is smaller than model "
                             f"{self.name!r} needs ({self.io_bytes})")
        bound = current().bindings.bound
        streams = {0: None}
        for s in sorted({op.stream for op in plan.ops if op.stream}):
            streams[s] = cudart.stream_create()
        kinds = [op.kind for op in plan.ops]
        almost = max((i for i, k in enumerate(kinds) if k == "d2h"), default=-1)
        for i, op in enumerate(plan.ops):
            if i == almost:
                cudart.almost_finished()
            s = streams[op.stream]
            if op.kind == "launch":
                cudart.launch(funcs[op.kernel], op.grid, op.block, s, dyn_smem=op.dyn_smem,
                              args=bound[i])
            elif op.kind == "h2d":
                cudart.memcpy_htod(bound[i], io[op.io_offset:op.io_offset + op.nbytes], s)
            else:
                cudart.memcpy_dtoh(io[op.io_offset:op.io_offset + op.nbytes], bound[i], s)
        cudart.device_synchronize()


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
def test_replay_matches_the_same_calls_in_a_greenlet(make, policy):
    plans = [lambda: chain("a", 4).plan, lambda: chain("b", 9, grid=30).plan, fork_plan]
    fast, fast_almost, d = timeline(make, policy, [PlanAdaptor(p()) for p in plans])
    assert all(m.replay is not None for m in d.models.values())
    assert d.models[2].replay.streams == (1, 2) and d.models[0].replay.streams == ()
    slow, slow_almost, d2 = timeline(make, policy, [PlanByHand(p()) for p in plans])
    assert all(m.replay is None for m in d2.models.values())
    assert fast == slow and fast_almost == slow_almost
    assert all(st == STATUS_OK for st, _ in fast.values())


def test_user_adaptors_keep_their_greenlet(make):
    dev, d = make("paella")
    mid = d.register_model("fork", TwoStreams())
    assert d.models[mid].replay is None
    rec = Recorder()
    for i in range(5):
        d.submit(rec.request(i, mid, 64))
    d.run_until_idle()
    assert [rec.done[i][0] for i in range(5)] == [STATUS_OK] * 5


def test_replay_fails_a_short_io_buffer(make):
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
        t.drain(0.0, lambda op, t0: None)
    assert ring[0] == 0 and t.head == 1


def test_drain_applies_a_batch_and_reports_completions_in_order(make):
    """group 2, two kernels: every placement and completion is counted, and a stale
    launch id (same pair, older generation) is not mistaken for the live one."""
    from paella.occupancy import footprint
    spec = preset("gtx1660s")
    ring = np.zeros(64, np.uint64)
    t = Tracker(spec, ring, extra_blocks=22, group=2, counter_pairs=2)
    fp = footprint(spec, 128, 32)
    lids = {}
    for name, blocks in (("a", 2), ("b", 1)):
        lids[name] = t.release(t.demand(fp, blocks), name)
    a, b = lids["a"], lids["b"]
    words = [(protocol.PLACEMENT, 3, 2, a), (protocol.PLACEMENT, 4, 1, b),
             (protocol.COMPLETION, 4, 1, b), (protocol.COMPLETION, 3, 1, a)]
    for i, (kind, sm, n, lid) in enumerate(words):
        ring[i] = protocol.encode(kind, sm, n, lid)
    done = []
    assert t.drain(1.5, lambda tok, t0: done.append(tok)) == 4
    assert done == ["b"] and t.progress(a) == (2, 1, 1.5)
    assert t.blocks == 1 and t.sm_blocks[3] == 1 and t.sm_blocks[4] == 0
    assert t.unplaced == 0 and t.in_flight() == 1 and list(t.launches) == [a]
    stale = (a + (1 << 1)) & protocol.LAUNCH_MASK   # a's pair, another generation
    ring[4] = protocol.encode(protocol.COMPLETION, 3, 1, stale)
    with pytest.raises(RuntimeError, match="not in flight"):
        t.drain(2.0, lambda tok, t0: done.append(tok))


def test_cancelling_a_replayed_job_drops_its_unreleased_steps(make):
    dev, d = make("paella")
    mid = d.register_model("c", chain("c", 8))
    rec = Recorder()
    for i in range(6):
        d.submit(rec.request(i, mid, 320, client=i % 2))
    for _ in range(6):                    # a few kernels into every job
        d.step()
        dev.run_until(dev.next_event_time())
    victims = [j for j in d.jobs if j.client_id == 1]
    assert victims and all(j.waitlist.pending > 1 for j in victims)   # steps left to go
    released = []

    class Releases(Instrument):
        def op_released(self, op, t):
            released.append(op.job)

    d.instruments.add(Releases())
    assert d.cancel_client(1) == 3
    d.run_until_idle()
    assert not any(job in victims for job in released)        # nothing more of theirs ran
    assert {i for i, v in rec.done.items() if v[0] == STATUS_CANCELLED} == {1, 3, 5}
    assert {i for i, v in rec.done.items() if v[0] == STATUS_OK} == {0, 2, 4}
    assert d.tracker.in_flight() == 0 and not d.jobs and d._queued == 0
