"""The compiled replay (``dispatcher/_replay.c``) against the reference replay (the Python
waitlist): the same plans, requests and policy give the same dispatcher, op by op: every
hook in the same order, at the same virtual time, on the same real stream, with the
same launch id. Single-stream and multi-stream plans with events, random plans included,
eager and non-eager policies, lookahead off and on."""
from __future__ import annotations

import random

import numpy as np
import pytest

from paella.dispatcher import _replay
from paella.dispatcher.adaptor import Plan, PlanAdaptor, PlanOp
from paella.dispatcher.core import STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.base import KernelInfo
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.instruments import Instrument

from dispatch_helpers import chain
from test_plan_events import event_plan


class Trace(Instrument):
    """Every hook, with what identifies the op across the two paths."""

    def __init__(self):
        self.rows: list[tuple] = []

    @staticmethod
    def op(op) -> tuple:
        return (op.job.seq, op.kind, op.key, op.vstream.vid, op.stream, op.launch_id,
                op.almost_finished)

    def op_issued(self, op):
        self.rows.append(("issued", op.job.seq, op.kind, op.key, op.vstream.vid))

    def op_released(self, op, t):
        self.rows.append(("released", t, *self.op(op)))

    def op_started(self, op, t):
        self.rows.append(("started", t, *self.op(op)))

    def op_ended(self, op, t):
        self.rows.append(("ended", t, *self.op(op)))

    def request_finished(self, req):
        self.rows.append(("finished", req.req_id, req.status, req.t_done))


def random_plan(seed: int) -> Plan:
    """A random multi-stream plan: 3 streams, 14 kernels of random shapes, copies at
    both ends, records and waits on random events (a wait only after a record)."""
    rng = random.Random(seed)
    infos = [KernelInfo(f"r{seed}_k{i}", rng.choice((16, 32, 64)),
                        duration=rng.choice((20e-6, 50e-6, 90e-6))) for i in range(5)]
    ops = [PlanOp("h2d", stream=rng.randrange(3), buffer="x", io_offset=0, nbytes=64)]
    recorded: list[int] = []
    for _ in range(14):
        r = rng.random()
        s = rng.randrange(3)
        if r < 0.2:
            e = rng.randrange(4)
            ops.append(PlanOp("record", stream=s, event=e))
            recorded.append(e)
        elif r < 0.4 and recorded:
            ops.append(PlanOp("wait", stream=s, event=rng.choice(recorded)))
        ops.append(PlanOp("launch", stream=s, kernel=rng.choice(infos).name,
                          grid=(rng.choice((1, 8, 30, 90)),), block=(rng.choice((64, 256)),)))
    ops.append(PlanOp("d2h", stream=rng.randrange(3), buffer="x", io_offset=64, nbytes=64))
    return Plan(f"rand{seed}", infos, ops, {"x": 64}, 128)


def run(plans: list[Plan], policy: str, compiled: bool, lookahead: int, seed: int) -> list:
    dev = SimDevice("gtx1660s", n_streams=16, notifq_slots=1 << 12)
    trace = Trace()
    d = Dispatcher(dev, policy, profile_runs=1, lookahead=lookahead, compiled_replay=compiled,
                   instruments=[trace])
    mids = [d.register_model(p.name, PlanAdaptor(p)) for p in plans]
    rng = random.Random(seed)
    done = []
    t = dev.now()
    for i in range(24):
        t += rng.expovariate(1 / 60e-6)
        d.run_until_idle() if rng.random() < 0.1 else None
        dev.run_until(max(t, dev.now()))
        mid = rng.choice(mids)
        d.submit(Request(i, i % 3, mid, np.zeros(d.models[mid].adaptor.io_bytes, np.uint8),
                         on_complete=lambda r, st, err: done.append((r.req_id, st, err))))
        d.step()
    d.run_until_idle()
    assert sorted(done) == [(i, STATUS_OK, None) for i in range(24)]
    return trace.rows


@pytest.mark.parametrize("policy,lookahead", [("paella", 1), ("paella", 3), ("sjf", 2),
                                              ("fifo", 1), ("ms-jbj", 1), ("ms-kbk", 1)])
def test_compiled_replay_matches_the_reference_op_by_op(policy, lookahead):
    plans = [chain("c", 6).plan, event_plan(streams=True), random_plan(1), random_plan(2)]
    ref = run(plans, policy, False, lookahead, seed=5)
    got = run(plans, policy, True, lookahead, seed=5)
    assert any(r[0] == "released" and r[4] != 0 for r in ref)   # several plan streams ran
    assert got == ref


def test_random_multi_stream_plans_match_the_reference():
    for seed in range(3, 9):
        plans = [random_plan(seed), random_plan(seed + 100)]
        assert run(plans, "paella", True, 1, seed) == run(plans, "paella", False, 1, seed)


def test_a_compiled_job_drops_its_ops_when_done():
    """The run lets go of its ops once nothing pends (op -> job -> run -> ops would be a
    cycle, left to the cyclic gc, ~1 us per kernel): seen through the run's gc referents."""
    import gc
    dev = SimDevice("gtx1660s", n_streams=16)
    d = Dispatcher(dev, "paella", profile_runs=1)
    mid = d.register_model("diamond", PlanAdaptor(event_plan(streams=True)))
    req = Request(0, 0, mid, np.zeros(d.models[mid].adaptor.io_bytes, np.uint8))
    d.submit(req)
    d.step()
    job = next(iter(d.jobs))
    run_ = job.waitlist
    assert isinstance(run_, _replay.PlanRun) and run_.pending > 0
    held = [r for r in gc.get_referents(run_) if type(r) is tuple]
    assert len(held) == 1 and any(op is not None and op.job is job for op in held[0])
    d.run_until_idle()
    assert req.status == STATUS_OK and run_.pending == 0
    assert not [r for r in gc.get_referents(run_) if type(r) is tuple]


def test_the_graph_and_the_run_refuse_what_does_not_fit():
    g = _replay.PlanGraph([0, 0], [1, -1], [[], []], [0, 1], [0, 1], [1, 0], [0])
    with pytest.raises(ValueError, match="successor"):
        _replay.PlanGraph([0, 0], [0, -1], [[], []], [0, 1], [0, 1], [1, 0], [0])
    with pytest.raises(ValueError, match="dependent"):
        _replay.PlanGraph([0, 0], [-1, -1], [[5], []], [0, 1], [0, 1], [1, 0], [0])
    with pytest.raises(ValueError, match="ready node"):
        _replay.PlanGraph([0, 0], [1, -1], [[], []], [0, 1], [0, 1], [1, 0], [1])
    with pytest.raises(ValueError, match="2 nodes"):
        _replay.PlanGraph([0, 0], [1], [[], []], [0, 1], [0, 1], [1, 0], [0])
    with pytest.raises(ValueError, match="ops for a graph"):
        _replay.PlanRun(g, (object(),), print)
    with pytest.raises(ValueError, match="None"):
        _replay.PlanRun(_replay.PlanGraph([3], [-1], [[]], [1], [0], [0], []), (object(),), print)
    with pytest.raises(RuntimeError, match="not initialized"):
        _replay.PlanRun.__new__(_replay.PlanRun).finish(object())
    with pytest.raises(ValueError, match="never initialized"):
        _replay.PlanRun(_replay.PlanGraph.__new__(_replay.PlanGraph), (), print)

    class O:
        state = 0
        step = 1
    a, b = O(), O()
    a.step = 0
    r = _replay.PlanRun(g, (a, b), print)
    with pytest.raises(ValueError, match="not an op of this run"):
        r.finish(O())
