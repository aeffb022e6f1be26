"""The real-time simulator in its own process: shared-memory notifQ, pipe commands."""
from __future__ import annotations

import os
import time
import signal

import numpy as np
import pytest

from paella import protocol
from paella.dispatcher.devices.base import DeviceError, KernelInfo, ModuleImage
from paella.dispatcher.devices.sim import SimProcessDevice


@pytest.fixture
def dev():
    d = SimProcessDevice("t4")
    yield d
    d.close()


def test_ops_run_in_the_child_and_results_come_back(dev):
    f = dev.load_module(ModuleImage("m", [KernelInfo("k", 32, duration=5e-3)]))["k"]
    ptr = dev.alloc(4096)
    src = np.arange(4096, dtype=np.uint8)
    out = np.zeros_like(src)
    log = []
    dev.memcpy_htod(ptr, src, 0)
    dev.launch(f, 100, 256, 0, 9, on_complete=lambda: log.append("k"))
    ev = dev.record_event(0)
    dev.memcpy_dtoh(out, ptr, 0, on_complete=lambda: log.append("d2h"))
    assert not dev.stream_query(0)
    dev.synchronize()
    assert log == ["k", "d2h"] and dev.event_query(ev) and dev.stream_query(0)
    np.testing.assert_array_equal(out, src)
    words = [protocol.decode(w) for w in dev.notifq if w]
    assert {w.launch_id for w in words} == {9}
    for kind in (protocol.PLACEMENT, protocol.COMPLETION):
        assert sum(w.count for w in words if w.kind == kind) == 100
        assert sum(1 for w in words if w.kind == kind) == -(-100 // 16)


def test_close_unlinks_the_shared_notifq_and_stops_the_child():
    d = SimProcessDevice("t4")
    name = d._shm_name.lstrip("/")
    assert name in os.listdir("/dev/shm")
    d.close()
    assert name not in os.listdir("/dev/shm")
    assert d._proc.poll() is not None


def test_a_dead_simulator_process_is_reported_clearly(dev):
    f = dev.load_module(ModuleImage("m", [KernelInfo("k", 32, duration=1e-3)]))["k"]
    dev._proc.send_signal(signal.SIGKILL)
    dev._proc.wait()
    with pytest.raises(DeviceError, match="simulator process exited"):
        dev.launch(f, 1, 32, 0, 1)


def test_a_kernel_whose_answer_is_computing_holds_only_what_reads_its_output(dev):
    # The effect's answer is still being computed when the child reports the kernel
    # done: the copy that reads its output (on another stream, as the core's stream pool
    # places it) and the event after that copy wait; another job's copy and the child's
    # clock go on. Once the answer is in, the effect writes it before the copy lands.
    from concurrent.futures import Future
    answer: Future = Future()

    def effect(view, args):
        view(args[1], 4)[:] = 7
    effect.pending = lambda view, args: None if answer.done() else answer
    effect.writes = lambda args: ((args[1], 4),)
    mod = dev.load_module(ModuleImage("m", [KernelInfo("k", 32, duration=1e-3)],
                                      effects={"k": effect}))
    held, free = dev.alloc(4096), dev.alloc(4096)
    out, other = np.zeros(4, np.uint8), np.zeros(4, np.uint8)
    log = []
    dev.launch(mod["k"], 1, 32, 0, 1, args=(0, held))
    deadline = time.monotonic() + 10
    while dev.gates == 0 and time.monotonic() < deadline:     # (reported done, held)
        dev.poll()
    dev.memcpy_dtoh(out, held, 1, on_complete=lambda: log.append("held copy"))
    ev = dev.record_event(1)
    dev.memcpy_htod(free, np.full(4, 3, np.uint8), 2)
    dev.memcpy_dtoh(other, free, 2, on_complete=lambda: log.append("other copy"))
    while ("other copy" not in log or dev._pending) and time.monotonic() < deadline:
        dev.poll()
    assert log == ["other copy"] and dev.gates == 1 and not dev.event_query(ev)
    np.testing.assert_array_equal(other, 3)
    answer.set_result(None)
    assert dev.open_answered() == 1 and dev.gates == 0
    assert log == ["other copy", "held copy"] and dev.event_query(ev)
    np.testing.assert_array_equal(out, 7)
    dev.synchronize()
