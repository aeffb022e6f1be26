"""Lookahead: up to L kernels of a job's stream released and not completed, each queued
behind its predecessor (a kernel or a copy) on the predecessor's real stream, and a copy
likewise behind a released predecessor; L = 1 is the release rule unchanged."""
from __future__ import annotations

import numpy as np
import pytest

from paella.dispatcher.core import STATUS_OK, Request, MAX_LOOKAHEAD
from paella.dispatcher.devices.base import D2H, H2D, KERNEL
from paella.dispatcher.instruments import Instrument

from dispatch_helpers import chain


class Flight(Instrument):
    """Kernels released and not ended, per job and real stream, over time."""

    def __init__(self):
        self.live: dict = {}
        self.most = 0
        self.log: list[tuple] = []

    def op_released(self, op, t):
        self.log.append(("rel", op.kind, op.key, op.stream, t))
        if op.kind == KERNEL:
            k = (op.job.seq, op.vstream.vid)
            self.live[k] = self.live.get(k, 0) + 1
            self.most = max(self.most, self.live[k])

    def op_ended(self, op, t):
        self.log.append(("end", op.kind, op.key, op.stream, t))
        if op.kind == KERNEL:
            self.live[(op.job.seq, op.vstream.vid)] -= 1


def serve(make, lookahead: int, jobs: int = 1):
    dev, d = make("paella", lookahead=lookahead, instruments=[fl := Flight()])
    mid = d.register_model("c", chain("c", 6))
    fl.log.clear()
    fl.most = 0
    reqs = [Request(i, i, mid, np.zeros(d.models[mid].adaptor.io_bytes, np.uint8))
            for i in range(jobs)]
    for r in reqs:
        d.submit(r)
    d.run_until_idle()
    assert all(r.status == STATUS_OK for r in reqs)
    return fl, reqs


@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_a_chain_runs_at_most_lookahead_kernels_ahead_on_one_real_stream(make, lookahead):
    fl, (req,) = serve(make, lookahead)
    assert fl.most == lookahead
    kernels = [row for row in fl.log if row[0] == "rel" and row[1] == KERNEL]
    assert len(kernels) == 6
    if lookahead > 1:                      # each queued behind its predecessor
        assert len({row[3] for row in kernels}) == 1
        assert kernels[1][4] < next(r[4] for r in fl.log if r[0] == "end" and r[2] == "c_k0")
    # the D2H copy: behind the last kernel, on its stream, before it ends (lookahead);
    # with L = 1 only once the loop has seen it end
    d2h = next(row for row in fl.log if row[0] == "rel" and row[1] == D2H)
    last_end = next(r[4] for r in fl.log if r[0] == "end" and r[2] == "c_k5")
    if lookahead > 1:
        assert d2h[4] < last_end and d2h[3] == kernels[-1][3], fl.log
    else:
        assert d2h[4] >= last_end


@pytest.mark.parametrize("lookahead", [1, 3])
def test_the_first_kernels_wait_behind_the_input_copy_on_the_gpu(make, lookahead):
    """Lookahead across a copy: the input copy's kernel successor is released while the
    copy is in flight, behind it on its stream (the GPU starts it when the copy ends, not
    the loop once it has seen the copy end); with L = 1 it waits for the copy's end."""
    fl, (req,) = serve(make, lookahead)
    h2d = next(row for row in fl.log if row[0] == "rel" and row[1] == H2D)
    h2d_end = next(row for row in fl.log if row[0] == "end" and row[1] == H2D)
    first = [row for row in fl.log if row[0] == "rel" and row[1] == KERNEL][:lookahead]
    if lookahead > 1:
        assert all(row[4] < h2d_end[4] and row[3] == h2d[3] for row in first), fl.log
        assert fl.most == lookahead
    else:
        assert first[0][4] >= h2d_end[4]


def test_lookahead_keeps_every_job_correct_under_load(make):
    for lookahead in (1, 3):
        fl, reqs = serve(make, lookahead, jobs=12)
        assert fl.most <= lookahead


@pytest.mark.parametrize("bad", (0, MAX_LOOKAHEAD + 1, 10 ** 20))
def test_lookahead_must_be_one_to_its_bound(make, bad):
    with pytest.raises(ValueError, match=f"lookahead must be an int 1..{MAX_LOOKAHEAD}"):
        make("paella", lookahead=bad)


def test_a_kernel_that_fills_the_gpu_has_its_successor_queued_behind_it(make):
    """Each kernel of the chain fills every SM of the simulated T4 (80 blocks of 1,024
    threads: two per SM), so the plain +B rule refuses the next one while it runs. Queued
    behind it on its stream, the next cannot start before it ends: it is admitted against
    the resources its predecessor frees (Tracker.admits_after), and released before the
    predecessor ends."""
    dev, d = make("paella", lookahead=3, instruments=[fl := Flight()])
    mid = d.register_model("wide", chain("wide", 4, grid=80, block=1024))
    fl.log.clear()
    req = Request(1, 1, mid, np.zeros(d.models[mid].adaptor.io_bytes, np.uint8))
    d.submit(req)
    d.run_until_idle()
    assert req.status == STATUS_OK
    rel = {r[2]: r[4] for r in fl.log if r[0] == "rel" and r[1] == KERNEL}
    end = {r[2]: r[4] for r in fl.log if r[0] == "end" and r[1] == KERNEL}
    for i in range(1, 4):
        assert rel[f"wide_k{i}"] < end[f"wide_k{i - 1}"]
    assert fl.most == 3


def test_admits_after_credits_only_the_predecessor(make):
    """The rule itself: a GPU-filling launch is refused while an equal one is resident,
    admitted once that one's resources are credited, refused again when the credit is a
    launch too small to make room."""
    dev, d = make("paella", lookahead=3)
    d.register_model("wide", chain("wide", 1, grid=80, block=1024))
    t = d.tracker
    k = next(kl for kl in d._launches.values() if kl.blocks == 80)
    small = t.demand(k.fp, 1)
    t.release(k.demand, object())
    assert not t.admits(k.demand)
    assert t.admits_after(k.demand, k.demand)
    assert not t.admits_after(k.demand, small)
    with pytest.raises(TypeError):
        t.admits_after(k.demand)


@pytest.mark.parametrize("kernel_core", ["python", "c"])
def test_kernels_queued_behind_their_stream_do_not_hold_other_jobs_back(make, kernel_core):
    """A kernel looked ahead waits behind its stream's running kernel; it is no work
    waiting for free resources until that one ends (Tracker's deferred demand). Counted
    as such, every job's looked-ahead kernel held the others' releases back under the +B
    rule: eight jobs of quarter-GPU kernels ran nearly one at a time (Figure 11's mix at
    lookahead 2 served 561 of 800 requests/s). Now they run side by side as at L = 1."""
    span = {}
    for lookahead in (1, 2):
        dev, d = make("paella", lookahead=lookahead, kernel_core=kernel_core)
        # gtx1660s: 22 SMs x 8 blocks of 128 threads; 44 blocks is a quarter of it
        mid = d.register_model("q", chain("q", 8, grid=44, seconds=200e-6))
        t0 = dev.now()
        reqs = [Request(i, i, mid, np.zeros(d.models[mid].adaptor.io_bytes, np.uint8))
                for i in range(8)]
        for r in reqs:
            d.submit(r)
        d.run_until_idle()
        assert all(r.status == STATUS_OK for r in reqs)
        span[lookahead] = dev.now() - t0
    assert span[2] <= 1.05 * span[1], span
