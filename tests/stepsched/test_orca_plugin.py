"""The ``orca`` scheduler plug-in on the batching stage, in virtual time (the daemon's
path without the daemon: tests/service/test_generation.py has that): requests laid out
as clients lay them out, tokens checked against the from-scratch reference, progress
reports in order, a client leaving, a reload while generations run."""
import numpy as np
import pytest

from paella import rings
from paella.dispatcher.batchers import ModelVariants, VariantSpec, get_batcher, make_batcher
from paella.dispatcher.batchers.stage import BatchingStage, ServedModel
from paella.dispatcher.core import Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.models.gpt import GPTConfig, generate_reference, gpt_weights
from paella.stepsched.orca_plugin import OrcaScheduler, generation_io

CFG = GPTConfig.tiny()
W = gpt_weights(CFG)
IO = generation_io(CFG)
MODEL = ModelVariants("gpt", (VariantSpec(0, 1, 0, "gpt"),))


def orca(stage, **options):
    sched = make_batcher("orca", MODEL, options)
    stage.add_model(5, ServedModel("gpt", MODEL, {}, sched))
    return sched


class Gen:
    """One client request: its io region as paella.generate fills it."""

    def __init__(self, rid, prompt, n, client=0):
        self.prompt, self.n = prompt, n
        self.io = np.zeros(IO.io_bytes, np.uint8)
        p, lens = IO.inputs
        self.io[p.offset:p.offset + 4 * len(prompt)] = np.array(prompt, np.int32).view(np.uint8)
        self.io[lens.offset:lens.offset + 8] = np.array([len(prompt), n], np.int32).view(np.uint8)
        self.progress, self.done = [], []
        self.req = Request(rid, client, 5, self.io, on_complete=self._done,
                           on_progress=lambda q, k: self.progress.append(k))

    def _done(self, req, status, err):
        self.done.append((status, err))

    @property
    def tokens(self):
        t, count = IO.outputs
        k = int(self.io[count.offset:count.offset + 4].view(np.int32)[0])
        return self.io[t.offset:t.offset + 4 * k].view(np.int32).tolist()


def stage_and_orca(**options):
    disp = Dispatcher(SimDevice("t4", n_streams=64, seed=0), "paella", profile_runs=0)
    stage = BatchingStage(disp)
    return disp, stage, orca(stage, **options)


def test_registered_as_a_standalone_scheduler():
    assert get_batcher("orca") is OrcaScheduler
    assert OrcaScheduler.drives_jobs and OrcaScheduler.standalone


def test_generations_stream_the_reference_tokens_and_complete_once():
    disp, stage, sched = stage_and_orca(max_bs=3, n_slots=128, fairness_threshold=2.0)
    gens = [Gen(i, p, n, client=i) for i, (p, n) in
            enumerate([([3, 7, 1, 9], 6), ([5], 12), ([60, 2, 2], 3), ([8, 8], 9)])]
    for g in gens:
        stage.submit(g.req)
    stage.run_until_idle()
    for g in gens:
        assert g.done == [(rings.OK, None)]
        assert g.tokens == generate_reference(CFG, W, g.prompt, g.n)
        assert g.progress == list(range(1, g.n + 1))
    assert stage.queued == 0 and sched.engine.streams == {} and not sched.pending
    assert len(sched.engine.free_slots) == 128          # every KV slot back
    assert sched.engine.sched.deficit == {}       # every user left: no counter is kept


def test_a_client_leaving_frees_its_slots_and_the_next_is_admitted():
    disp, stage, sched = stage_and_orca(max_bs=2, n_slots=64)
    a, b = Gen(1, [1, 2, 3, 4], 56, client=7), Gen(2, [4, 3, 2, 1], 56, client=8)
    stage.submit(a.req)
    stage.submit(b.req)                   # waits: the cache holds one of them
    dev = disp.device
    while len(a.progress) < 3:            # (run_until_idle's loop, stopping mid-way)
        disp.step()
        stage.step()
        if disp.idle:
            assert dev.next_event_time() < float("inf")
            dev.run_until(max(dev.next_event_time(), dev.now()))
    assert not b.progress                 # b still waits for a's slots
    stage.cancel_client(7)
    stage.run_until_idle()
    assert a.done[0][0] == rings.E_CANCELLED and len(a.done) == 1
    assert b.done == [(rings.OK, None)] and b.tokens == generate_reference(CFG, W, b.prompt, 56)
    assert len(sched.engine.free_slots) == 64


def test_a_reload_lets_running_generations_finish_on_the_old_scheduler():
    disp, stage, old = stage_and_orca(max_bs=4, n_slots=128)
    a = Gen(1, [9, 9], 20)
    stage.submit(a.req)
    disp.step()
    new = orca(stage, max_bs=4, n_slots=128)
    b = Gen(2, [1, 5], 10)
    stage.submit(b.req)
    stage.run_until_idle()
    assert a.done == b.done == [(rings.OK, None)]
    assert a.tokens == generate_reference(CFG, W, [9, 9], 20)
    assert b.tokens == generate_reference(CFG, W, [1, 5], 10)
    assert old.ctx.closed and not new.ctx.closed and stage._retired == []


def test_bad_requests_are_refused_alone():
    disp, stage, sched = stage_and_orca()
    bad = [Gen(1, [1, 99], 3), Gen(2, [1], 0), Gen(3, [2] * 60, 10)]
    good = Gen(4, [2, 3], 4)
    for g in [*bad, good]:
        stage.submit(g.req)
    stage.run_until_idle()
    assert [g.done[0][0] for g in bad] == [rings.E_OPTIONS] * 3
    assert "outside the vocabulary" in bad[0].done[0][1]
    assert good.done == [(rings.OK, None)] and good.tokens == generate_reference(CFG, W, [2, 3], 4)


def test_a_kv_cache_that_cannot_be_allocated_names_n_slots():
    """Load time: the simulated device cannot map 48 TiB; the error says what to change."""
    disp = Dispatcher(SimDevice("t4", n_streams=8, seed=0), "paella", profile_runs=0)
    with pytest.raises(Exception, match=r"KV cache of n_slots = 100000000000 .*lower n_slots"):
        orca(BatchingStage(disp), n_slots=10 ** 11)


def test_the_wire_priority_maps_to_the_iteration_schedulers_order():
    """The wire's 1 is the highest (Triton's levels); the iteration scheduler serves larger
    values first; a request without one ranks as the middle level."""
    from paella.stepsched.orca_plugin import orca_priority
    assert orca_priority(1) > orca_priority(2) > orca_priority(255) >= 1
    assert orca_priority(0) == orca_priority(128)
