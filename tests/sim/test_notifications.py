"""The notifQ: entry counts and grouping, determinism, overrun, real-time mode."""
from __future__ import annotations

import time

import numpy as np
import pytest

from paella import protocol
from paella.dispatcher.devices.base import KernelInfo, NotifQOverrun
from paella.dispatcher.devices.sim import SimDevice

US = 1e-6


def drain(dev: SimDevice, head: int = 0) -> tuple[list[int], int]:
    """Read and clear every entry the way the dispatcher does."""
    ring, mask, out = dev.notifq, dev.notifq.size - 1, []
    while ring[head & mask]:
        out.append(int(ring[head & mask]))
        ring[head & mask] = protocol.INVALID
        head += 1
    return out, head


@pytest.mark.parametrize("group", [16, 1, 7])
def test_every_kernel_posts_ceil_g_over_group_entries_of_each_kind(group, kernels):
    rng = np.random.default_rng(group)
    dev = SimDevice("t4", n_streams=8)
    (k,) = kernels(dev, KernelInfo("k", 32, duration=50 * US))
    sizes = {lid: int(rng.integers(1, 2000)) for lid in range(1, 30)}
    for lid, g in sizes.items():
        dev.launch(k, g, int(rng.choice([64, 256, 1024])), lid % 8, lid, group=group)
    dev.run()
    words, _ = drain(dev)
    kinds, sms, counts, lids = protocol.decode_array(np.array(words, dtype=np.uint64))
    assert sms.max() < dev.props.sm_count
    for lid, g in sizes.items():
        for kind in (protocol.PLACEMENT, protocol.COMPLETION):
            sel = (lids == lid) & (kinds == kind)
            assert sel.sum() == -(-g // group)
            assert counts[sel].sum() == g
            assert (counts[sel][:-1] == group).all()


def test_placement_entries_precede_completions_of_the_same_blocks(kernels):
    dev = SimDevice("gtx1660s")
    (k,) = kernels(dev, KernelInfo("k", 9, duration=300 * US))
    dev.launch(k, 500, 128, 0, 42)
    placed = done = head = 0
    while dev.next_event_time() != float("inf"):
        dev.step()
        words, head = drain(dev, head)
        for w in words:
            n = protocol.decode(w)
            assert n.launch_id == 42
            if n.kind == protocol.PLACEMENT:
                placed += n.count
            else:
                done += n.count
            assert done <= placed
    assert placed == done == 500


def test_uninstrumented_kernels_and_copies_post_nothing(kernels):
    dev = SimDevice("t4")
    (k,) = kernels(dev, KernelInfo("k", 32, duration=50 * US))
    dev.launch(k, 100, 256, 0, 1, instrumented=False)
    dev.memcpy_htod(dev.alloc(64), np.zeros(64, np.uint8), 1)
    dev.run()
    assert not dev.notifq.any()


def run_seeded(seed: int, kernels):
    dev = SimDevice("t4", n_streams=16, seed=seed, jitter=0.2)
    (k,) = kernels(dev, KernelInfo("k", 40, duration=80 * US))
    ends = []
    for lid in range(40):
        dev.launch(k, 37 * (lid % 5 + 1), 256, lid % 16, lid, on_complete=lambda: ends.append(dev.now()))
    dev.run()
    return drain(dev)[0], ends


def test_same_seed_same_run_and_other_seed_other_run(kernels):
    a, b, c = run_seeded(1, kernels), run_seeded(1, kernels), run_seeded(2, kernels)
    assert a == b
    assert a[1] != c[1]


def test_overrunning_the_ring_raises(kernels):
    dev = SimDevice("t4", notifq_slots=64)
    (k,) = kernels(dev, KernelInfo("k", 32, duration=50 * US))
    dev.launch(k, 40, 256, 0, 1, group=1)      # 40 placements fit in 64 slots
    with pytest.raises(NotifQOverrun, match="outstanding blocks"):
        dev.run()                              # ... but 40 completions do not


def test_reader_that_keeps_up_never_overruns(kernels):
    dev = SimDevice("t4", notifq_slots=64)
    (k,) = kernels(dev, KernelInfo("k", 32, duration=50 * US))
    dev.launch(k, 40, 256, 0, 1, group=1)
    # The 40 placements are posted at launch and the 40 completions all at once (the
    # blocks end together): a reader draining between events keeps up with 64 slots.
    head, seen = 0, 0
    words, head = drain(dev, head)
    seen += len(words)
    while dev.next_event_time() != float("inf"):
        dev.step()
        words, head = drain(dev, head)
        seen += len(words)
    assert seen == 80


def test_notifq_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        SimDevice("t4", notifq_slots=1000)


def test_realtime_mode_advances_with_the_wall_clock_when_polled(kernels):
    dev = SimDevice("t4", realtime=True)
    (k,) = kernels(dev, KernelInfo("k", 32, duration=30e-3))
    dev.launch(k, 1, 32, 0, 7)
    dev.poll()
    assert not dev.stream_query(0)          # 30 ms have not passed yet
    time.sleep(0.05)
    dev.poll()
    assert dev.stream_query(0)
    words, _ = drain(dev)
    assert [protocol.decode(w).kind for w in words] == [protocol.PLACEMENT, protocol.COMPLETION]


def test_realtime_speed_scales_the_clock(kernels):
    dev = SimDevice("t4", realtime=True, speed=10.0)
    (k,) = kernels(dev, KernelInfo("k", 32, duration=0.2))   # 200 ms of GPU time = 20 ms wall
    dev.launch(k, 1, 32, 0, 7)
    t0 = time.perf_counter()
    dev.synchronize()
    assert time.perf_counter() - t0 < 0.19
