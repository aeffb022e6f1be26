"""Named streams: ``Dispatcher.stream_named`` reserves a real stream per name, taken out
of the pool for good; at most half the streams are reserved, more names share them."""
from __future__ import annotations

import numpy as np

from paella.dispatcher.adaptor import PlanAdaptor, synthetic_plan
from paella.dispatcher.core import Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.streams import StreamMap


def test_pin_reserves_half_the_streams_then_shares():
    m = StreamMap(4, "pool")
    a, own_a = m.pin("a")
    b, own_b = m.pin("b")
    assert own_a and own_b and a != b
    assert a not in m.free and b not in m.free and len(m.free) == 2
    c, own_c = m.pin("c")                    # the reservable half (2 of 4) is used up
    assert not own_c and c in (a, b)
    assert m.pin("a") == (a, True)           # the same name, the same stream
    assert m.pin("c")[0] == c


def test_a_pinned_job_runs_every_op_on_its_stream_and_the_stream_stays_reserved():
    dev = SimDevice("t4", n_streams=8, seed=1)
    streams = []

    from paella.dispatcher.instruments import Instrument

    class Rec(Instrument):
        def op_released(self, op, t):
            streams.append((op.job.requests[0].req_id, op.stream))
    disp = Dispatcher(dev, "paella", profile_runs=0, instruments=[Rec()])
    mid = disp.register_model("m", PlanAdaptor(synthetic_plan(
        "m", [("k", 40, 128, 16, 0.1e-3)] * 4)), profile_runs=0)
    s = disp.stream_named("stage0")
    done = []
    for i in range(6):
        req = Request(i, 1, mid, np.zeros(1, np.uint8),
                      on_complete=lambda r, st, err: done.append((r.req_id, st)))
        disp.submit_group([req], req.io, stream="stage0" if i % 2 == 0 else None)
    disp.run_until_idle()
    assert sorted(done) == [(i, 0) for i in range(6)]
    assert {st for rid, st in streams if rid % 2 == 0} == {s}
    assert s not in {st for rid, st in streams if rid % 2 == 1}
    assert s not in disp.streams.free         # never handed back to the pool
