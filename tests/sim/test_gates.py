"""Gates (``Gpu.gate`` / ``Gpu.open``): a marker that completes only once opened, holding
its stream and hardware queue until then; handles that a stale or forged value cannot
misuse; and an engine with only closed gates left that is idle, not stuck."""
from __future__ import annotations

import numpy as np
import pytest

from paella.dispatcher.devices.base import KernelInfo
from paella.dispatcher.devices.sim import SimDevice
from paella.gpus import preset

US = 1e-6
INF = float("inf")


def tiny_gpu(queues: int = 2, **kw) -> SimDevice:
    # streams s and s + queues share a hardware queue
    return SimDevice(preset("gtx1660s").with_(hw_queues=queues), n_streams=8, **kw)


def launch(dev, k, stream, log, name, lid=0):
    dev.launch(k, 1, 128, stream, lid, instrumented=False,
               on_complete=lambda: log.__setitem__(name, dev.now()))


def test_kernel_behind_a_closed_gate_waits_for_open_while_other_queues_run(kernels):
    dev = tiny_gpu(queues=2)
    L = dev.cost.launch_latency
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    log = {}
    h = dev.gpu.gate(0)
    assert isinstance(h, int) and dev.gpu.gates == 1
    launch(dev, k, 0, log, "held")                   # behind the gate, same stream
    launch(dev, k, 2, log, "same_queue")             # stream 2 shares queue 0: behind it too
    launch(dev, k, 1, log, "other")                  # queue 1: not held
    dev.run()                                        # returns: nothing can happen until open
    assert log == {"other": pytest.approx(L + 100 * US)}
    assert dev.gpu.peek() == INF and dev.gpu.resident == 0
    assert dev.gpu.busy() and not dev.gpu.stream_idle(0) and not dev.gpu.stream_idle(2)
    assert dev.gpu.stream_idle(1) and dev.gpu.gates == 1
    # the gate is stream 0's alone (the kernel cores steer new jobs off it: issue 37)
    assert [dev.gpu.stream_gated(s) for s in range(4)] == [True, False, False, False]

    t_open = 500 * US
    assert dev.run_until(t_open) is False and dev.now() == t_open
    assert dev.gpu.open(h) is True
    assert dev.gpu.gates == 0 and dev.now() == t_open   # completed at the engine's time
    assert not dev.gpu.stream_gated(0)
    dev.run()
    # issued when the gate completed, one launch latency before placement; the kernel of
    # stream 2 sat behind the held one in queue 0 until it was placed (head-of-line)
    assert log["held"] == pytest.approx(t_open + L + 100 * US)
    assert log["same_queue"] == pytest.approx(t_open + 2 * L + 100 * US)
    assert not dev.gpu.busy() and dev.gpu.stream_idle(0)


def test_gate_opened_before_it_arrives_completes_like_a_marker(kernels):
    def run(between):
        dev = tiny_gpu(queues=2)
        (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
        log = {}
        launch(dev, k, 0, log, "a")
        between(dev)
        launch(dev, k, 0, log, "b")
        dev.run()
        return dev, log

    handles = []

    def gate_opened_at_once(dev):
        h = dev.gpu.gate(0)
        assert dev.gpu.open(h) is True               # behind "a": only marked open
        assert dev.gpu.gates == 1 and dev.gpu.busy()
        handles.append(h)

    dev, gated = run(gate_opened_at_once)
    _, plain = run(lambda dev: None)
    _, marked = run(lambda dev: dev.gpu.marker(0, None))
    assert gated == plain == marked                  # exactly: a gate adds no time
    assert dev.gpu.gates == 0
    assert dev.gpu.open(handles[0]) is False         # completed since: stale


def test_open_twice_before_arrival_and_gates_in_sequence(kernels):
    dev = tiny_gpu(queues=2)
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    log = {}
    h1 = dev.gpu.gate(0)
    h2 = dev.gpu.gate(0)
    dev.gpu.marker(0, lambda: log.__setitem__("marker", dev.now()))
    assert h1 != h2 and dev.gpu.gates == 2
    assert dev.gpu.open(h2) is True and dev.gpu.open(h2) is True   # still live, not at the head
    dev.run_until(10 * US)
    assert dev.gpu.gates == 2 and log == {}
    assert dev.gpu.open(h1) is True                  # both complete now, and the marker
    assert dev.gpu.gates == 0 and log == {"marker": 10 * US}
    assert dev.gpu.open(h1) is False and dev.gpu.open(h2) is False


def test_gate_behind_a_kernel_holds_its_stream_after_the_kernel(kernels):
    dev = tiny_gpu(queues=2)
    L = dev.cost.launch_latency
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    log = {}
    launch(dev, k, 0, log, "before")
    h = dev.gpu.gate(0)
    launch(dev, k, 0, log, "after")
    dev.run()
    assert log == {"before": pytest.approx(L + 100 * US)}
    assert dev.gpu.gates == 1 and not dev.gpu.stream_idle(0)
    dev.run_until(1000 * US)
    assert dev.gpu.open(h) is True
    dev.run()
    assert log["after"] == pytest.approx(1000 * US + L + 100 * US)


def test_copy_and_marker_behind_a_gate_wait_and_run_on_open():
    dev = tiny_gpu(queues=4)
    ptr = dev.alloc(1 << 16)
    buf = np.ones(1 << 16, dtype=np.uint8)
    log = []
    h = dev.gpu.gate(0)
    dev.memcpy_htod(ptr, buf, 0, on_complete=lambda: log.append(("h2d", dev.now())))
    ev = dev.record_event(0)
    dev.run()
    assert log == [] and not dev.event_query(ev)
    dev.run_until(50 * US)
    assert dev.gpu.open(h)
    dev.run()
    ct = dev.cost.copy_time(dev.props, buf.nbytes)
    assert log == [("h2d", pytest.approx(50 * US + ct))] and dev.event_query(ev)


def test_a_marker_deferred_behind_a_gate_runs_its_callback_inside_open():
    dev = tiny_gpu()
    seen = []
    h = dev.gpu.gate(3)
    dev.gpu.marker(3, lambda: seen.append(dev.gpu.gates))
    dev.run_until(7 * US)
    assert seen == []
    assert dev.gpu.open(h) is True
    assert seen == [0]                               # run by open itself, at 7 us
    assert dev.now() == 7 * US and not dev.gpu.busy()


def test_a_gate_takes_no_sm_posts_nothing_and_is_not_traced():
    dev = tiny_gpu()
    traced = []
    dev.gpu.trace = lambda kind, begin, end: traced.append(kind)
    state, tail = dev.gpu.state(), dev.gpu.tail
    h = dev.gpu.gate(1)
    assert dev.gpu.state() == state and dev.gpu.tail == tail and dev.gpu.resident == 0
    assert dev.gpu.pending_events == 0               # nothing scheduled for it
    dev.gpu.open(h)
    dev.run()
    assert dev.gpu.tail == tail and traced == [] and dev.gpu.state() == state


def test_stale_handles_return_false_and_cannot_open_a_reused_slot():
    dev = tiny_gpu()
    h = dev.gpu.gate(0)
    assert dev.gpu.open(h) is True                   # at the head: completes now
    assert dev.gpu.open(h) is False
    # the next gate most likely reuses the freed slot; the old handle must not open it
    h2 = dev.gpu.gate(0)
    assert h2 != h and h2 & 0xFFFFFFFF == h & 0xFFFFFFFF   # same slot, another number
    assert dev.gpu.open(h) is False
    assert dev.gpu.gates == 1 and not dev.gpu.stream_idle(0)
    assert dev.gpu.open(h2) is True and dev.gpu.gates == 0


def test_handles_that_no_gate_had_are_refused(kernels):
    dev = tiny_gpu()
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    h = dev.gpu.gate(0)
    seq, slot = h >> 32, h & 0xFFFFFFFF
    dev.launch(k, 1, 32, 0, 1, instrumented=False)   # the next op, held behind the gate
    for bogus in (0, -1, -h, 1 << 200,               # nothing numbered so; negative; huge
                  ((seq + 1000) << 32) | slot,       # a number no op has had yet
                  (seq << 32) | 1_000_000):          # a slot beyond the engine's
        with pytest.raises(ValueError):
            dev.gpu.open(bogus)
    # the kernel behind the gate: the next number, in the next slot of a fresh engine
    with pytest.raises(ValueError):
        dev.gpu.open(((seq + 1) << 32) | (slot + 1))
    with pytest.raises(TypeError):
        dev.gpu.open("gate")
    with pytest.raises(TypeError):
        dev.gpu.open(float(h))
    # no forged value opened the gate: other slots with the gate's number, or others
    for s in range(64):
        for q in (seq, seq + 1):
            if (q, s) != (seq, slot):
                try:
                    assert dev.gpu.open((q << 32) | s) is False
                except ValueError:
                    pass
    assert dev.gpu.gates == 1 and dev.gpu.resident == 0 and dev.gpu.peek() == INF
    assert dev.gpu.open(h) is True


def test_gate_refuses_a_bad_stream():
    dev = tiny_gpu()
    with pytest.raises(ValueError, match="stream 8"):
        dev.gpu.gate(8)
    with pytest.raises(ValueError, match="stream -1"):
        dev.gpu.gate(-1)
    assert dev.gpu.gates == 0 and not dev.gpu.busy()


def test_only_closed_gates_left_the_engine_is_idle_not_stuck(kernels):
    dev = tiny_gpu()
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    h = dev.gpu.gate(0)
    dev.launch(k, 1, 32, 0, 1, instrumented=False)
    dev.gpu.run()                                    # returns at once
    assert dev.gpu.peek() == INF and dev.now() == 0.0
    assert dev.gpu.run_until(1.0) is False and dev.now() == 1.0
    assert dev.gpu.run_until_observed(INF) is False and dev.now() == 1.0
    with pytest.raises(IndexError):                  # as with nothing at all scheduled
        dev.gpu.step()
    assert dev.gpu.busy() and dev.gpu.gates == 1
    assert dev.gpu.open(h) is True
    assert dev.gpu.peek() > 1.0                      # the held kernel's events
    dev.gpu.run()
    assert not dev.gpu.busy()


def test_open_from_a_callback_releases_another_stream(kernels):
    dev = tiny_gpu(queues=2)
    L = dev.cost.launch_latency
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    log = {}
    h = dev.gpu.gate(1)
    launch(dev, k, 1, log, "held")
    dev.launch(k, 1, 128, 0, 2, instrumented=False,
               on_complete=lambda: log.__setitem__("opened", dev.gpu.open(h)))
    dev.run()
    assert log["opened"] is True
    assert log["held"] == pytest.approx(2 * (L + 100 * US))
    assert dev.gpu.gates == 0 and not dev.gpu.busy()


def test_realtime_engine_with_a_closed_gate_polls_without_firing(kernels):
    dev = tiny_gpu(realtime=True, speed=1000.0)
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    log = {}
    h = dev.gpu.gate(0)
    launch(dev, k, 0, log, "held")
    dev.run()                                        # real time: returns, nothing due
    dev.poll()
    assert log == {} and dev.gpu.gates == 1
    assert dev.gpu.open(h) is True
    dev.run()
    assert "held" in log and not dev.gpu.busy()


def test_a_notifying_gate_is_reached_once_when_its_stream_has_done_what_came_before(kernels):
    dev = tiny_gpu(queues=2)
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    log = {}
    launch(dev, k, 0, log, "before")
    h = dev.gpu.gate(0, True)
    quiet = dev.gpu.gate(1)                             # (no notify: never listed)
    h_idle = dev.gpu.gate(3, True)                      # an idle stream: at its head at once
    launch(dev, k, 0, log, "after")
    assert dev.gpu.reached() == [h_idle]
    assert dev.gpu.reached() == []                      # listed once
    dev.run_until(50 * US)
    assert dev.gpu.reached() == []                      # "before" still runs
    dev.run()
    assert "before" in log and dev.gpu.reached() == [h]
    dev.run_until(dev.now() + 10 * US)
    assert dev.gpu.reached() == []                      # still closed: not listed again
    for g in (h, quiet, h_idle):
        assert dev.gpu.open(g) is True
    dev.run()
    assert "after" in log and dev.gpu.gates == 0 and dev.gpu.reached() == []
