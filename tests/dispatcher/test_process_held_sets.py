"""The simulator in its own process (``SimProcessDevice``) and a job cancelled while its
kernel is running: the dispatcher sees the kernel done in the notifQ, the job ends (its
output copy was never released), and the device only then holds the kernel for its
answer and writes it later. That job's buffer set must not go to the next job before
the device has written it (``Device.writes_pending``): the fuzzer found another
request's buffers overwritten, and its lookup taken (session 29)."""
from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np
import pytest

from paella.dispatcher.adaptor import BufferArg, Plan, PlanAdaptor, PlanOp
from paella.dispatcher.core import STATUS_CANCELLED, STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher.devices.sim import SimProcessDevice

NB = 64


def plan_with(effect) -> Plan:
    ops = [PlanOp("h2d", buffer="x", io_offset=0, nbytes=NB),
           PlanOp("launch", kernel="k", grid=(1,), block=(32,),
                  args=(BufferArg("x"), BufferArg("y"))),
           PlanOp("d2h", buffer="y", io_offset=NB, nbytes=NB)]
    return Plan("p", [KernelInfo("k", 16, duration=0.05)], ops, {"x": NB, "y": NB}, 2 * NB,
                effects={"k": effect})


@pytest.mark.parametrize("core", ["c", "python", None])
def test_a_cancelled_jobs_buffers_wait_while_the_device_still_writes_them(core):
    answer: Future = Future()
    asks = []

    def effect(view, args):
        view(args[1], NB)[:] = 7
    # The first request's answer is still being computed when its kernel is done; the
    # others' are ready.
    effect.pending = lambda view, args: asks.append(args) or (answer if len(asks) == 1 else None)
    effect.writes = lambda args: ((args[1], NB),)
    dev = SimProcessDevice("t4", n_streams=8)
    try:
        d = Dispatcher(dev, "paella", profile_runs=0, kernel_core=core)
        mid = d.register_model("m", PlanAdaptor(plan_with(effect)))
        done = {}

        def request(rid, client):
            io = np.zeros(2 * NB, np.uint8)
            d.submit(Request(rid, client, mid, io,
                             on_complete=lambda r, st, e: done.__setitem__(r.req_id, (st, io))))
        request(1, 1)
        end = time.monotonic() + 10
        while not any(p.ask is not None for p in dev._pending.values()):
            d.step()                             # until its kernel runs in the child
            assert time.monotonic() < end
        d.cancel_client(1)
        while 1 not in done:
            d.step()
            assert time.monotonic() < end
        assert done[1][0] == STATUS_CANCELLED
        while dev.gates == 0:                    # the device holds it once reported done
            d.step()
            assert time.monotonic() < end
        held = d._held_sets[0][1] if d._held_sets else None
        assert held is not None, "the cancelled job's buffer set went back while written"
        request(2, 2)                            # another job meanwhile: other buffers
        while 2 not in done:
            d.step()
            assert time.monotonic() < end
        assert done[2][0] == STATUS_OK and np.all(done[2][1][NB:] == 7)
        assert len(asks) == 2 and asks[1][1] != asks[0][1]
        answer.set_result(None)                  # the answer is in: written, then let go
        while d._held_sets or dev.gates:
            dev.open_answered()
            d.step()
            assert time.monotonic() < end
        assert held in d.models[mid].pool.free
    finally:
        dev.close()


def test_an_effect_writing_inside_a_buffer_keeps_that_whole_allocation():
    # A compiled plan's output may sit at an offset inside its buffer: the set is still
    # the device's to write while that effect is not applied.
    answer: Future = Future()

    def effect(view, args):
        view(args[0] + 1024, 64)[:] = 1
    effect.pending = lambda view, args: answer
    effect.writes = lambda args: ((args[0] + 1024, 64),)
    dev = SimProcessDevice("t4", n_streams=4)
    try:
        mod = dev.load_module(ModuleImage("m", [KernelInfo("k", 16, duration=1e-3)],
                                          effects={"k": effect}))
        buf, other = dev.alloc(4096), dev.alloc(4096)
        assert not dev.writes_pending([buf, other])
        dev.launch(mod["k"], 1, 32, 0, 1, args=(buf,))
        assert dev.writes_pending([buf]) and dev.writes_pending([other, buf])
        assert not dev.writes_pending([other])
        end = time.monotonic() + 10
        while dev.gates == 0:                    # reported done, held for its answer
            dev.poll()
            assert time.monotonic() < end
        assert dev.writes_pending([buf])
        answer.set_result(None)
        dev.open_answered()
        assert not dev.writes_pending([buf])
        assert np.all(dev.memory.view(buf + 1024, 64) == 1)
    finally:
        dev.close()
