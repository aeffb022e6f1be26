"""A kernel's functional effect on the simulated GPU: applied in device memory when the
kernel completes, in stream order with the copies around it, in both simulator modes."""
from __future__ import annotations

import numpy as np
import pytest

from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher.devices.sim import SimDevice, SimProcessDevice
from paella.dispatcher.devices.sim.functional import model_effect


class T:
    """A tensor as model_effect reads it."""

    def __init__(self, name, n):
        self.name, self.shape, self.dtype, self.nbytes = name, (n,), "float32", 4 * n


def run(dev, launch_args):
    """x -> [H2D] buf_in -> kernel (effect: y = 2x + 1) -> buf_out -> [D2H] out."""
    seen = []

    def compute(inputs):
        seen.append(inputs["x"].copy())
        return {"y": inputs["x"] * 2 + 1}
    effect = model_effect([T("x", 4)], [T("y", 4)], compute, own_args=1)
    f = dev.load_module(ModuleImage("m", [KernelInfo("k", 16, duration=20e-6)],
                                    effects={"k": effect}))["k"]
    src, dst = dev.alloc(16), dev.alloc(16)
    x = np.arange(4, dtype=np.float32)
    out = np.zeros(4, np.float32)
    done = []
    dev.memcpy_htod(src, x.view(np.uint8), 0)
    dev.launch(f, 1, 32, 0, 1, args=launch_args(src, dst), instrumented=False,
               on_complete=lambda: done.append("k"))
    dev.memcpy_dtoh(out.view(np.uint8), dst, 0, on_complete=lambda: done.append("d2h"))
    dev.synchronize()
    return out, seen, done


@pytest.mark.parametrize("cls", [SimDevice, SimProcessDevice])
def test_the_effect_writes_device_memory_before_the_copy_back(cls):
    dev = cls("gtx1660s", n_streams=4)
    try:
        out, seen, done = run(dev, lambda src, dst: (7, src, dst))
    finally:
        dev.close()
    assert np.array_equal(out, np.arange(4, dtype=np.float32) * 2 + 1)
    assert len(seen) == 1 and np.array_equal(seen[0], np.arange(4, dtype=np.float32))
    assert done == ["k", "d2h"]


def test_a_launch_without_the_operands_has_no_effect():
    dev = SimDevice("gtx1660s", n_streams=4)
    out, seen, _ = run(dev, lambda src, dst: (7,))        # its own argument only
    assert seen == [] and not out.any()


def test_real_time_h2d_lands_at_submission_only_when_nothing_in_flight_could_see_it():
    """The real-time simulator moves an H2D's bytes when the copy is submitted (a speed
    trick) only while no op in flight touches device memory at its completion; stream
    order holds either way: a D2H queued before an H2D to the same buffer reads the
    old bytes. (A clock at 1/10,000 of the wall's: the D2H stays in flight while the
    test submits the H2D behind it, however loaded the machine.)"""
    dev = SimDevice("t4", realtime=True, speed=1e-4)
    buf = dev.alloc(16)
    x1, x2 = np.arange(4, dtype=np.float32), np.arange(4, dtype=np.float32) + 10
    dev.memcpy_htod(buf, x1.view(np.uint8), 0)
    assert np.array_equal(dev.memory.view(buf, 16).view(np.float32), x1)   # landed already
    dev.synchronize()
    out = np.zeros(4, np.float32)
    dev.memcpy_dtoh(out.view(np.uint8), buf, 0)                  # in flight: reads at its end
    dev.memcpy_htod(buf, x2.view(np.uint8), 0)                   # so this one lands late
    assert np.array_equal(dev.memory.view(buf, 16).view(np.float32), x1)
    dev.synchronize()
    assert np.array_equal(out, x1)
    assert np.array_equal(dev.memory.view(buf, 16).view(np.float32), x2)
    assert dev._pending_access == 0


def test_an_effect_in_flight_keeps_a_later_h2d_from_landing_early():
    """A kernel whose effect reads its input at completion, then an H2D overwriting that
    input on the same stream: the effect sees the first input. (A slow clock, as above.)"""
    dev = SimDevice("t4", realtime=True, speed=1e-3)
    seen = []

    def compute(inputs):
        seen.append(inputs["x"].copy())
        return {"y": inputs["x"] * 2 + 1}
    f = dev.load_module(ModuleImage("m2", [KernelInfo("k", 16, duration=200e-6)],
                                    effects={"k": model_effect([T("x", 4)], [T("y", 4)],
                                                               compute, own_args=0)}))["k"]
    src, dst = dev.alloc(16), dev.alloc(16)
    x1 = np.full(4, 3, np.float32)
    dev.memcpy_htod(src, x1.view(np.uint8), 0)
    dev.launch(f, 1, 32, 0, 9, args=(src, dst), instrumented=False)
    dev.memcpy_htod(src, np.zeros(4, np.float32).view(np.uint8), 0)
    assert seen == [] and np.array_equal(dev.memory.view(src, 16).view(np.float32), x1)
    dev.synchronize()
    assert len(seen) == 1 and np.array_equal(seen[0], x1)
    assert not dev.memory.view(src, 16).any()


def _failing_run(dev):
    def compute(inputs):
        raise OSError(24, "Too many open files")
    effect = model_effect([T("x", 4)], [T("y", 4)], compute, own_args=1)
    f = dev.load_module(ModuleImage("m", [KernelInfo("k", 16, duration=20e-6)],
                                    effects={"k": effect}))["k"]
    src, dst = dev.alloc(16), dev.alloc(16)
    done = []
    dev.launch(f, 1, 32, 0, 77, args=(7, src, dst), instrumented=False,
               on_complete=lambda: done.append("k"))
    dev.synchronize()
    return done


def test_a_failing_effect_is_that_kernels_fault_in_the_stepped_simulator():
    """Recorded in ``faults`` by launch id (the dispatcher fails the kernel's job); the
    device keeps running, and the kernel still completes. A later launch with the same id
    forgets the stale entry."""
    dev = SimDevice("gtx1660s", n_streams=4)
    assert _failing_run(dev) == ["k"]
    assert "OSError: [Errno 24] Too many open files" in dev.faults[77]
    out, seen, done = run(dev, lambda src, dst: (7, src, dst))    # launch id 1: unaffected
    assert done == ["k", "d2h"] and out[1] == 3.0 and set(dev.faults) == {77}
    f = dev.load_module(ModuleImage("n", [KernelInfo("k2", 16, duration=1e-6)]))["k2"]
    dev.launch(f, 1, 32, 0, 77, instrumented=False)
    assert 77 not in dev.faults


def test_a_failing_effect_is_that_kernels_late_fault_in_the_simulator_process():
    """In its own process the effect runs after the kernel's notifications may have been
    read, so the failure goes in ``late_faults`` (the dispatcher takes them before
    anything else and fails that kernel's job), not ``faults``, and the device goes on:
    not one request answered with stale outputs, and not every request failed as a lost
    device either (it was, before session 29)."""
    dev = SimProcessDevice("gtx1660s", n_streams=4)
    try:
        assert _failing_run(dev) == ["k"]
        assert "OSError: [Errno 24] Too many open files" in dev.late_faults[77]
        assert not dev.faults
        out, seen, done = run(dev, lambda src, dst: (7, src, dst))    # launch id 1
        assert done == ["k", "d2h"] and out[1] == 3.0 and set(dev.late_faults) == {77}
    finally:
        dev.close()


def test_gates_ahead_of_kernels_not_yet_reached_do_not_count_against_the_hold_bound():
    """Released ahead (an eager policy), every kernel with an answer to ask gets a gate
    in front of it until it reaches its stream's head; only a gate whose answer is still
    being computed holds anything. Counting the others against the bound (half the
    streams) refused the step plug-ins' holds as overloaded under fifo/ms-jbj (the
    fuzzer, session 29: orca's and cellular's honest requests failed)."""
    from concurrent.futures import Future
    dev = SimDevice("t4", n_streams=8, realtime=True, speed=1e-3)
    ready, computing = Future(), Future()
    ready.set_result(None)

    def effect(view, args):
        pass
    effect.pending = lambda view, args: computing if args and args[0] == "slow" else ready
    mod = dev.load_module(ModuleImage("m", [KernelInfo("long", 16, duration=1.0),
                                            KernelInfo("k", 16, duration=1e-6)],
                                      effects={"k": effect}))
    for s in range(4):                       # busy streams: each k's gate waits its turn
        dev.launch(mod["long"], 1, 32, s, 10 + s, instrumented=False)
        dev.launch(mod["k"], 1, 32, s, 20 + s, args=("fast",), instrumented=False)
    assert dev.gpu.gates == 4 and dev.gates == 0
    dev.launch(mod["k"], 1, 32, 6, 99, args=("slow",), instrumented=False)
    assert 99 not in dev.faults, dev.faults.get(99)
    assert dev.gates == 1                    # held, not refused
    computing.set_result(None)
    assert dev.open_answered() == 1 and dev.gates == 0
    dev.close()


def test_a_scheduler_steps_hold_is_not_refused_when_the_bound_is_full():
    """A step of a scheduler plug-in (``step_hold``: orca's iteration, a batch of cells)
    serves many clients' requests at once; a tenant's uncovered inputs filling the bound
    must not fail them all (the fuzzer, session 29)."""
    from concurrent.futures import Future
    dev = SimDevice("t4", n_streams=4, realtime=True, speed=1e-3)
    computing = Future()

    def effect(view, args):
        pass

    def step(view, args):
        pass
    effect.pending = step.pending = lambda view, args: computing
    step.step_hold = True
    mod = dev.load_module(ModuleImage("m", [KernelInfo("k", 16, duration=1e-6),
                                            KernelInfo("s", 16, duration=1e-6)],
                                      effects={"k": effect, "s": step}))
    dev.launch(mod["k"], 1, 32, 0, 1, args=(1,), instrumented=False)
    dev.launch(mod["k"], 1, 32, 1, 2, args=(2,), instrumented=False)
    dev.launch(mod["k"], 1, 32, 2, 3, args=(3,), instrumented=False)
    assert dev.gates == 2 and 3 in dev.faults and "overloaded" in dev.faults[3]
    dev.launch(mod["s"], 1, 32, 3, 4, args=(4,), instrumented=False)
    assert 4 not in dev.faults and dev.gates == 3
    computing.set_result(None)
    assert dev.open_answered() == 3
    dev.close()
