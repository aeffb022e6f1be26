"""Jobs through the whole dispatcher on the simulated GPU: completion, the CUDA-like
API, failures that stay inside their request, cancellation."""
from __future__ import annotations

import numpy as np
import pytest

from paella.dispatcher import cudart as cuda
from paella.dispatcher.adaptor import JobAdaptor, Plan, PlanOp
from paella.dispatcher.core import STATUS_CANCELLED, STATUS_ERROR, STATUS_OK, Request
from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher.job import NotInJobError
from paella.occupancy import OccupancyError

from dispatch_helpers import Recorder, TwoStreams, chain

ALL = ["paella", "fifo", "ms-jbj", "ms-kbk", "sjf", "rr", "priority"]


def submit_mix(d, rec, models, n, seed=0):
    rng = np.random.default_rng(seed)
    for i in range(n):
        mid = int(rng.integers(len(models)))
        d.submit(rec.request(i, mid, d.models[mid].adaptor.io_bytes, client=i % 3))


@pytest.mark.parametrize("policy", ALL)
def test_every_policy_completes_every_job(make, policy):
    dev, d = make(policy)
    models = [d.register_model("short", chain("short", 3)),
              d.register_model("long", chain("long", 12, grid=40)),
              d.register_model("fork", TwoStreams())]
    rec = Recorder()
    submit_mix(d, rec, models, 40)
    d.run_until_idle()
    assert sorted(rec.done) == list(range(40))
    assert all(st == STATUS_OK for st, _, _ in rec.done.values())
    assert sorted(rec.almost) == list(range(40))
    assert d.in_flight == 0 and not d.jobs
    assert d.tracker.in_flight() == 0 and d.tracker.used()["blocks"] == 0
    assert d.tracker.unplaced == 0 and d.tracker.pending_entries == 0
    assert not dev.gpu.busy()


def test_outputs_are_copied_back_in_stream_order(make):
    """A job's D2H copy lands after its H2D: the io buffer sees device contents."""
    dev, d = make("paella")

    class Echo(JobAdaptor):
        io_bytes = 16

        def init(self, device):
            info = KernelInfo("noop", 16, duration=10e-6)
            self.k = device.load_module(ModuleImage("echo", [info]))["noop"]

        def run(self, io):
            buf = cuda.malloc(8)
            cuda.memcpy_htod(buf, io[:8])
            cuda.launch(self.k, 4, 32)
            cuda.memcpy_dtoh(io[8:], buf)
            cuda.device_synchronize()

    mid = d.register_model("echo", Echo(), profile_runs=0)
    rec = Recorder()
    req = rec.request(1, mid, 16)
    req.io[:8] = np.arange(1, 9, dtype=np.uint8)
    d.submit(req)
    d.run_until_idle()
    assert rec.done[1][0] == STATUS_OK
    assert list(req.io[8:]) == list(range(1, 9))


def test_adaptor_that_raises_fails_only_its_request(make):
    dev, d = make("paella")
    good = d.register_model("good", chain("good", 4))

    class Broken(JobAdaptor):
        io_bytes = 8

        def init(self, device):
            self.k = device.load_module(ModuleImage("b", [KernelInfo("bk", 32, duration=1e-4)]))["bk"]

        def run(self, io):
            cuda.launch(self.k, 30, 128)      # released work must still drain
            cuda.launch(self.k, 30, 128)
            raise KeyError("missing weights for layer 3")

    bad = d.register_model("bad", Broken(), profile_runs=0)
    rec = Recorder()
    for i in range(10):
        mid = bad if i == 4 else good
        d.submit(rec.request(i, mid, 512))
    d.run_until_idle()
    assert rec.done[4][0] == STATUS_ERROR
    assert "missing weights for layer 3" in rec.done[4][1]
    assert all(rec.done[i][0] == STATUS_OK for i in range(10) if i != 4)
    assert d.tracker.in_flight() == 0 and d.tracker.used()["blocks"] == 0


def test_kernel_that_cannot_fit_is_refused_clearly(make):
    dev, d = make("paella")

    class TooBig(JobAdaptor):
        def init(self, device):
            self.k = device.load_module(ModuleImage("t", [KernelInfo("huge", 72)]))["huge"]

        def run(self, io):
            cuda.launch(self.k, 1, 1024)      # 1024 threads x 72 regs > the register file

    mid = d.register_model("toobig", TooBig(), profile_runs=0)
    rec = Recorder()
    d.submit(rec.request(0, mid, 0))
    d.run_until_idle()
    status, error, _ = rec.done[0]
    assert status == STATUS_ERROR
    assert "OccupancyError" in error and "huge" in error and "per-block limit" in error


def test_plan_with_unfittable_kernel_is_refused_at_registration(make):
    dev, d = make("paella")
    plan = Plan("p", [KernelInfo("fat", 8, static_smem=200 * 1024)],
                [PlanOp("launch", kernel="fat", grid=(1,), block=(32,))])
    from paella.dispatcher.adaptor import PlanAdaptor
    with pytest.raises(OccupancyError, match="fat"):
        d.register_model("p", PlanAdaptor(plan))


def test_synchronize_with_nothing_pending_returns_at_once(make):
    dev, d = make("paella")
    seen = []

    class Idle(JobAdaptor):
        def run(self, io):
            it = d.iterations
            cuda.device_synchronize()
            cuda.stream_synchronize()
            e = cuda.event_create()
            cuda.event_synchronize(e)
            s = cuda.stream_create()
            cuda.stream_synchronize(s)
            seen.append(d.iterations - it)

    mid = d.register_model("idle", Idle(), profile_runs=0)
    rec = Recorder()
    d.submit(rec.request(0, mid, 0))
    d.step()
    assert seen == [0]                        # no yield: the same loop iteration
    assert rec.done[0][0] == STATUS_OK


def test_synchronize_yields_until_the_work_completes(make):
    dev, d = make("paella")
    log = []

    class Sync(JobAdaptor):
        def init(self, device):
            self.k = device.load_module(ModuleImage("s", [KernelInfo("k", 16, duration=1e-3)]))["k"]

        def run(self, io):
            s = cuda.stream_create()
            cuda.launch(self.k, 2, 64, s)
            log.append(("issued", dev.now(), cuda.stream_query(s)))
            cuda.stream_synchronize(s)
            log.append(("synced", dev.now(), cuda.stream_query(s)))

    mid = d.register_model("sync", Sync(), profile_runs=0)
    d.submit(Recorder().request(0, mid, 0))
    d.run_until_idle()
    assert log[0][2] is False and log[1][2] is True
    assert log[1][1] - log[0][1] >= 1e-3


def test_cuda_calls_outside_a_job_raise():
    with pytest.raises(NotInJobError, match="inside a job"):
        cuda.stream_create()


def test_bad_requests_are_refused(make):
    dev, d = make("paella")
    with pytest.raises(ValueError, match="unknown model id"):
        d.submit(Request(1, 0, 7, np.zeros(4, np.uint8)))
    mid = d.register_model("c", chain("c", 1), profile_runs=0)
    with pytest.raises(ValueError, match="uint8"):
        d.submit(Request(1, 0, mid, np.zeros(4, np.float32)))
    with pytest.raises(ValueError, match="already registered"):
        d.register_model("c", chain("c", 1))


def test_cancel_client_stops_its_jobs_and_keeps_others(make):
    dev, d = make("paella")
    mid = d.register_model("long", chain("long", 20, grid=40, seconds=200e-6))
    rec = Recorder()
    for i in range(6):
        d.submit(rec.request(i, mid, 512, client=i % 2))
    for _ in range(5):
        d.step()
        dev.run_until(dev.next_event_time())
    assert d.cancel_client(1) == 3
    d.run_until_idle()
    assert {i for i, v in rec.done.items() if v[0] == STATUS_CANCELLED} == {1, 3, 5}
    assert {i for i, v in rec.done.items() if v[0] == STATUS_OK} == {0, 2, 4}
    assert d.tracker.in_flight() == 0


def test_almost_finished_precedes_completion_and_the_last_copy(make):
    dev, d = make("paella")
    mid = d.register_model("c", chain("c", 5))
    order = []
    req = Request(9, 0, mid, np.zeros(320, np.uint8),
                  on_almost_finished=lambda r: order.append(("almost", dev.now())),
                  on_complete=lambda r, s, e: order.append(("done", dev.now())))
    d.submit(req)
    d.run_until_idle()
    assert [o[0] for o in order] == ["almost", "done"]
    assert order[1][1] > order[0][1]          # sent while the D2H copy was in flight


def test_profiling_seeds_the_remaining_time_estimate(make):
    dev, d = make("paella")
    mid = d.register_model("c", chain("c", 6, seconds=100e-6), profile_runs=2)
    prof = d.models[mid].profile
    assert prof.jobs == 2
    assert set(prof.kernels) == {f"c_k{i}" for i in range(6)}
    assert all(k.count == pytest.approx(1.0) for k in prof.kernels.values())
    assert prof.total == pytest.approx(6 * 100e-6, rel=0.2)


def test_copy_the_device_refuses_fails_only_its_request(make):
    dev, d = make("paella")
    good = d.register_model("good", chain("good", 2))

    class BadPointer(JobAdaptor):
        io_bytes = 8

        def run(self, io):
            cuda.memcpy_htod(0xdead0000, io)
            cuda.device_synchronize()

    bad = d.register_model("badptr", BadPointer(), profile_runs=0)
    rec = Recorder()
    d.submit(rec.request(0, bad, 8))
    d.submit(rec.request(1, good, 512))
    d.run_until_idle()
    assert rec.done[0][0] == STATUS_ERROR and "outside every allocation" in rec.done[0][1]
    assert rec.done[1][0] == STATUS_OK


def test_an_urgent_long_job_runs_ahead_of_short_ones_under_classes(make):
    """Eight short jobs at the default class and one long job, all submitted together,
    each kernel filling the GPU. Without a class SRPT (paella) runs the long job last.
    As class 1 (urgent), paella orders by class first and runs it early; the priority
    policy runs its chain back to back: a less urgent kernel is held while an urgent one
    runs, so none slips into the gap between two of them (only short jobs whose first
    kernel went before the urgent job's input had arrived may finish first)."""
    def latencies(policy, priority):
        dev, d = make(policy)
        short = d.register_model("short", chain("short", 3, grid=160))
        long_ = d.register_model("long", chain("long", 12, grid=160))
        rec = Recorder()
        for i in range(8):
            d.submit(rec.request(i, short, d.models[short].adaptor.io_bytes, client=i))
        urgent = rec.request(8, long_, d.models[long_].adaptor.io_bytes, client=9)
        urgent.priority = priority
        d.submit(urgent)
        d.run_until_idle()
        assert len(rec.done) == 9
        return {r: v[2] for r, v in rec.done.items()}      # (same submit time)
    srpt = latencies("paella", 0)
    assert srpt[8] == max(srpt.values())                   # SRPT: the long job last
    for policy in ("paella", "priority"):
        prio = latencies(policy, 1)
        assert prio[8] < 0.7 * srpt[8], (policy, prio[8], srpt[8])
    assert sum(v < prio[8] for r, v in prio.items() if r != 8) <= 2, prio
