"""FIFO hardware queues, stream order and head-of-line blocking, as timelines."""
from __future__ import annotations

import numpy as np
import pytest

from paella.dispatcher.devices.base import KernelInfo
from paella.dispatcher.devices.sim import SimDevice
from paella.gpus import preset

US = 1e-6


def tiny_gpu(queues: int = 2, **kw) -> SimDevice:
    return SimDevice(preset("gtx1660s").with_(hw_queues=queues), n_streams=8, **kw)


def timeline(dev, launches):
    """Launch (func, grid, block, stream) tuples at t=0, run, return [(first, done)]."""
    log = {}
    for i, (f, g, b, s) in enumerate(launches):
        dev.launch(f, g, b, s, i, instrumented=False,
                   on_complete=lambda i=i: log.__setitem__(i, dev.now()))
    dev.run()
    return [log[i] for i in range(len(launches))]


def test_stream_order_serializes_dependent_kernels(kernels):
    # Each kernel starts one launch latency (the front end's cost) after the previous
    # one of its stream completed.
    dev = tiny_gpu()
    L = dev.cost.launch_latency
    assert L > 0
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    done = timeline(dev, [(k, 1, 128, 0)] * 3)
    assert done == pytest.approx([L + 100 * US, 2 * L + 200 * US, 3 * L + 300 * US])


def test_independent_streams_on_different_queues_overlap(kernels):
    dev = tiny_gpu(queues=2)
    L = dev.cost.launch_latency
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    done = timeline(dev, [(k, 1, 128, 0), (k, 1, 128, 1)])   # streams 0, 1 -> queues 0, 1
    assert done == pytest.approx([L + 100 * US, L + 100 * US])


def test_head_of_line_blocking_between_streams_sharing_a_queue(kernels):
    # Streams 0 and 2 share queue 0. Stream 0's second kernel is the queue head while
    # it waits for stream 0's first kernel; stream 2's kernel sits behind it although
    # the GPU is almost empty. It is issued only when the head has been placed
    # (t = 2L + 100us), and starts one launch latency L later.
    dev = tiny_gpu(queues=2)
    L = dev.cost.launch_latency
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    done = timeline(dev, [(k, 1, 128, 0), (k, 1, 128, 0), (k, 1, 128, 2)])
    assert done == pytest.approx([L + 100 * US, 2 * L + 200 * US, 3 * L + 200 * US])
    # The same three kernels with stream 2 moved to its own queue: no blocking.
    dev = tiny_gpu(queues=4)
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    done = timeline(dev, [(k, 1, 128, 0), (k, 1, 128, 0), (k, 1, 128, 2)])
    assert done == pytest.approx([L + 100 * US, 2 * L + 200 * US, L + 100 * US])


def test_queue_head_blocks_until_all_its_blocks_are_placed(kernels):
    # A kernel of two waves holds the head of queue 0 until its second wave is placed.
    # Its shared memory allows one block per SM, leaving threads free beside it: a small
    # kernel on queue 1 runs at once, while the same kernel behind it on queue 0 (another
    # stream, no dependency) waits for the second wave's placement at t = L + 100us.
    spec = preset("gtx1660s").with_(hw_queues=2)
    dev = SimDevice(spec, n_streams=8)
    L = dev.cost.launch_latency
    big, small = kernels(dev, KernelInfo("big", 32, static_smem=40 * 1024, duration=200 * US),
                         KernelInfo("small", 16, duration=50 * US))
    assert dev.resources.fit(0, dev.block_footprint(big, (512, 1, 1), 0)) == 1
    done = timeline(dev, [(big, 2 * 22, 512, 0), (small, 1, 32, 2), (small, 1, 32, 1)])
    assert done[0] == pytest.approx(L + 200 * US)          # 2 waves of 100 us
    assert done[2] == pytest.approx(L + 50 * US)           # other queue: runs beside wave 1
    assert done[1] == pytest.approx(2 * L + 100 * US + 50 * US)   # behind the head until wave 2


def test_block_scheduler_serves_heads_in_launch_order(kernels):
    # When a full GPU frees room, the earliest-launched head gets it first: the second
    # wave of the big kernel (launched first) is placed before the kernel on queue 1.
    spec = preset("gtx1660s").with_(hw_queues=2)
    dev = SimDevice(spec, n_streams=8)
    L = dev.cost.launch_latency
    big, small = kernels(dev, KernelInfo("big", 32, duration=200 * US), KernelInfo("small", 16, duration=50 * US))
    done = timeline(dev, [(big, 2 * 22, 1024, 0), (small, 1, 32, 1)])
    assert done == pytest.approx([L + 200 * US, L + 250 * US])


def test_copies_use_fifo_engines_and_keep_stream_order(kernels):
    dev = tiny_gpu(queues=4)
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    ptr = dev.alloc(1 << 20)
    src = np.arange(1 << 18, dtype=np.float32)
    out = np.zeros_like(src)
    log = []
    dev.memcpy_htod(ptr, src, 0, on_complete=lambda: log.append(("h2d", dev.now())))
    dev.launch(k, 1, 32, 0, 1, instrumented=False, on_complete=lambda: log.append(("k", dev.now())))
    dev.memcpy_dtoh(out, ptr, 0, on_complete=lambda: log.append(("d2h", dev.now())))
    dev.run()
    ct, L = dev.cost.copy_time(dev.props, src.nbytes), dev.cost.launch_latency
    assert [n for n, _ in log] == ["h2d", "k", "d2h"]
    assert [t for _, t in log] == pytest.approx([ct, ct + L + 100 * US, 2 * ct + L + 100 * US])
    np.testing.assert_array_equal(out, src)               # the bytes made the round trip


def test_two_h2d_copies_on_different_streams_share_one_engine():
    dev = tiny_gpu(queues=4)
    a, b = dev.alloc(1 << 20), dev.alloc(1 << 20)
    buf = np.ones(1 << 20, dtype=np.uint8)
    log = []
    dev.memcpy_htod(a, buf, 0, on_complete=lambda: log.append(dev.now()))
    dev.memcpy_htod(b, buf, 1, on_complete=lambda: log.append(dev.now()))
    dev.run()
    ct = dev.cost.copy_time(dev.props, buf.nbytes)
    assert log == pytest.approx([ct, 2 * ct])


def test_events_and_stream_query(kernels):
    dev = tiny_gpu()
    (k,) = kernels(dev, KernelInfo("k", 16, duration=100 * US))
    dev.launch(k, 1, 32, 0, 1, instrumented=False)
    ev = dev.record_event(0)
    assert not dev.event_query(ev) and not dev.stream_query(0) and dev.stream_query(1)
    dev.run_until(99 * US)
    assert not dev.event_query(ev)
    dev.run_until(100 * US + dev.cost.launch_latency)
    assert dev.event_query(ev) and dev.stream_query(0)
    assert dev.event_query(dev.record_event(1))           # an event on an idle stream is done at once


def test_synchronize_with_nothing_pending_returns_at_once():
    dev = tiny_gpu()
    dev.synchronize()
    assert dev.now() == 0.0


def test_copy_outside_an_allocation_is_refused():
    dev = tiny_gpu()
    ptr = dev.alloc(100)
    with pytest.raises(Exception, match="outside every allocation"):
        dev.memcpy_htod(ptr + 50, np.zeros(100, dtype=np.uint8), 0)


def test_bad_stream_is_refused(kernels):
    dev = tiny_gpu()
    (k,) = kernels(dev, KernelInfo("k", 16, duration=1e-4))
    with pytest.raises(ValueError, match="stream 99"):
        dev.launch(k, 1, 32, 99, 1)


def test_a_more_urgent_stream_places_its_blocks_first(kernels):
    # A wide kernel fills the GPU in ten waves of 100 us; a one-block kernel of 100 us
    # launched after it on another stream (and queue) waits, without priorities, until
    # every block of the first is placed (launch order). With stream 1 more urgent
    # (CUDA's lower number), its block takes the first resources that free up: nothing
    # running is preempted, so it waits one wave, not ten.
    def run(priority: int | None) -> list[float]:
        dev = tiny_gpu(queues=2)
        wide, one = kernels(dev, KernelInfo("wide", 16, duration=1000 * US),
                            KernelInfo("one", 16, duration=100 * US))
        if priority is not None:
            dev.set_stream_priority(1, priority)
        per_wave = 22 * 8                                # 22 SMs x 8 blocks of 128 threads
        return timeline(dev, [(wide, 10 * per_wave, 128, 0), (one, 1, 128, 1)])
    L = tiny_gpu().cost.launch_latency
    plain, urgent, lazy = run(None), run(-1), run(1)
    assert plain[1] == pytest.approx(L + 1000 * US + 100 * US)    # behind all ten waves
    assert urgent[1] == pytest.approx(L + 100 * US + 100 * US)    # one wave, then its block
    assert urgent[0] == pytest.approx(plain[0] + 100 * US)        # one of its blocks a wave later
    assert lazy == plain                                 # less urgent than 0: as without
    with pytest.raises(ValueError, match="outside -64..64"):
        tiny_gpu().set_stream_priority(1, 100)
    with pytest.raises(ValueError, match="stream"):
        tiny_gpu().set_stream_priority(99, -1)
