"""Retiring a model (docs/dispatcher.md, "The dispatcher"): a model taken out of service
keeps its running and waiting jobs, then is removed and its adaptor closed; nothing it
held stays behind (device memory, launch records, the simulator's prepared launches)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from paella.dispatcher.adaptor import JobAdaptor
from paella.dispatcher.core import STATUS_OK, Dispatcher
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.instruments import Instrument

from dispatch_helpers import Recorder, chain


class Removed(Instrument):
    def __init__(self):
        self.models = []

    def model_removed(self, model):
        self.models.append(model.name)


def setup(**kw):
    dev = SimDevice("t4")
    seen = Removed()
    disp = Dispatcher(dev, "paella", profile_runs=1, instruments=[seen], **kw)
    return dev, disp, seen


def run(disp, rec, mid, ids, io_bytes):
    for i in ids:
        disp.submit(rec.request(i, mid, io_bytes))


def test_a_retired_model_finishes_its_jobs_then_frees_everything():
    dev, disp, seen = setup()
    base = dev.allocated_bytes
    ad = chain("old", 4, grid=40)
    ad.max_buffer_sets = 2                   # the third request waits for a set
    mid = disp.register_model("old", ad)
    held = dev.allocated_bytes
    assert held > base
    rec = Recorder()
    run(disp, rec, mid, range(3), ad.io_bytes)
    disp.step()                              # started (one waits for a buffer set)
    disp.retire_model(mid)
    assert mid in disp.models and seen.models == []   # its jobs still need it
    disp.run_until_idle()
    assert sorted(rec.done) == [0, 1, 2]
    assert all(st == STATUS_OK for st, _, _ in rec.done.values())
    assert mid not in disp.models
    assert seen.models == ["old"]
    assert dev.allocated_bytes == base       # params and every buffer set freed
    assert ad.funcs == {} and ad.buffers == {}
    assert not disp._launches                # no launch record of its kernels is kept
    assert not dev._prepared                 # nor the simulator's view of them
    with pytest.raises(ValueError, match="unknown model id"):
        disp.submit(rec.request(9, mid, ad.io_bytes))


def test_an_idle_model_goes_at_once_and_others_keep_serving():
    dev, disp, seen = setup()
    a, b = chain("a", 3), chain("b", 3)
    ma, mb = disp.register_model("a", a), disp.register_model("b", b)
    both = dev.allocated_bytes
    disp.retire_model(ma)
    assert ma not in disp.models and seen.models == ["a"]
    assert 0 < dev.allocated_bytes < both
    disp.retire_model(disp.models[mb])       # by the Model too; twice is harmless
    assert seen.models == ["a", "b"] and dev.allocated_bytes == 0
    with pytest.raises(ValueError, match="nothing to retire"):
        disp.retire_model(ma)


def test_registering_an_id_again_retires_the_old_model_after_its_jobs():
    dev, disp, seen = setup()
    old = chain("v1", 3, grid=60)
    mid = disp.register_model("v1", old)
    rec = Recorder()
    run(disp, rec, mid, range(2), old.io_bytes)
    disp.step()
    new = chain("v2", 2)
    assert disp.register_model("v2", new, model_id=mid) == mid
    assert disp.models[mid].name == "v2"
    run(disp, rec, mid, [5], new.io_bytes)
    disp.run_until_idle()
    assert sorted(rec.done) == [0, 1, 5]
    assert seen.models == ["v1"]
    assert old.funcs == {} and new.funcs
    # What is left is the new model's, and retiring it leaves nothing.
    disp.retire_model(mid)
    assert dev.allocated_bytes == 0 and not disp.models


class FailsToRun(JobAdaptor):
    """Holds device memory from init; every job it runs raises."""
    name = "fails"
    io_bytes = 64

    def init(self, device):
        self.ptr = device.alloc(1 << 20)

    def run(self, io):
        raise RuntimeError("boom in run")

    def close(self, device):
        device.free(self.ptr)


def test_a_failed_profiling_run_keeps_the_previous_model_and_frees_the_new():
    dev, disp, seen = setup()
    good = chain("good", 2)
    mid = disp.register_model("good", good)
    before = dev.allocated_bytes
    with pytest.raises(RuntimeError, match="profiling run"):
        disp.register_model("bad", FailsToRun(), model_id=mid)
    assert disp.models[mid].name == "good"
    assert dev.allocated_bytes == before
    rec = Recorder()
    run(disp, rec, mid, [1], good.io_bytes)
    disp.run_until_idle()
    assert rec.done[1][0] == STATUS_OK


def test_an_adaptor_whose_close_raises_is_logged_and_the_loop_goes_on(caplog):
    dev, disp, seen = setup()
    ad = chain("x", 2)
    mid = disp.register_model("x", ad)

    def close(device):
        raise RuntimeError("boom in close")
    ad.close = close
    other = disp.register_model("y", chain("y", 2))
    with caplog.at_level(logging.ERROR):
        disp.retire_model(mid)
    assert "boom in close" in caplog.text and "'x'" in caplog.text
    rec = Recorder()
    run(disp, rec, other, [1], ad.io_bytes)
    disp.run_until_idle()
    assert rec.done[1][0] == STATUS_OK


def test_a_retired_model_is_not_put_back_by_a_failed_registration_of_its_id():
    dev, disp, seen = setup()
    old = chain("old", 3, grid=40)
    mid = disp.register_model("old", old)
    rec = Recorder()
    disp.submit(rec.request(0, mid, old.io_bytes))
    disp.step()
    disp.retire_model(mid)                   # its job still runs, through the profiling
    with pytest.raises(RuntimeError, match="profiling run"):
        disp.register_model("new", FailsToRun(), model_id=mid)
    assert mid not in disp.models and seen.models == ["old"]
    assert rec.done[0][0] == STATUS_OK and dev.allocated_bytes == 0


def test_a_variant_set_that_fails_part_way_leaves_nothing_registered():
    """The daemon's register_variants: the second variant's profiling fails, so the
    bundle is not served (the previous version stays) and the first, registered
    already, must go too: a failing bundle is tried again at every SIGHUP."""
    from types import SimpleNamespace as NS
    from paella.dispatcher.daemon.config import DaemonConfig
    from paella.dispatcher.daemon.executors import DispatcherExecutor

    dev = SimDevice("t4")
    ex = DispatcherExecutor(None, dev, DaemonConfig())

    def variant(b):
        return NS(name=f"b{b}", rows=b, seq_len=0, inputs=[], outputs=[], io_bytes=256)
    good = chain("v1", 2)
    ex.register_variants(7, "m", "m#1", NS(variants=[variant(1)]), [good], None, 1,
                         config=NS(batcher="identity", batcher_options={}))
    models, held = set(ex.disp.models), dev.allocated_bytes
    with pytest.raises(RuntimeError, match="profiling run"):
        ex.register_variants(7, "m", "m#2", NS(variants=[variant(1), variant(2)]),
                             [chain("v2", 2), FailsToRun()], None, 1,
                             config=NS(batcher="identity", batcher_options={}))
    assert set(ex.disp.models) == models and dev.allocated_bytes == held
    assert [sv.model_id for sv in ex.stage.models[7].served.values()] == sorted(models)


def test_a_scheduler_whose_start_fails_leaves_no_model_registered():
    """A standalone scheduler (orca's kind) registers an internal model in start() and
    then fails (orca: its KV cache does not fit): tried again at every SIGHUP, it must
    leave nothing behind."""
    from paella.dispatcher.batchers import ModelVariants, VariantSpec
    from paella.dispatcher.batchers.base import SchedulerBatcher
    from paella.dispatcher.daemon.config import DaemonConfig
    from paella.dispatcher.daemon.executors import DispatcherExecutor

    class Fails(SchedulerBatcher):
        name = "fails"

        def start(self, ctx):
            super().start(ctx)
            ctx.register_model("iteration", chain("it", 2))
            raise RuntimeError("the KV cache does not fit")

        def add(self, req, now):
            pass

    dev = SimDevice("t4")
    ex = DispatcherExecutor(None, dev, DaemonConfig())
    for k in range(3):
        with pytest.raises(RuntimeError, match="KV cache"):
            ex.register_variants(5, "gen", f"gen#{k}", None, [],
                                 Fails(ModelVariants("gen", (VariantSpec(0, 1, 0, "gen"),))), 1)
        assert ex.disp.models == {} and dev.allocated_bytes == 0
    assert ex.stage.models == {}


def one_raising_callback(n, bad):
    """A model "m" and ``n`` requests for it, request ``bad``'s on_complete raising."""
    dev, disp, seen = setup()
    ad = chain("m", 3, grid=20)
    mid = disp.register_model("m", ad)
    rec = Recorder()
    reqs = [rec.request(i, mid, ad.io_bytes) for i in range(n)]

    def boom(req, status, error):
        raise RuntimeError("the caller's bug")
    reqs[bad].on_complete = boom
    return dev, disp, seen, ad, mid, rec, reqs


def test_a_raising_callback_still_lets_its_batch_mates_finish_and_the_model_go():
    dev, disp, seen, ad, mid, rec, reqs = one_raising_callback(3, 0)
    io = np.zeros(max(ad.io_bytes, 1), np.uint8)
    disp.submit_group(reqs, io)
    disp.retire_model(mid)
    with pytest.raises(RuntimeError, match="the caller's bug"):
        disp.run_until_idle()
    assert sorted(rec.done) == [1, 2]        # answered although the first callback raised
    assert all(st == STATUS_OK for st, _, _ in rec.done.values())
    assert mid not in disp.models and seen.models == ["m"]
    assert dev.allocated_bytes == 0


def test_abandon_all_answers_everyone_before_a_raising_callback_propagates():
    dev, disp, seen, ad, mid, rec, reqs = one_raising_callback(4, 1)
    for r in reqs:
        disp.submit(r)
    disp.step()
    with pytest.raises(RuntimeError, match="the caller's bug"):
        disp.abandon_all("gpu lost")
    assert sorted(rec.done) == [0, 2, 3]
    assert all(err == "gpu lost" for _, err, _ in rec.done.values())
    assert disp.in_flight == 0 and not disp.jobs
