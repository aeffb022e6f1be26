"""Plan events: ``record`` / ``wait`` steps order a multi-stream plan's streams when the
dispatcher replays it, and the plan computes what its single-stream form computes."""
from __future__ import annotations

import numpy as np
import pytest

from paella.bundle import BundleError, Op, Variant, check_variant, manifest_from_dict, Manifest
from paella.dispatcher.adaptor import BufferArg, Plan, PlanAdaptor, PlanOp
from paella.dispatcher.core import STATUS_OK, Request
from paella.dispatcher.devices.base import KernelInfo
from paella.dispatcher.instruments import Instrument

N = 256                                   # float32 elements per tensor
NB = N * 4


def _binary(fn):
    """A functional effect ``out = fn(a, b)`` on float32 buffers (args: a, b, out)."""
    def effect(view, args):
        a, b, out = (view(p, NB).view(np.float32) for p in args)
        out[:] = fn(a, b)
    return effect


#: (kernel, seconds, inputs, output, fn): x feeds a and b (independent), c joins them.
KERNELS = [("ev_a", 60e-6, ("x", "x"), "a", lambda x, _: x + 1),
           ("ev_b", 90e-6, ("x", "x"), "b", lambda x, _: 2 * x),
           ("ev_c", 30e-6, ("a", "b"), "c", lambda a, b: a * b)]


def event_plan(streams: bool, join: bool = True) -> Plan:
    """The diamond x -> {a, b} -> c. ``streams``: a on stream 1, b on stream 2, events
    for the cross-stream edges (x -> b, b -> c); else everything on stream 0. ``join``
    False drops the b -> c wait (a racy plan, to show the ordering check can fail)."""
    s1, s2 = (1, 2) if streams else (0, 0)
    launch = {k: PlanOp("launch", stream=s1 if k != "ev_b" else s2, kernel=k, grid=(40,),
                        block=(128,), args=(BufferArg(i0), BufferArg(i1), BufferArg(o)))
              for k, _, (i0, i1), o, _ in KERNELS}
    ops = [PlanOp("h2d", stream=s1, buffer="x", io_offset=0, nbytes=NB)]
    if streams:
        ops += [PlanOp("record", stream=1, event=0), PlanOp("wait", stream=2, event=0)]
    ops += [launch["ev_a"], launch["ev_b"]]
    if streams:
        ops.append(PlanOp("record", stream=2, event=1))
        if join:
            ops.append(PlanOp("wait", stream=1, event=1))
    ops += [launch["ev_c"], PlanOp("d2h", stream=s1, buffer="c", io_offset=NB, nbytes=NB)]
    kernels = [KernelInfo(k, 32, duration=t) for k, t, *_ in KERNELS]
    return Plan("diamond", kernels, ops, {b: NB for b in "xabc"}, 2 * NB,
                effects={k: _binary(fn) for k, _, _, _, fn in KERNELS})


class Times(Instrument):
    """Release and end time of every op, by kernel name (copies as "h2d" / "d2h")."""

    def __init__(self):
        self.released: dict[str, float] = {}
        self.ended: dict[str, float] = {}

    @staticmethod
    def key(op) -> str:
        return op.launch.name if op.launch is not None else ("h2d", "d2h")[op.kind - 1]

    def op_released(self, op, t):
        self.released[self.key(op)] = t

    def op_ended(self, op, t):
        self.ended[self.key(op)] = t


def serve(make, plan: Plan, x: np.ndarray):
    dev, d = make("paella", instruments=[times := Times()])
    mid = d.register_model("diamond", PlanAdaptor(plan))
    io = np.zeros(plan.io_bytes, np.uint8)
    io[:NB] = x.view(np.uint8)
    done = {}
    d.submit(Request(0, 0, mid, io, on_complete=lambda r, st, err: done.update(st=st, err=err)))
    d.run_until_idle()
    assert done == {"st": STATUS_OK, "err": None}
    return io[NB:].view(np.float32).copy(), times, d


def test_multi_stream_plan_is_ordered_by_its_events_and_equals_single_stream(make):
    x = np.random.default_rng(3).standard_normal(N).astype(np.float32)
    want = (x + 1) * (2 * x)
    single, t1, _ = serve(make, event_plan(streams=False), x)
    multi, tm, d = serve(make, event_plan(streams=True), x)
    assert d.models[0].replay.streams == (1, 2) and d.models[0].replay.n_events == 2
    np.testing.assert_array_equal(single, want)
    np.testing.assert_array_equal(multi, single)
    for t in (t1, tm):                   # every dependency edge: consumer after producer
        for prod, cons in [("h2d", "ev_a"), ("h2d", "ev_b"), ("ev_a", "ev_c"),
                           ("ev_b", "ev_c"), ("ev_c", "d2h")]:
            assert t.released[cons] >= t.ended[prod], (prod, cons)
    # The independent a and b overlap on two streams, and not on one.
    assert tm.released["ev_b"] < tm.ended["ev_a"]
    assert not t1.released["ev_b"] < t1.ended["ev_a"]
    assert tm.ended["d2h"] < t1.ended["d2h"]


def test_without_its_wait_the_join_races(make):
    """The check above has teeth: drop the b -> c wait and c is released before b ends."""
    x = np.ones(N, np.float32)
    _, t, _ = serve(make, event_plan(streams=True, join=False), x)
    assert t.released["ev_c"] < t.ended["ev_b"]


def _ops(*ops):
    kernels = [KernelInfo("k", 32, duration=1e-6)]
    return lambda: Plan("p", kernels, list(ops), {"x": 8}, 8)


@pytest.mark.parametrize("plan, message", [
    (_ops(PlanOp("wait", stream=1, event=3)), "waits for event 3, which no earlier op records"),
    (_ops(PlanOp("wait", stream=1, event=0), PlanOp("record", stream=2, event=0)),
     "which no earlier op records"),
    (_ops(PlanOp("launch", stream=-1, kernel="k")), "stream -1 is not a plan stream number"),
    (_ops(PlanOp("launch", stream=10**9, kernel="k")), "is not a plan stream number"),
    (_ops(PlanOp("record", stream=1, event=-2)), "event -2 is not a plan event number"),
    (_ops(PlanOp("launch", kernel="k", event=4)), "a launch op carries event 4"),
    (_ops(PlanOp("signal", stream=1)), "unknown kind 'signal'; use one of h2d, launch, d2h"),
])
def test_plan_refuses_bad_streams_and_events(plan, message):
    with pytest.raises(ValueError, match=message):
        plan()


def _variant(plan: list[Op]) -> Variant:
    from paella.bundle import BufferSpec
    return Variant("v", [], [], [BufferSpec(0, "x", 8, "input")], [], plan, 8)


def test_bundle_plans_carry_events_through_the_manifest():
    plan = [Op("h2d", stream=1, buffer=0, io_offset=0, nbytes=8), Op("record", stream=1, event=5),
            Op("wait", stream=2, event=5), Op("d2h", stream=2, buffer=0, io_offset=0, nbytes=8)]
    m = Manifest("m", "sm_70", False, 1, [_variant(plan)], {})
    back = manifest_from_dict(m.to_dict()).variants[0]
    check_variant(back)
    assert [(o.op, o.stream, o.event) for o in back.plan] == \
        [("h2d", 1, 0), ("record", 1, 5), ("wait", 2, 5), ("d2h", 2, 0)]
    with pytest.raises(BundleError, match="waits for event 5 before any record of it"):
        check_variant(_variant([plan[2], plan[1]]))
