"""A kernel that fails without losing the device (``Device.faults``): on the simulator, a
functional effect that raises. Its request fails with the reason; the requests beside it,
the device and the dispatcher carry on. Before, the exception unwound the device's poll,
which in the daemon is the loop: every client's requests were lost with it."""
from __future__ import annotations

import numpy as np
import pytest

from paella.dispatcher.adaptor import BufferArg, PlanAdaptor
from paella.dispatcher.core import STATUS_ERROR, STATUS_OK, Request
from paella.dispatcher.devices.sim.functional import model_effects

from test_effect_start import NB, N, T, chain, plan_of

BAD = 13.0


def failing_effects(where: str):
    """The model doubles its input; the start (``where="start"``) or the end raises for
    an input of BAD."""
    def begin(inputs):
        if where == "start" and inputs["x"][0] == BAD:
            raise RuntimeError("the start could not read this input")
        return None

    def compute(inputs, started):
        if where == "end" and inputs["x"][0] == BAD:
            raise OSError(24, "Too many open files")
        return {"y": inputs["x"] * 2}
    return model_effects([T("x")], [T("y")], begin, compute, own_args=1)


@pytest.mark.parametrize("lookahead", [1, 3])
@pytest.mark.parametrize("where", ["start", "end"])
def test_a_failing_effect_fails_its_request_only(make, where, lookahead):
    end, make_start = failing_effects(where)
    plan = plan_of(chain()).with_effect(end, [BufferArg("x"), BufferArg("y")], make_start,
                                        [BufferArg("x")])
    dev, d = make("paella", lookahead=lookahead)
    mid = d.register_model("m", PlanAdaptor(plan))
    values = [1.0, BAD, 3.0, 4.0]
    done: dict[int, tuple] = {}
    ios = []
    for i, v in enumerate(values):                     # in flight together
        io = np.zeros(2 * NB, np.uint8)
        io[:NB] = np.full(N, v, np.float32).view(np.uint8)
        ios.append(io)
        d.submit(Request(i, 0, mid, io,
                         on_complete=lambda r, st, err: done.setdefault(r.req_id, (st, err))))
    d.run_until_idle()
    assert sorted(done) == [0, 1, 2, 3]
    status, error = done[1]
    assert status == STATUS_ERROR
    assert "could not compute this request's outputs" in error
    assert ("RuntimeError: the start could not read" if where == "start"
            else "OSError: [Errno 24] Too many open files") in error
    for i in (0, 2, 3):
        assert done[i] == (STATUS_OK, None)
        np.testing.assert_array_equal(ios[i][NB:].view(np.float32), np.full(N, 2 * values[i]))
    assert dev.faults == {} and d.in_flight == 0 and not d.jobs
    # The same model serves the next request, on the same buffers.
    again = []
    io = np.zeros(2 * NB, np.uint8)
    io[:NB] = np.full(N, 5.0, np.float32).view(np.uint8)
    d.submit(Request(9, 0, mid, io, on_complete=lambda r, st, err: again.append(st)))
    d.run_until_idle()
    assert again == [STATUS_OK]
    np.testing.assert_array_equal(io[NB:].view(np.float32), np.full(N, 10.0))


def test_a_stale_fault_does_not_fail_the_next_launch_with_its_id(make):
    """A fault nobody collected (a device used without a dispatcher, say) is forgotten
    when its launch id is used again."""
    end, make_start = failing_effects("end")
    plan = plan_of(chain()).with_effect(end, [BufferArg("x"), BufferArg("y")], make_start,
                                        [BufferArg("x")])
    dev, d = make("paella")
    mid = d.register_model("m", PlanAdaptor(plan))
    for lid in range(4096):
        dev.faults[lid] = "stale"
    done = []
    io = np.zeros(2 * NB, np.uint8)
    io[:NB] = np.full(N, 2.0, np.float32).view(np.uint8)
    d.submit(Request(0, 0, mid, io, on_complete=lambda r, st, err: done.append((st, err))))
    d.run_until_idle()
    assert done == [(STATUS_OK, None)]
