"""Occupancy accounting against the simulator's ground truth, the +B rule and flow
control."""
from __future__ import annotations

import numpy as np
import pytest

from paella.dispatcher.core import STATUS_OK
from paella.dispatcher.tracker import Demand, Tracker
from paella import protocol
from paella.gpus import preset
from paella.occupancy import footprint

from dispatch_helpers import Recorder, TwoStreams, chain

KEYS = ("blocks", "warps", "registers", "shared_memory")


def random_models(d, rng):
    """Kernels of assorted shapes (threads, registers, shared memory)."""
    from paella.dispatcher.adaptor import PlanAdaptor, synthetic_plan
    ids = []
    for m in range(4):
        rows = [(f"m{m}k{i}", int(rng.integers(1, 90)), int(rng.choice([32, 96, 128, 256, 512])),
                 int(rng.integers(8, 64)), float(rng.uniform(20e-6, 200e-6))) for i in range(6)]
        plan = synthetic_plan(f"m{m}", rows, in_bytes=128, out_bytes=32,
                              smem=int(rng.choice([0, 0, 2048, 9000])))
        ids.append(d.register_model(f"m{m}", PlanAdaptor(plan), profile_runs=0))
    ids.append(d.register_model("fork", TwoStreams(), profile_runs=0))
    return ids


def truth(dev):
    res = dev.resources
    spec = dev.props
    n = spec.sm_count
    per_sm = [(spec.max_blocks_per_sm - res.blocks[s], spec.max_warps_per_sm - res.warps[s],
               res.parts * res.part_regs - sum(res.regs[s * res.parts:(s + 1) * res.parts]),
               spec.smem_per_sm - res.smem[s]) for s in range(n)]
    return res.used(), per_sm


def _no_completion(op, t_first):
    raise AssertionError(f"{op} completed between a step and the device's next event")


def drive(d, dev, rng, n_jobs, check):
    """Submit jobs at random times; after every device event, drain and compare."""
    rec = Recorder()
    models = random_models(d, rng)
    t_next = 0.0
    sent = 0
    while sent < n_jobs or d.in_flight:
        if sent < n_jobs and dev.now() >= t_next:
            mid = models[int(rng.integers(len(models)))]
            d.submit(rec.request(sent, mid, 256))
            sent += 1
            t_next = dev.now() + float(rng.exponential(60e-6))
        d.step()
        # What the next step would read first: the placements of what this step released
        # (completions only appear while the device runs, below).
        d.tracker.drain(dev.now(), _no_completion)
        check()
        nxt = dev.next_event_time()
        if sent < n_jobs:
            nxt = min(nxt, max(t_next, dev.now()))
        if nxt == float("inf"):
            assert d.in_flight == 0
            break
        dev.run_until(nxt)
    return rec


@pytest.mark.parametrize("seed", [1, 2])
def test_tracker_matches_the_simulator_exactly_without_aggregation(make, seed):
    dev, d = make("paella", gpu="t4", group=1, seed=seed, notifq_slots=1 << 14)
    rng = np.random.default_rng(seed)
    checks = []

    def check():
        used, per_sm = truth(dev)
        assert d.tracker.used() == used
        t = d.tracker
        assert per_sm == list(zip(t.sm_blocks, t.sm_warps, t.sm_regs, t.sm_smem))
        checks.append(used["blocks"])

    rec = drive(d, dev, rng, 60, check)
    assert len(rec.done) == 60 and all(v[0] == STATUS_OK for v in rec.done.values())
    assert max(checks) > 0                  # the comparison saw a busy GPU


def test_tracker_is_within_one_group_per_kernel_with_aggregation(make):
    dev, d = make("paella", gpu="t4", group=16, seed=3)
    rng = np.random.default_rng(3)
    worst = [0.0]

    def check():
        used, _ = truth(dev)
        mine = d.tracker.used()
        inflight = list(d.tracker.launches.values())
        fps = [(1, op.launch.fp.warps, op.launch.fp.regs, op.launch.fp.smem) for op in inflight]
        for i, k in enumerate(KEYS):
            bound = sum(16 * f[i] for f in fps)
            diff = abs(mine[k] - used[k])
            assert diff < bound or diff == 0, (k, diff, bound)
        worst[0] = max(worst[0], abs(mine["blocks"] - used["blocks"]))

    rec = drive(d, dev, rng, 60, check)
    assert len(rec.done) == 60
    assert worst[0] > 0                     # aggregation did make the totals lag


def serve_uneven_conv(group: int, requests: int = 4) -> tuple[int, set]:
    """Requests of three launches of ResNet-18's first convolution as compiled (98 blocks
    of 128 threads, modelled work: uneven waves on the T4, so blocks end in another order
    than they were placed), stepped event by event: the lowest per-SM usage seen, and the
    set of per-SM usages left after the last completion. (Also run under the sanitizers.)"""
    from paella.dispatcher.adaptor import Plan, PlanAdaptor, PlanOp
    from paella.dispatcher.core import Dispatcher
    from paella.dispatcher.devices.base import KernelInfo
    from paella.dispatcher.devices.sim import SimDevice
    dev = SimDevice("t4", seed=5)
    d = Dispatcher(dev, "paella", group=group, profile_runs=0)
    conv = KernelInfo("conv", 72, static_smem=6912, flops=231813120.0, bytes=1753600.0)
    plan = Plan("conv", [conv], [PlanOp("launch", kernel="conv", grid=(98, 1, 1),
                                        block=(8, 16, 1))] * 3, {}, 64)
    mid = d.register_model("conv", PlanAdaptor(plan))
    rec = Recorder()
    lowest = 0
    for i in range(requests):
        d.submit(rec.request(i, mid, 64))
        while d.in_flight:
            d.step()
            t = d.tracker
            lowest = min(lowest, *t.sm_blocks, *t.sm_warps, *t.sm_regs, *t.sm_smem)
            if d.in_flight:
                dev.run_until(dev.next_event_time())
    assert len(rec.done) == requests and all(v[0] == STATUS_OK for v in rec.done.values())
    t = d.tracker
    return lowest, {*t.sm_blocks, *t.sm_warps, *t.sm_regs, *t.sm_smem}


@pytest.mark.parametrize("group", [1, 4, 16])
def test_per_sm_usage_with_aggregation_never_drifts(group):
    """A group's placement entry and its completion entry name the SMs of the blocks that
    posted them, which differ when blocks end in another order than they were placed:
    per-SM usage must never go negative, nor stay above zero once everything has
    completed (it drifted by up to 18 blocks per SM per request of this kernel)."""
    assert serve_uneven_conv(group) == (0, {0})


def test_small_notifq_never_overruns(make):
    """64 slots with group 1: flow control holds kernels back instead of overrunning."""
    dev, d = make("ms-kbk", notifq_slots=64, group=1)
    mid = d.register_model("c", chain("c", 4, grid=20), profile_runs=0)
    rec = Recorder()
    for i in range(30):
        d.submit(rec.request(i, mid, 512))
    d.run_until_idle()                      # the simulator raises NotifQOverrun on overrun
    assert len(rec.done) == 30 and all(v[0] == STATUS_OK for v in rec.done.values())


@pytest.mark.parametrize("profile_runs", [0, 2])
def test_kernel_posting_more_entries_than_the_ring_is_refused(make, profile_runs):
    """The model registers (with or without profiling runs: a plan that cannot run has
    nothing to profile) and each request fails with the reason, named once."""
    dev, d = make("paella", notifq_slots=64, group=1)
    mid = d.register_model("big", chain("big", 1, grid=40), profile_runs=profile_runs)
    rec = Recorder()
    d.submit(rec.request(0, mid, 512))
    d.run_until_idle()
    assert "notifQ" in rec.done[0][1] and "notifq_slots" in rec.done[0][1]
    assert rec.done[0][1].count("ValueError") == 1, rec.done[0][1]


def test_a_model_whose_profiling_fails_is_not_left_registered(make):
    """register_model raises, and the name and id stay free for a corrected model."""
    from dispatch_helpers import TwoStreams

    class Failing(TwoStreams):
        def run(self, io):
            raise RuntimeError("broken model")

    dev, d = make("paella")
    with pytest.raises(RuntimeError, match="profiling run of model 'fork' failed: .*broken model"):
        d.register_model("fork", Failing(), model_id=7)
    assert 7 not in d.models
    assert d.register_model("fork", TwoStreams(), model_id=7) == 7


def kernel_op(spec, blocks, threads=128, regs=32, group=16):
    """A launch's tracker record (the tracker reads nothing else of a launch)."""
    fp = footprint(spec, threads, regs)
    return Demand(blocks, fp.warps, fp.regs, fp.smem, 2 * -(-blocks // group))


def release(t, d):
    """Release demand ``d`` with itself as the token."""
    return t.release(d, d)


def test_plus_b_rule_releases_until_full_plus_b():
    spec = preset("gtx1660s")               # 22 SMs x 8 blocks of 128 threads = 176
    t = Tracker(spec, np.zeros(1 << 12, np.uint64), extra_blocks=10, group=1)
    released = 0
    while t.admits(kernel_op(spec, 1, group=1)):
        release(t, kernel_op(spec, 1, group=1))
        released += 1
    # Nothing placed yet: the free resources hold 176 such blocks, plus B = 10.
    assert released == 176 + 10


def test_plus_b_rule_always_admits_onto_an_empty_queue():
    spec = preset("gtx1660s")
    t = Tracker(spec, np.zeros(1 << 14, np.uint64), extra_blocks=0, group=16)
    huge = kernel_op(spec, 5000)             # larger than the whole GPU: runs in waves
    assert t.admits(huge)
    release(t, huge)
    assert not t.admits(kernel_op(spec, 1))  # held back while its waves are unplaced


def test_launch_ids_never_share_a_counter_pair_in_flight():
    spec = preset("gtx1660s")
    t = Tracker(spec, np.zeros(1 << 12, np.uint64), extra_blocks=10 ** 6, group=16,
                counter_pairs=8)
    ops = [kernel_op(spec, 1) for _ in range(8)]
    ids = [release(t, op) for op in ops]
    assert len({i & 7 for i in ids}) == 8
    assert not t.flow_ok(kernel_op(spec, 1))  # all eight pairs in use


def test_fits_now_counts_what_is_released_and_not_yet_placed():
    spec = preset("gtx1660s")               # 176 blocks of 128 threads fit
    t = Tracker(spec, np.zeros(1 << 12, np.uint64), extra_blocks=10, group=1)
    assert t.fits_now(kernel_op(spec, 176))
    assert not t.fits_now(kernel_op(spec, 177))
    release(t, kernel_op(spec, 100))         # unplaced, but it will take its room
    assert t.fits_now(kernel_op(spec, 76))
    assert not t.fits_now(kernel_op(spec, 77))


def test_malformed_notifq_entries_are_refused_with_the_reason():
    """An unknown kind is consumed and named, and the tracker's totals are not touched by
    it. An SM id past the SM count is not malformed (%smid need not be contiguous): it
    counts, and the per-SM figures fold it in."""
    spec = preset("gtx1660s")
    ring = np.zeros(64, np.uint64)
    t = Tracker(spec, ring, extra_blocks=10, group=2)
    op = kernel_op(spec, 2, group=2)
    lid = release(t, op)
    ring[0] = (3 << protocol.KIND_SHIFT) | (1 << protocol.COUNT_SHIFT) | lid     # kind 3
    with pytest.raises(RuntimeError, match="malformed"):
        t.drain(0.0, lambda op, t0: None)
    assert t.head == 1 and not ring[:1].any() and t.blocks == 0 and t.unplaced == 2
    ring[1] = protocol.encode(protocol.PLACEMENT, spec.sm_count + 3, 1, lid)    # SM 25 of 0..21
    ring[2] = protocol.encode(protocol.PLACEMENT, 0, 1, lid)
    assert t.drain(1.0, lambda op, t0: None) == 2 and t.blocks == 2 and t.progress(lid)[0] == 2
    assert t.sm_blocks[3] == 1 and t.sm_blocks[0] == 1 and sum(t.sm_blocks) == 2
    ring[3] = protocol.encode(protocol.COMPLETION, 255, 2, lid)                # ends: all back
    assert t.drain(2.0, lambda op, t0: None) == 1 and t.blocks == 0 and set(t.sm_blocks) == {0}


def test_a_raising_completion_callback_loses_no_state():
    """on_done raising does not stop the batch: every finished launch is still
    reported, the ring is consumed, the counter pairs are free again, and the first
    error is raised at the end."""
    spec = preset("gtx1660s")
    ring = np.zeros(64, np.uint64)
    t = Tracker(spec, ring, extra_blocks=10, group=1, counter_pairs=4)
    ops = [kernel_op(spec, 1, group=1) for _ in range(3)]
    for i, op in enumerate(ops):
        lid = release(t, op)
        ring[2 * i] = protocol.encode(protocol.PLACEMENT, 0, 1, lid)
        ring[2 * i + 1] = protocol.encode(protocol.COMPLETION, 0, 1, lid)
    seen = []

    def boom(op, t_first):
        seen.append(op)
        assert t_first == 0.5
        if len(seen) == 1:
            raise KeyError("callback 1")
    with pytest.raises(KeyError, match="callback 1"):
        t.drain(0.5, boom)
    assert seen == ops
    assert t.head == 6 and t.in_flight() == 0 and t.blocks == 0 and t.launches == {}
    assert t.pending_entries == 0 and t.flow_ok(kernel_op(spec, 1))


@pytest.mark.parametrize("kind,count", [(protocol.PLACEMENT, 0), (protocol.PLACEMENT, 3),
                                        (protocol.COMPLETION, 3)])
def test_block_counts_outside_the_group_or_the_launch_are_malformed(kind, count):
    spec = preset("gtx1660s")
    ring = np.zeros(64, np.uint64)
    t = Tracker(spec, ring, extra_blocks=10, group=4)
    lid = release(t, kernel_op(spec, 2, group=4))        # 2 blocks: 3 placed or ended is wrong
    ring[0] = (kind << protocol.KIND_SHIFT) | (count << protocol.COUNT_SHIFT) | lid
    with pytest.raises(RuntimeError, match="malformed|more blocks than its launch"):
        t.drain(0.0, lambda op, t0: None)
    assert t.head == 1 and t.blocks == 0 and t.unplaced == 2 and t.in_flight() == 1


def test_a_tracker_without_init_or_a_bad_ring_is_refused():
    from paella.dispatcher.tracker import TrackerCore
    bare = TrackerCore.__new__(TrackerCore)
    d = kernel_op(preset("gtx1660s"), 1)
    for call in (lambda: bare.drain(0.0, print), lambda: bare.release(d, d),
                 lambda: bare.unrelease(1), lambda: bare.admits(d), lambda: bare.ring):
        with pytest.raises(RuntimeError, match="__init__ was not called"):
            call()
    spec = preset("gtx1660s")
    misaligned = np.zeros(8 * 65, np.uint8)[4:4 + 8 * 64].view(np.uint64)
    assert misaligned.flags.writeable and not misaligned.flags.aligned
    with pytest.raises(ValueError, match="aligned"):
        Tracker(spec, misaligned, extra_blocks=1, group=1)
    with pytest.raises(ValueError, match="power of two"):
        Tracker(spec, np.zeros(48, np.uint64), extra_blocks=1, group=1)


def test_unrelease_returns_the_launch_and_its_demand():
    spec = preset("gtx1660s")
    t = Tracker(spec, np.zeros(64, np.uint64), extra_blocks=10, group=1, counter_pairs=2)
    op = kernel_op(spec, 5, group=1)
    lid = release(t, op)
    assert t.unplaced == 5 and t.in_flight() == 1 and t.pending_entries == 10
    t.unrelease(lid)
    assert t.unplaced == t.d_warps == t.d_regs == 0 and t.in_flight() == 0
    assert t.pending_entries == 0 and t.launches == {}
    with pytest.raises(ValueError, match="not in flight"):
        t.unrelease(lid)
    ring = t.ring
    lid = release(t, op)
    ring[0] = protocol.encode(protocol.PLACEMENT, 0, 1, lid)
    t.drain(0.0, lambda op, t0: None)
    with pytest.raises(ValueError, match="blocks on the GPU already"):
        t.unrelease(lid)


def test_a_launch_behind_a_running_kernel_is_not_unplaced_work_until_that_kernel_ends():
    """Lookahead: a kernel queued behind its stream's running kernel cannot start before
    that one ends, so it does not hold other releases back under the +B rule meanwhile
    (it made paella at lookahead 2 serve 561 of Figure 11's 800 requests/s). Its demand
    counts once the kernel ahead ends, or as soon as a block of it is reported placed;
    withdrawing either one leaves the accounting whole."""
    spec = preset("gtx1660s")               # 176 blocks of 128 threads fit
    ring = np.zeros(1 << 12, np.uint64)
    t = Tracker(spec, ring, extra_blocks=10, group=1)
    first = kernel_op(spec, 176, group=1)
    a = release(t, first)
    ring[0] = protocol.encode(protocol.PLACEMENT, 0, 1, a)          # one block of it placed
    t.drain(0.0, lambda op, t0: None)
    nxt = kernel_op(spec, 150, group=1)
    b = t.release(nxt, nxt, a)                                      # behind `a`
    assert t.unplaced == 175 and t.deferred == 150
    assert t.admits(kernel_op(spec, 1, group=1))                    # 175 + 1 within 176 + 10
    # Without the deferral the same release would have held everything back.
    u = Tracker(spec, np.zeros(1 << 12, np.uint64), extra_blocks=10, group=1)
    release(u, first)
    release(u, nxt)
    assert u.deferred == 0 and not u.admits(kernel_op(spec, 1, group=1))
    # A third kernel behind the deferred one is judged as if that one counted (a lone
    # job's lookahead as before deferral); without the launch id, against what counts.
    third = kernel_op(spec, 150, group=1)
    assert not t.admits_after(third, nxt, b)
    assert t.admits_after(third, nxt)
    # The kernel ahead placed and ended: the one behind counts from then on.
    t2 = Tracker(spec, np.zeros(1024, np.uint64), extra_blocks=10, group=1)
    x = release(t2, first)
    y = t2.release(nxt, nxt, x)
    r2 = t2.ring
    for k in range(176):
        r2[k] = protocol.encode(protocol.PLACEMENT, k % spec.sm_count, 1, x)
    t2.drain(0.0, lambda op, t0: None)
    assert t2.unplaced == 0 and t2.deferred == 150
    for k in range(176):
        r2[176 + k] = protocol.encode(protocol.COMPLETION, k % spec.sm_count, 1, x)
    done = []
    t2.drain(1.0, lambda op, t0: done.append(op))
    assert done == [first] and t2.unplaced == 150 and t2.deferred == 0
    r2[352] = protocol.encode(protocol.PLACEMENT, 0, 1, y)
    t2.drain(2.0, lambda op, t0: None)
    assert t2.unplaced == 149
    # Placed before its predecessor's end was read: it counts at its first placement.
    t3 = Tracker(spec, np.zeros(64, np.uint64), extra_blocks=10, group=1)
    p = release(t3, kernel_op(spec, 4, group=1))
    q = t3.release(kernel_op(spec, 3, group=1), "q", p)
    assert t3.unplaced == 4 and t3.deferred == 3
    t3.ring[0] = protocol.encode(protocol.PLACEMENT, 0, 1, q)
    t3.drain(0.0, lambda op, t0: None)
    assert t3.unplaced == 4 + 3 - 1 and t3.deferred == 0
    # Withdrawn: the deferred one's demand was never counted; withdrawing the kernel
    # ahead lets the one behind count.
    t4 = Tracker(spec, np.zeros(64, np.uint64), extra_blocks=10, group=1)
    p = release(t4, kernel_op(spec, 4, group=1))
    q = t4.release(kernel_op(spec, 3, group=1), "q", p)
    t4.unrelease(q)
    assert t4.unplaced == 4 and t4.deferred == 0
    q = t4.release(kernel_op(spec, 3, group=1), "q", p)
    t4.unrelease(p)
    assert t4.unplaced == 3 and t4.deferred == 0
    # A launch id that is not an int is a TypeError, and nothing is released.
    before = t4.in_flight()
    with pytest.raises(TypeError):
        t4.release(kernel_op(spec, 2, group=1), "x", "not an id")
    with pytest.raises(TypeError):
        t4.admits_after(kernel_op(spec, 2, group=1), kernel_op(spec, 2, group=1), 1.5)
    assert t4.unplaced == 3 and t4.in_flight() == before
    # Behind a launch not in flight (or itself): released as usual.
    r = t4.release(kernel_op(spec, 2, group=1), "r", p)
    assert t4.unplaced == 5 and t4.deferred == 0
    del b, r


def test_a_finished_dispatcher_is_garbage_collected(make):
    """The C half holds references to the ops in flight (and they to their jobs and
    the dispatcher): the cycle must be visible to the garbage collector."""
    import gc
    import weakref
    dev, d = make("paella")
    mid = d.register_model("c", chain("c", 3))
    rec = Recorder()
    for i in range(4):
        d.submit(rec.request(i, mid, 320))
    for _ in range(3):                    # leave launches in flight
        d.step()
        dev.run_until(dev.next_event_time())
    assert d.tracker.in_flight() > 0
    ref = weakref.ref(d.tracker)
    del d, dev
    gc.collect()
    assert ref() is None


def test_the_tracker_takes_only_a_demand_and_gives_the_token_back():
    """The launch record is explicit: anything but a Demand is refused; the token is
    opaque (any object), handed to on_start and on_done with no attribute touched."""
    spec = preset("gtx1660s")
    ring = np.zeros(64, np.uint64)
    t = Tracker(spec, ring, extra_blocks=10, group=1)
    with pytest.raises(TypeError, match="Demand"):
        t.admits(object())
    with pytest.raises(ValueError, match="blocks >= 1"):
        Demand(0, 4, 1024, 0, 2)
    token = ("any", "object")                # a tuple has no attributes to set
    lid = t.release(kernel_op(spec, 1, group=1), token)
    ring[0] = protocol.encode(protocol.PLACEMENT, 0, 1, lid)
    ring[1] = protocol.encode(protocol.COMPLETION, 0, 1, lid)
    started, done = [], []
    assert t.drain(2.5, lambda tok, t0: done.append((tok, t0)), started.append) == 2
    assert started == [token] and done == [(token, 2.5)]


def test_a_profiling_run_its_owner_stops_gives_up_and_leaves_nothing_in_flight(make):
    """The daemon's SIGTERM during start-up (``profile_stop``): the run gives up at the
    next loop pass instead of waiting up to 60 s, its job is cancelled and drained, and
    the model is not registered."""
    from dispatch_helpers import TwoStreams

    closed = []

    class Watched(TwoStreams):
        def close(self, dev):
            closed.append(True)
            super().close(dev)

    dev, d = make("paella")
    passes = []
    d.profile_stop = lambda: passes.append(1) or len(passes) > 3
    with pytest.raises(RuntimeError, match="profiling run of model 'fork' failed: "
                                           "run_until_idle: stopped with 1 requests in flight"):
        d.register_model("fork", Watched(), model_id=7)
    assert 7 not in d.models and not d.jobs and d.in_flight == 0 and closed == [True]
    d.profile_stop = None
    assert d.register_model("fork", TwoStreams(), model_id=7) == 7
