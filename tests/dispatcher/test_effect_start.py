"""A model effect in two parts (``model_effects``, ``Plan.with_effect(start=...)``): the
start goes on the first kernel after every input copy that precedes the last kernel, and
each request's end receives what its own start began, even with requests in flight
together."""
from __future__ import annotations

import numpy as np

from paella.dispatcher.adaptor import BufferArg, Plan, PlanAdaptor, PlanOp
from paella.dispatcher.core import STATUS_OK, Request
from paella.dispatcher.devices.base import KernelInfo
from paella.dispatcher.devices.sim.functional import MAX_STARTED, model_effects

N = 64
NB = 4 * N


class T:
    """A tensor as model_effects reads it."""

    def __init__(self, name):
        self.name, self.shape, self.dtype, self.nbytes = name, (N,), "float32", NB


def launch(kernel, stream=0, args=("x", "a")):
    return PlanOp("launch", stream=stream, kernel=kernel, grid=(4,), block=(64,),
                  args=tuple(BufferArg(b) for b in args))


def plan_of(ops, kernels=("k1", "k2", "k3")) -> Plan:
    return Plan("p", [KernelInfo(k, 16, duration=d) for k, d in zip(kernels, (30e-6, 20e-6, 10e-6))],
                ops, {b: NB for b in "xay"}, 2 * NB)


def chain() -> list[PlanOp]:
    return [PlanOp("h2d", buffer="x", io_offset=0, nbytes=NB), launch("k1"), launch("k2"),
            launch("k3", args=("a",)), PlanOp("d2h", buffer="y", io_offset=NB, nbytes=NB)]


def effects(log):
    def begin(inputs):
        log.append(("begin", inputs["x"].copy()))
        return inputs["x"].copy()

    def compute(inputs, started):
        log.append(("compute", started))
        return {"y": inputs["x"] * 2}
    return model_effects([T("x")], [T("y")], begin, compute, own_args=1)


def test_the_start_goes_on_the_first_kernel_after_the_input_copies():
    end, make_start = effects([])
    ops_in, ops_out = [BufferArg("x")], [BufferArg("x"), BufferArg("y")]
    p = plan_of(chain()).with_effect(end, ops_out, make_start, ops_in)
    launches = [op for op in p.ops if op.kind == "launch"]
    assert set(p.effects) == {"k1", "k3"}
    assert launches[0].args[-1] == BufferArg("x") and len(launches[0].args) == 3
    assert len(launches[1].args) == 2 and len(launches[2].args) == 3
    # A first kernel before the input copy: the next one. On another stream, not ordered
    # before the last kernel: not that one either. (Streams 1 and 2: the legacy default
    # stream 0 would order them.)
    ops = chain()
    ops[:2] = [ops[1], ops[0]]
    p = plan_of(ops).with_effect(end, ops_out, make_start, ops_in)
    assert set(p.effects) == {"k2", "k3"}
    ops = [PlanOp("h2d", stream=1, buffer="x", io_offset=0, nbytes=NB), launch("k1", stream=2),
           launch("k2", stream=1), launch("k3", stream=1, args=("a",)),
           PlanOp("d2h", stream=1, buffer="y", io_offset=NB, nbytes=NB)]
    p = plan_of(ops).with_effect(end, ops_out, make_start, ops_in)
    assert set(p.effects) == {"k2", "k3"}
    # The last kernel's own kernel cannot carry both.
    ops = chain()
    ops[1] = launch("k3", args=("a",))
    p = plan_of(ops).with_effect(end, ops_out, make_start, ops_in)
    assert set(p.effects) == {"k2", "k3"} and p.effects["k3"] is end
    # One launch: no start.
    ops = [chain()[0], launch("k1"), chain()[-1]]
    p = plan_of(ops).with_effect(end, ops_out, make_start, ops_in)
    assert set(p.effects) == {"k1"}


def test_each_request_ends_with_what_its_own_start_began(make):
    log = []
    end, make_start = effects(log)
    plan = plan_of(chain()).with_effect(end, [BufferArg("x"), BufferArg("y")], make_start,
                                        [BufferArg("x")])
    _, d = make("paella")
    mid = d.register_model("m", PlanAdaptor(plan))
    log.clear()                                        # (the profiling runs)
    ios, done = [], []
    for i in range(4):                                 # in flight together
        io = np.zeros(2 * NB, np.uint8)
        io[:NB] = np.full(N, i + 1, np.float32).view(np.uint8)
        ios.append(io)
        d.submit(Request(i, 0, mid, io, on_complete=lambda r, st, err: done.append(st)))
    d.run_until_idle()
    assert done == [STATUS_OK] * 4
    for i, io in enumerate(ios):
        np.testing.assert_array_equal(io[NB:].view(np.float32), np.full(N, 2.0 * (i + 1)))
    begun = [x for kind, x in log if kind == "begin"]
    ended = [x for kind, x in log if kind == "compute"]
    assert len(begun) == len(ended) == 4
    assert sorted(float(x[0]) for x in ended) == [1.0, 2.0, 3.0, 4.0]


def test_an_end_without_its_start_gets_none_and_starts_stay_bounded():
    log = []
    end, make_start = effects(log)
    start = make_start(1)
    mem = {p: np.zeros(NB, np.uint8) for p in range(0, 2 * (MAX_STARTED + 10), 2)}

    def view(p, n):
        return mem[p][:n]
    end(view, (0, 0, 2))                               # nothing started: None
    assert log[-1] == ("compute", None)
    start(view, (0,))                                  # its own argument only: no effect
    assert len(log) == 1
    for p in range(0, 2 * (MAX_STARTED + 10), 2):      # never collected (cancelled requests)
        start(view, (0, p))
    end(view, (0, 0, 2))                               # the oldest were dropped
    assert log[-1] == ("compute", None)
    end(view, (0, 2 * (MAX_STARTED + 9), 2))
    assert log[-1][0] == "compute" and log[-1][1] is not None


def test_a_thousand_requests_in_flight_each_end_with_their_own_start():
    # A flood of a tiny model puts hundreds of requests between their two kernels at
    # once; an entry dropped for a live request left its last kernel waiting for a start
    # that had run already (never answered: the fuzzer, session 29, with a bound of 256).
    log = []
    end, make_start = effects(log)
    start = make_start(1)
    mem = {p: np.full(N, p, np.float32).view(np.uint8) for p in range(0, 2000, 2)}

    def view(p, n):
        return mem[p][:n]
    for p in mem:
        start(view, (0, p))
    for p in mem:
        end(view, (0, p, p + 1 if p + 1 in mem else p))
    ended = [x for kind, x in log if kind == "compute"]
    assert len(ended) == len(mem) and all(x is not None for x in ended)
    assert [float(x[0]) for x in ended] == [float(p) for p in mem]


def test_an_owner_hook_names_whose_computation_each_part_starts():
    # The owner is looked up by the request's input pointers, at the start and at the
    # last kernel's launch; begin and prepare then get it as one more argument.
    log = []
    owners = {(4,): ("tenant", 7)}

    def begin(inputs, who):
        log.append(("begin", who))

    def prepare(inputs, started, who):
        log.append(("prepare", who))
        return started, None
    end, make_start = model_effects([T("x")], [T("y")], begin, lambda x, s: {"y": x["x"]},
                                    own_args=1, prepare=prepare, owner=owners.get)
    start = make_start(1)
    mem = {p: np.zeros(NB, np.uint8) for p in (4, 6, 8)}

    def view(p, n):
        return mem[p][:n]
    start(view, (0, 4))
    assert end.pending(view, (0, 4, 6)) is None
    start(view, (0, 8))                                # a set nobody was told about
    end.pending(view, (0, 8, 6))
    assert log == [("begin", ("tenant", 7)), ("prepare", ("tenant", 7)),
                   ("begin", None), ("prepare", None)]
