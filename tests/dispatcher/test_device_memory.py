"""Device memory is finite (docs/dispatcher.md, "When the GPU's memory is full"): the
simulated GPU refuses an allocation beyond its preset's memory, as cuMemAlloc does, and
the dispatcher frees idle buffers, makes jobs wait for memory that running jobs will
give back, and fails a request only when nothing could ever make room; it never stops
serving the others."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from paella.dispatcher.adaptor import PlanAdaptor, synthetic_plan
from paella.dispatcher.chunked_buffers import ChunkedMemory
from paella.dispatcher.core import STATUS_CANCELLED, STATUS_ERROR, STATUS_OK, Dispatcher
from paella.dispatcher.devices.base import OutOfMemory
from paella.dispatcher.devices.sim import SimDevice
from paella.gpus import PRESETS, preset

from dispatch_helpers import Recorder

KIB = 1024


def model(name: str, set_kib: int, param_kib: int = 0, kernels: int = 3) -> PlanAdaptor:
    """A chain whose request buffers take ``set_kib`` KiB (input and output halves) and
    whose parameters take ``param_kib``."""
    half = set_kib * KIB // 2
    plan = synthetic_plan(name, [(f"{name}_k{i}", 40, 128, 32, 100e-6) for i in range(kernels)],
                          in_bytes=half, out_bytes=half)
    if param_kib:
        plan = replace(plan, buffers={**plan.buffers, "w": param_kib * KIB},
                       params={"w": b""})
    return PlanAdaptor(plan)


def setup(capacity_kib: int):
    dev = SimDevice(preset("t4").with_(mem_bytes=capacity_kib * KIB))
    return dev, Dispatcher(dev, "paella", profile_runs=1, buffer_sets_ahead=0)


def submit(disp, rec, mid, ad, ids, client=0):
    for i in ids:
        disp.submit(rec.request(i, mid, ad.io_bytes, client))


def test_every_preset_has_its_data_sheet_memory_and_the_simulator_enforces_it():
    assert all(spec.mem_bytes > 0 for spec in PRESETS.values())
    assert PRESETS["t4"].mem_bytes == 16 << 30 and PRESETS["a100"].mem_bytes == 40 << 30
    dev = SimDevice(preset("t4").with_(mem_bytes=4 * KIB))
    p = dev.alloc(3 * KIB)
    with pytest.raises(OutOfMemory, match=r"out of device memory: 2048 B asked, 3072 of "
                                          r"4096 B in use on t4"):
        dev.alloc(2 * KIB)
    assert dev.allocated_bytes == 3 * KIB    # the refused one counts nothing
    dev.free(p)
    dev.free(dev.alloc(4 * KIB))


def test_idle_buffer_sets_of_other_models_are_freed_for_a_new_model_and_its_requests():
    dev, disp = setup(100)
    a = model("a", 20)
    ma = disp.register_model("a", a)
    rec = Recorder()
    submit(disp, rec, ma, a, range(4))       # four sets at once: 80 of 100 KiB
    disp.run_until_idle()
    assert a.buffer_pool.created == 4 and dev.allocated_bytes == 80 * KIB
    b = model("b", 20, param_kib=40)         # its params need a's idle sets freed
    mb = disp.register_model("b", b)
    submit(disp, rec, mb, b, range(10, 12))
    submit(disp, rec, ma, a, range(20, 22))
    disp.run_until_idle()
    assert sorted(rec.done) == [0, 1, 2, 3, 10, 11, 20, 21]
    assert all(st == STATUS_OK for st, _, _ in rec.done.values())
    assert dev.allocated_bytes <= 100 * KIB
    assert disp.memory_failures == 0


def test_jobs_wait_for_memory_that_running_jobs_give_back():
    dev, disp = setup(100)
    a, b = model("a", 30), model("b", 30)
    ma, mb = disp.register_model("a", a), disp.register_model("b", b)
    rec = Recorder()
    submit(disp, rec, ma, a, range(4))
    submit(disp, rec, mb, b, range(10, 14))  # 8 x 30 KiB wanted at once, 3 fit
    disp.step()
    assert disp.memory_waits > 0 and dev.allocated_bytes <= 100 * KIB
    disp.run_until_idle()
    assert sorted(rec.done) == [0, 1, 2, 3, 10, 11, 12, 13]
    assert all(st == STATUS_OK for st, _, _ in rec.done.values())
    assert disp.memory_failures == 0 and not disp._memory_waiting


def test_a_request_that_can_never_fit_fails_with_the_reason_and_the_rest_is_served():
    dev, disp = setup(100)
    small = model("small", 10)
    big = model("big", 120)                  # larger than the GPU: its sets never fit
    ms, mbig = disp.register_model("small", small), disp.register_model("big", big, profile_runs=0)
    rec = Recorder()
    submit(disp, rec, mbig, big, [0])
    submit(disp, rec, ms, small, [1, 2])
    disp.run_until_idle()
    st, err, _ = rec.done[0]
    assert st == STATUS_ERROR
    assert "out of device memory" in err and "serve fewer or smaller models" in err
    assert [rec.done[i][0] for i in (1, 2)] == [STATUS_OK, STATUS_OK]
    assert disp.memory_failures == 1 and disp.in_flight == 0 and not disp.jobs
    submit(disp, rec, ms, small, [3])        # and it goes on
    disp.run_until_idle()
    assert rec.done[3][0] == STATUS_OK


def test_a_job_waiting_for_memory_can_be_cancelled_and_retirement_still_frees_everything():
    dev, disp = setup(100)
    a, b = model("a", 60), model("b", 60)
    ma, mb = disp.register_model("a", a), disp.register_model("b", b)
    rec = Recorder()
    submit(disp, rec, ma, a, [0], client=1)
    submit(disp, rec, mb, b, [1], client=2)
    disp.step()
    assert len(disp._memory_waiting) == 1
    waiting = disp._memory_waiting[0].requests[0].req_id
    assert disp.cancel_client(1 + waiting) == 1
    assert rec.done[waiting][0] == STATUS_CANCELLED and not disp._memory_waiting
    disp.run_until_idle()
    assert sorted(rec.done) == [0, 1]
    disp.retire_model(ma)
    disp.retire_model(mb)
    assert dev.allocated_bytes == 0


def test_abandon_all_answers_the_jobs_waiting_for_memory():
    dev, disp = setup(100)
    a = model("a", 60)
    ma = disp.register_model("a", a)
    rec = Recorder()
    submit(disp, rec, ma, a, [0, 1])
    disp.step()
    assert len(disp._memory_waiting) == 1
    assert disp.abandon_all("gpu lost") == 2
    assert sorted(rec.done) == [0, 1] and not disp._memory_waiting


def test_chunked_memory_gives_its_slot_back_when_a_chunk_does_not_fit():
    dev = SimDevice(preset("t4").with_(mem_bytes=100 * KIB))
    disp = Dispatcher(dev, "paella", profile_runs=0, buffer_sets_ahead=0)
    shared = ChunkedMemory("m", limit=4, chunk_size=8 * KIB)
    ad = model("m", 40)
    ad.memory = shared
    mid = disp.register_model("m", ad)
    blocker = dev.alloc(90 * KIB)
    with pytest.raises(OutOfMemory):
        ad.buffer_pool.acquire()
    assert shared.in_use == 0                # the job's slot went back
    dev.free(blocker)
    rec = Recorder()
    disp.submit(rec.request(0, mid, ad.io_bytes))
    disp.run_until_idle()
    assert rec.done[0][0] == STATUS_OK
    assert disp.reclaim_idle_memory() > 0    # its chunk, idle now
    assert dev.allocated_bytes == 0


def test_a_request_failed_before_its_job_started_counts_as_queueing_in_the_metrics():
    from paella.dispatcher.daemon.metrics import MetricsCounts
    counts = MetricsCounts()
    jobs, _, _ = counts.instruments()
    dev = SimDevice(preset("t4").with_(mem_bytes=100 * KIB))
    disp = Dispatcher(dev, "paella", profile_runs=0, instruments=[jobs], buffer_sets_ahead=0)
    small, big = model("small", 10), model("big", 120)
    ms, mid = disp.register_model("small", small), disp.register_model("big", big)
    rec = Recorder()
    disp.submit(rec.request(1, ms, small.io_bytes))
    disp.run_until_idle()                    # the clock is past 0 now
    assert disp.now > 0
    disp.submit(rec.request(0, mid, big.io_bytes))
    disp.run_until_idle()
    assert rec.done[0][0] == STATUS_ERROR
    m = counts.model(mid)
    assert m.failure == 1 and m.exec_count == 1
    assert m.queue_us >= 0 and m.compute_us == 0 and m.request_us == m.queue_us


def test_a_steady_load_of_one_model_does_not_starve_another_waiting_for_memory():
    dev, disp = setup(100)
    a, b = PlanAdaptor(model("a", 30).plan, max_buffer_sets=3), model("b", 30)
    ma, mb = disp.register_model("a", a), disp.register_model("b", b)
    order = []
    rec = Recorder()
    done = rec._complete
    rec._complete = lambda r, st, err: (order.append(r.req_id), done(r, st, err))
    submit(disp, rec, ma, a, range(3))       # a holds 90 of 100 KiB
    submit(disp, rec, mb, b, [100])          # then b, which does not fit
    submit(disp, rec, ma, a, range(3, 40))   # then a's backlog
    disp.run_until_idle()
    assert len(order) == 41 and all(st == STATUS_OK for st, _, _ in rec.done.values())
    assert order.index(100) <= 4             # in its turn, not after a's whole backlog
    assert disp.memory_waits <= 38           # jobs that waited, each counted once


def test_a_jobs_own_allocation_and_a_schedulers_reclaim_idle_buffers_first():
    from paella.dispatcher import cudart as cuda
    from paella.dispatcher.adaptor import JobAdaptor
    from paella.dispatcher.devices.base import KernelInfo, ModuleImage
    from paella.dispatcher.batchers.stage import scheduler_context

    class Scratch(JobAdaptor):               # a job that mallocs 40 KiB of scratch
        name, io_bytes = "scratch", 64

        def init(self, device):
            infos = [KernelInfo("s_k", 32, duration=40e-6)]
            self.k = device.load_module(ModuleImage("scratch", infos))["s_k"]

        def run(self, io):
            cuda.malloc(40 * KIB)
            cuda.launch(self.k, 4, 64)
            cuda.device_synchronize()

    dev, disp = setup(100)
    a = model("a", 20)
    ma = disp.register_model("a", a)
    rec = Recorder()
    submit(disp, rec, ma, a, range(4))
    disp.run_until_idle()                    # 80 KiB of a's sets, idle
    ms = disp.register_model("scratch", Scratch(), profile_runs=0)
    disp.submit(rec.request(99, ms, 64))
    disp.run_until_idle()
    assert rec.done[99][0] == STATUS_OK
    submit(disp, rec, ma, a, range(4, 8))    # a's sets again
    disp.run_until_idle()
    ptr = scheduler_context(disp).alloc(60 * KIB)   # a scheduler's own (orca's KV cache)
    assert dev.allocated_bytes <= 100 * KIB
    dev.free(ptr)


def test_a_reload_on_a_full_gpu_reclaims_the_old_versions_idle_sets():
    dev, disp = setup(100)
    a = model("a", 20)
    ma = disp.register_model("a", a)
    rec = Recorder()
    submit(disp, rec, ma, a, range(5))
    disp.run_until_idle()
    assert dev.allocated_bytes == 100 * KIB  # all of it, idle sets of the old version
    new = model("a_v2", 20)                  # its profiling run needs a set
    assert disp.register_model("a_v2", new, model_id=ma) == ma
    submit(disp, rec, ma, new, range(10, 13))
    disp.run_until_idle()
    assert all(rec.done[i][0] == STATUS_OK for i in range(10, 13))
    assert disp.memory_failures == 0 and list(disp.models.values())[0].adaptor is new


def test_each_model_reports_the_memory_it_holds_weights_sets_and_shared_chunks_once():
    dev, disp = setup(1000)
    a, b = model("a", 20, param_kib=30), model("b", 10)
    ma, mb = disp.register_model("a", a), disp.register_model("b", b)
    rec = Recorder()
    submit(disp, rec, ma, a, range(3))       # three of a's sets at once
    submit(disp, rec, mb, b, range(10, 11))
    disp.run_until_idle()
    held = disp.device_memory_by_model()
    assert held[ma] == (30 + 3 * 20) * KIB and held[mb] == 10 * KIB
    assert sum(held.values()) == dev.allocated_bytes
    disp.reclaim_idle_memory()               # the idle sets go, the weights stay
    assert disp.device_memory_by_model() == {ma: 30 * KIB, mb: 0}
    # Two variants over one model's chunks (one client model, two dispatcher models):
    # the chunks count once, under one of the two.
    shared = ChunkedMemory("c", limit=4, chunk_size=8 * KIB)
    v1, v2 = model("c1", 16), model("c2", 16)
    v1.memory = v2.memory = shared
    m1, m2 = disp.register_model("c1", v1), disp.register_model("c2", v2)
    submit(disp, rec, m1, v1, range(20, 22))
    submit(disp, rec, m2, v2, range(30, 32))
    disp.run_until_idle()
    held = disp.device_memory_by_model()
    assert held[m1] + held[m2] == shared.stats.held_bytes > 0
    assert sum(held.values()) == dev.allocated_bytes
    # A replaced version still running counts under its id until it goes.
    a2 = model("a2", 20, param_kib=50)
    submit(disp, rec, ma, a, range(40, 41))
    disp.step()
    disp.register_model("a-v2", a2, model_id=ma, profile_runs=0)
    assert disp.device_memory_by_model()[ma] >= (30 + 50) * KIB
    disp.run_until_idle()
    assert disp.device_memory_by_model()[ma] == 50 * KIB
    assert all(st == STATUS_OK for st, _, _ in rec.done.values()) and len(rec.done) == 9


def _scratch_adaptor(name: str, first_kib: int, then_kib: int = 0, order: list | None = None):
    """A greenlet job: mallocs ``first_kib``, runs a kernel, then mallocs ``then_kib``
    more and runs another (``order`` records when each job got its memory)."""
    from paella.dispatcher import cudart as cuda
    from paella.dispatcher.adaptor import JobAdaptor
    from paella.dispatcher.devices.base import KernelInfo, ModuleImage

    class Scratch(JobAdaptor):
        io_bytes = 64

        def init(self, device):
            infos = [KernelInfo(f"{name}_k", 32, duration=200e-6)]
            self.k = device.load_module(ModuleImage(name, infos))[f"{name}_k"]

        def run(self, io):
            cuda.malloc(first_kib * KIB)
            if order is not None:
                order.append((name, "first"))
            cuda.launch(self.k, 4, 64)
            cuda.device_synchronize()
            if then_kib:
                cuda.malloc(then_kib * KIB)
                if order is not None:
                    order.append((name, "then"))
                cuda.launch(self.k, 4, 64)
                cuda.device_synchronize()

    ad = Scratch()
    ad.name = name
    return ad


def test_a_greenlet_jobs_malloc_waits_for_memory_another_job_gives_back():
    dev, disp = setup(100)
    order: list = []
    ma = disp.register_model("a", _scratch_adaptor("a", 70, order=order), profile_runs=0)
    mb = disp.register_model("b", _scratch_adaptor("b", 60, order=order), profile_runs=0)
    rec = Recorder()
    disp.submit(rec.request(1, ma, 64))
    disp.step()                              # a holds 70 of 100 KiB, its kernel runs
    disp.submit(rec.request(2, mb, 64))      # b's 60 KiB wait for a's end
    disp.run_until_idle()
    assert rec.done[1][0] == rec.done[2][0] == STATUS_OK, rec.done
    assert order == [("a", "first"), ("b", "first")]
    assert disp.memory_waits == 1 and disp.memory_failures == 0
    assert dev.allocated_bytes == 0          # both jobs' scratch freed at their end


def test_greenlet_jobs_that_would_wait_on_each_other_fail_one_and_the_other_goes_on():
    # Each takes 40 KiB, then wants 40 more: the second to find nothing else running
    # that could give memory back fails (freeing its 40), and the first then fits.
    dev, disp = setup(100)
    order: list = []
    ma = disp.register_model("a", _scratch_adaptor("a", 40, 40, order), profile_runs=0)
    mb = disp.register_model("b", _scratch_adaptor("b", 40, 40, order), profile_runs=0)
    rec = Recorder()
    disp.submit(rec.request(1, ma, 64))
    disp.submit(rec.request(2, mb, 64))
    disp.run_until_idle()
    statuses = sorted(st for st, _, _ in rec.done.values())
    assert statuses == [STATUS_OK, STATUS_ERROR], rec.done
    failed = next(err for st, err, _ in rec.done.values() if st == STATUS_ERROR)
    assert "OutOfMemory" in failed
    assert dev.allocated_bytes == 0 and not disp.jobs


def test_a_greenlet_job_cancelled_while_waiting_for_memory_is_answered_once():
    dev, disp = setup(100)
    ma = disp.register_model("a", _scratch_adaptor("a", 70), profile_runs=0)
    mb = disp.register_model("b", _scratch_adaptor("b", 60), profile_runs=0)
    rec = Recorder()
    disp.submit(rec.request(1, ma, 64, client=1))
    disp.step()
    disp.submit(rec.request(2, mb, 64, client=2))
    disp.step()
    assert disp.memory_waits == 1
    assert disp.cancel_client(2) == 1
    disp.run_until_idle()
    assert rec.done[1][0] == STATUS_OK and rec.done[2][0] == STATUS_CANCELLED
    assert len(rec.done) == 2                # (the recorder refuses a second answer)
    assert dev.allocated_bytes == 0 and not disp.jobs
