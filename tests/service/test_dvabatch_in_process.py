"""DVABatch served by the daemon's execution path, in one process and virtual time:
the stage bundle's variants registered as the daemon registers them
(``DispatcherExecutor.register_variants``, real bundle adaptors on the simulated GPU),
the ``dvabatch`` batcher on the scheduler interface, requests with real bytes. Every
answer equals the whole model's CPU build for its own row; stretch and split happen;
a client leaving mid-batch and a failing stage job cost the others nothing."""
from __future__ import annotations

import numpy as np
import pytest

from paella import rings, shapes
from paella.bundle import load_bundle
from paella.dispatcher.core import Request
from paella.dispatcher.daemon.bundles import FunctionalCache, bundle_adaptor, model_info_from_bundle
from paella.dispatcher.daemon.config import DaemonConfig
from paella.dispatcher.daemon.executors import DispatcherExecutor
from paella.dispatcher.daemon.model_config import ModelConfig
from paella.dispatcher.devices.base import DeviceError
from paella.dispatcher.devices.sim import SimDevice

from dvabatch_bundle import query, reference, staged_bert


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return load_bundle(staged_bert(tmp_path_factory.mktemp("dva") / "bert"))


class Served:
    """The model behind a DispatcherExecutor; ``send`` makes a request of one row."""

    def __init__(self, bundle, **options):
        self.bundle = bundle
        self.dev = SimDevice("t4", seed=1)
        self.ex = DispatcherExecutor(None, self.dev, DaemonConfig())
        cache = FunctionalCache()
        ads = [bundle_adaptor(bundle, "bert#1", self.dev, cache, k)
               for k in range(len(bundle.variants))]
        self.ex.register_variants(1, "bert", "bert#1", bundle, ads, None, 1,
                                  config=ModelConfig(batcher="dvabatch", batcher_options=options))
        self.info = model_info_from_bundle(1, bundle, "bert")
        self.batcher = self.ex.stage.models[1].batcher
        self.rng = np.random.default_rng(0)
        self.done: dict[int, tuple[int, str | None]] = {}
        self.reqs: list[Request] = []

    def send(self, client: int = 1, seq_len: int = 8, rows: int = 1) -> Request:
        slots, need = shapes.request_layout(self.info.variants, rows, seq_len)
        io = np.zeros(need, np.uint8)
        x, mask = query(self.rng)
        x, mask = x[:, :seq_len], mask[:, :seq_len]
        for s, a in zip(slots, (x, mask)):
            io[s.offset:s.offset + a.nbytes] = a.view(np.uint8).reshape(-1)[:s.nbytes]
        req = Request(len(self.reqs), client, 1, io, rows=rows, seq_len=seq_len,
                      layout=tuple(slots), on_complete=self._complete)
        # A shorter row runs padded to the bucket (zeros, masked out): the whole model's
        # answer on the padded row, cut to the row's length.
        pad_x, pad_m = np.zeros((1, 8, 16), np.float32), np.zeros((1, 8), np.float32)
        pad_x[:, :seq_len], pad_m[:, :seq_len] = x, mask
        req.want = reference(self.bundle, pad_x, pad_m)[:, :seq_len]
        self.reqs.append(req)
        self.ex.submit(req)
        return req

    def _complete(self, req, status, err):
        assert req.req_id not in self.done, f"request {req.req_id} answered twice"
        self.done[req.req_id] = (status, err)

    def advance(self, seconds: float) -> None:
        end = self.dev.now() + seconds
        while self.dev.now() < end:
            self.ex.step()
            self.dev.run_until(min(end, self.dev.now() + 10e-6))

    def output(self, req) -> np.ndarray:
        s = req.layout[2]
        return req.io[s.offset:s.offset + s.nbytes].view(np.float32).reshape(s.shape)


def test_every_row_gets_the_whole_models_answer_through_stretch_and_split(bundle):
    from paella.dispatcher.instruments import Instrument

    class Streams(Instrument):
        seen: list = []

        def op_released(self, op, t):
            self.seen.append((op.job.model.name, op.stream))
    m = Served(bundle, pairs=2, split_factor=0.0, t_comp_wait_us=400.0)
    m.ex.disp.instruments.add(Streams())
    for i in range(16):
        m.send(client=1 + i % 3)
        m.advance(15e-6)                     # arrivals spread over the first batches
    m.ex.stage.run_until_idle()
    assert m.done == {r.req_id: (rings.OK, None) for r in m.reqs}
    for r in m.reqs:
        np.testing.assert_allclose(m.output(r), r.want, rtol=1e-5, atol=1e-5)
    st = m.batcher.stats_dict()
    assert st["stretch"] > 0 and st["split"] > 0 and st["new"] > 0
    assert st["exited"] == 16 and st["failed"] == 0
    # runs of 3 rows (a stretched batch) ran as pieces of the compiled sizes 2 + 1
    assert st["jobs"] > st["stage_runs"]
    # one stream per stage executor: every op of stage s's jobs on stage s's stream
    own = [m.ex.disp.stream_named(f"bert/s{s}") for s in range(2)]
    assert len(set(own)) == 2
    by_stage = {}
    for name, stream in Streams.seen:           # variants are "bert#1/s{stage}_b{rows}_l8"
        by_stage.setdefault(int(name.split("/s")[1][0]), set()).add(stream)
    assert by_stage == {0: {own[0]}, 1: {own[1]}}


def test_a_client_leaving_mid_batch_is_answered_once_and_the_others_complete(bundle):
    m = Served(bundle, pairs=1, split=False, t_comp_wait_us=1000.0)
    mine = [m.send(client=1), m.send(client=2), m.send(client=1), m.send(client=2)]
    m.advance(20e-6)                         # in their batch, stage 0 running
    assert not m.done
    m.ex.cancel_client(2)
    m.ex.stage.run_until_idle()
    for r in mine:
        status, err = m.done[r.req_id]
        if r.client_id == 2:
            assert status == rings.E_CANCELLED and "client 2 disconnected" in err
        else:
            assert status == rings.OK
            np.testing.assert_allclose(m.output(r), r.want, rtol=1e-5, atol=1e-5)
    assert m.batcher.stats_dict()["dropped"] == 2
    later = m.send(client=1)                 # and the model serves on
    m.ex.stage.run_until_idle()
    assert m.done[later.req_id] == (rings.OK, None)


def test_waiting_rows_of_a_leaving_client_are_withdrawn_and_short_rows_are_padded(bundle):
    """One pair, no stretch: the first row's batch holds the pair, the others wait; the
    client of two waiting ones leaves (withdrawn, answered once); rows shorter than the
    length bucket come back at their own length."""
    m = Served(bundle, pairs=1, stretch=False, split=False)
    first = m.send(client=1, seq_len=5)
    waiting = [m.send(client=2), m.send(client=3, seq_len=3), m.send(client=2)]
    m.advance(5e-6)
    m.ex.cancel_client(2)
    assert [m.done.get(r.req_id, (None,))[0] for r in waiting] == \
        [rings.E_CANCELLED, None, rings.E_CANCELLED]
    m.ex.stage.run_until_idle()
    for r in (first, waiting[1]):
        assert m.done[r.req_id] == (rings.OK, None)
        np.testing.assert_allclose(m.output(r), r.want, rtol=1e-5, atol=1e-5)
    assert m.batcher.stats_dict()["new"] == 2 and m.batcher.stats_dict()["dropped"] == 0


def test_a_failing_stage_job_fails_its_rows_with_the_reason_and_the_others_go_on(bundle):
    m = Served(bundle, pairs=2, split=False, stretch=False)
    s1 = m.ex.disp.stream_named("bert/s1")
    real = m.dev.launch_checked             # (the dispatcher's launch)
    fail = [1]

    def launch(k, stream, *a, **kw):
        if stream == s1 and fail[0]:        # the device refuses stage 1's next kernel
            fail[0] -= 1
            raise DeviceError("injected: launch refused")
        return real(k, stream, *a, **kw)
    m.dev.launch_checked = launch
    hit = m.send(client=1)              # a batch of its own: its stage 1 job fails
    others = [m.send(client=2), m.send(client=3)]      # the next batches
    m.ex.stage.run_until_idle()
    assert fail == [0]
    status, err = m.done[hit.req_id]
    assert status == rings.E_FAILED
    assert "bert: stage 1 of 2 failed on rows 0..0 of its batch" in err
    assert "injected: launch refused" in err
    for r in others:
        assert m.done[r.req_id] == (rings.OK, None)
        np.testing.assert_allclose(m.output(r), r.want, rtol=1e-5, atol=1e-5)
    assert m.batcher.stats_dict()["failed_runs"] == 1


def test_the_model_is_described_to_clients_as_the_whole_model(bundle):
    """The whole model per batch size, then the exit variants (stage 0's inputs, stage
    0's outputs: a request selecting one leaves after stage 0)."""
    info = model_info_from_bundle(1, bundle, "bert")
    assert [(v.batch, [t.name for t in v.inputs], [t.name for t in v.outputs])
            for v in info.variants] == [(b, ["x", "mask"], ["output0"]) for b in (1, 2, 4)] + \
        [(b, ["x", "mask"], ["cut1.0", "cut1.1"]) for b in (1, 2, 4)]
    assert info.variants[0].outputs[0].shape == (1, 8, 16)
    # a shaped request is laid out as the whole model (the exit variants come after)
    slots, _ = shapes.request_layout(info.variants, 3, 8)
    assert [s.name for s in slots] == ["x", "mask", "output0"]


def test_a_request_of_several_rows_gets_each_rows_whole_model_answer(bundle):
    """Rows of one request are queries of their own in the pipeline (they may join
    different batches); the request is answered once its last row left."""
    s = Served(bundle, split_factor=0.0, t_comp_wait_us=3000)
    reqs = _several_row_requests(s, bundle, 5, (3, 1, 4, 2))
    s.advance(0.2)
    assert all(s.done.get(r.req_id, (None,))[0] == rings.OK for r in reqs), s.done
    for r in reqs:
        np.testing.assert_allclose(s.output(r), r.want, rtol=1e-5, atol=1e-5)
    st = s.batcher.stats_dict()
    assert st["requests"] == 4 and st["rows"] == 10 and st["exited"] == 4, st


def exit_request(s: "Served", rng, variant: int, rows: int):
    """A request of exit variant ``variant`` (laid out as the model info says)."""
    v = s.info.variants[variant]
    io = np.zeros(v.io_bytes, np.uint8)
    xs = [query(rng) for _ in range(rows)]
    x = np.concatenate([a for a, _ in xs])
    mask = np.concatenate([m for _, m in xs])
    for t, a in zip(v.inputs, (x, mask)):
        io[t.offset:t.offset + a.nbytes] = a.view(np.uint8).reshape(-1)
    req = Request(len(s.reqs), 1, 1, io, variant, rows=rows, seq_len=8,
                  on_complete=s._complete)
    s.reqs.append(req)
    s.ex.submit(req)
    return req, x, mask


def test_a_request_exits_early_after_stage_0_with_stage_0s_outputs(bundle):
    """Exit variant 3 (batch 1, after stage 0) and 5 (batch 4): the answer is stage 0's
    outputs (``cut1.0``, ``cut1.1``), the CPU replay of stage 0's plan on the same
    input; whole-model requests beside them get the whole model's answer."""
    s = Served(bundle, t_comp_wait_us=3000)
    rng = np.random.default_rng(9)
    whole = [s.send() for _ in range(2)]
    early = [exit_request(s, rng, 3, 1), exit_request(s, rng, 5, 4)]
    whole.append(s.send())
    s.advance(0.2)
    for r in whole:
        assert s.done[r.req_id][0] == rings.OK
        np.testing.assert_allclose(s.output(r), r.want, rtol=1e-5, atol=1e-5)
    s0 = {v.rows: k for k, v in enumerate(bundle.variants) if v.stage == 0}
    for req, x, mask in early:
        assert s.done[req.req_id][0] == rings.OK, s.done[req.req_id]
        v = s.info.variants[req.options]
        want = bundle.run_stage_cpu({"x": x, "mask": mask}, s0[req.rows])
        for t in v.outputs:
            got = req.io[t.offset:t.offset + t.nbytes].view(t.dtype).reshape(t.shape)
            np.testing.assert_allclose(got, want[t.name], rtol=1e-5, atol=1e-5)
    st = s.batcher.stats_dict()
    assert st["early_exits"] == 2 and st["exited"] == 5, st


def test_an_exit_that_is_not_enabled_is_refused_with_the_reason(bundle):
    s = Served(bundle, early_exits=[])
    req, _, _ = exit_request(s, np.random.default_rng(1), 3, 1)
    s.advance(0.01)
    assert s.done[req.req_id] == (rings.E_OPTIONS, "bert: an early exit after stage 0 is not "
                                  "enabled (early_exits = [])")


def test_a_three_stage_unet_with_skips_across_stages(tmp_path):
    """U-Net-like (``unet_small`` of the zoo) cut into 3 stages: its skip connections
    pass through the middle stage (``cut1.1`` -> ``cut2.2``); every row through stretch
    and split gets the whole model's CPU-build answer."""
    from paella.compiler_pass.build import compile_bundle
    from paella.models import zoo
    bundle = load_bundle(compile_bundle([zoo.get("unet_small", batch=b) for b in (1, 2, 4)],
                                        str(tmp_path / "unet"), stages=3))
    assert bundle.n_stages == 3
    m = Served(bundle, pairs=2, split_factor=0.0, t_comp_wait_us=400.0)
    v = m.info.variants[0]
    sent = []
    for i in range(8):
        x = m.rng.standard_normal(v.inputs[0].shape).astype(np.float32)
        slots, need = shapes.request_layout(m.info.variants, 1, 0)
        io = np.zeros(need, np.uint8)
        io[slots[0].offset:slots[0].offset + x.nbytes] = x.view(np.uint8).reshape(-1)
        req = Request(i, 1 + i % 2, 1, io, rows=1, layout=tuple(slots), on_complete=m._complete)
        m.ex.submit(req)
        sent.append((req, bundle.run_cpu_model({"x": x}, 1)["output0"]))
        m.advance(10e-6)
    m.ex.stage.run_until_idle()
    for req, want in sent:
        assert m.done[req.req_id] == (rings.OK, None)
        s = req.layout[1]
        got = req.io[s.offset:s.offset + s.nbytes].view(np.float32).reshape(s.shape)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    st = m.batcher.stats_dict()
    assert st["stretch"] > 0 and st["split"] > 0 and st["stage_runs"] >= 3 * st["new"]
    # Its boundary tensors (skips passing through the middle stage included) got
    # buffers of their own from the compiler: they stay in device memory.
    assert st["handoff"] == "device" and st["boundary_host_bytes"] == 0, st


def test_a_batch_runs_at_its_class_and_the_urgent_class_is_batched_first(bundle):
    """Issue 38: rows of an urgent class waiting beside best-effort ones form their own
    batch, first, and its stage jobs run at that class (the kernel scheduler's order)."""
    from paella.dispatcher.instruments import Instrument

    class Levels(Instrument):
        seen: list = []

        def op_released(self, op, t):
            self.seen.append((t, op.job.level))
    m = Served(bundle, pairs=2, split=False, stretch=False, window_us=200.0)
    m.ex.disp.instruments.add(Levels())
    answered: dict[int, float] = {}
    plain = m._complete
    m._complete = lambda req, st, err: (answered.setdefault(req.req_id, m.dev.now()),
                                        plain(req, st, err))
    best = [m.send(client=1) for _ in range(3)]
    for r in best:
        r.priority = 200
    urgent = [m.send(client=2) for _ in range(2)]
    for r in urgent:
        r.priority = 1
    m.ex.stage.run_until_idle()
    assert all(m.done[r.req_id] == (rings.OK, None) for r in best + urgent)
    levels = [lv for _, lv in Levels.seen if lv != 128]    # (128: the stages' profiling)
    assert set(levels) == {1, 200}
    assert levels[0] == 1                       # the urgent batch's first stage job goes first
    assert max(answered[r.req_id] for r in urgent) < min(answered[r.req_id] for r in best)


def _several_row_requests(s: "Served", bundle, seed: int, counts=(3, 1, 4, 2, 1)) -> list:
    """Requests of ``counts`` rows each, sent; ``req.want``: each row's CPU-build answer."""
    rng = np.random.default_rng(seed)
    reqs = []
    for rows in counts:
        slots, need = shapes.request_layout(s.info.variants, rows, 8)
        io = np.zeros(need, np.uint8)
        xs = [query(rng) for _ in range(rows)]
        for sl, a in zip(slots, (np.concatenate([a for a, _ in xs]),
                                 np.concatenate([m for _, m in xs]))):
            io[sl.offset:sl.offset + a.nbytes] = a.view(np.uint8).reshape(-1)
        req = Request(len(s.reqs), 1, 1, io, rows=rows, seq_len=8, layout=tuple(slots),
                      on_complete=s._complete)
        req.want = np.concatenate([reference(bundle, a, m) for a, m in xs])
        s.reqs.append(req)
        reqs.append(req)
        s.ex.submit(req)
    return reqs


@pytest.mark.parametrize("handoff", ["device", "host"])
def test_stage_boundaries_stay_in_device_memory_and_rows_equal_the_cpu_build(bundle, handoff):
    """``handoff = "device"``: every stage job is bound to its rows of the pair's device
    memory (no boundary copy in its plan, none through the host: ``boundary_host_bytes``
    stays 0) and multi-row requests still get the whole model's CPU-build answer per row,
    through stretch and split; "host" (the old path) gives the same answers and copies."""
    s = Served(bundle, split_factor=0.0, t_comp_wait_us=3000, handoff=handoff)
    reqs = _several_row_requests(s, bundle, 5)
    s.advance(0.2)
    assert all(s.done.get(r.req_id, (None,))[0] == rings.OK for r in reqs), s.done
    for r in reqs:
        np.testing.assert_allclose(s.output(r), r.want, rtol=1e-5, atol=1e-5)
    st = s.batcher.stats_dict()
    assert st["handoff"] == handoff and st["rows"] == 11 and st["exited"] == 5, st
    assert (st["boundary_host_bytes"] == 0) == (handoff == "device"), st
    if handoff == "device":
        # The stage jobs ran the hand-off plans: stage 1's without its H2D copies, and
        # no stage-0 job copied its outputs back.
        disp = s.ex.disp
        ran = {m.name.split("@")[0]: m for m in disp.models.values() if "handoff" in
               m.adaptor.plan.name}
        assert ran, "no hand-off model registered"
        for m in ran.values():
            kinds = [op.kind for op in m.adaptor.plan.ops]
            stage = int(m.adaptor.plan.name.split("/s")[-1][0])
            assert ("h2d" in kinds) == (stage == 0), (m.name, kinds)
            assert ("d2h" in kinds) == m.adaptor.plan.name.endswith("+fetch"), (m.name, kinds)


def test_the_simulated_device_carries_the_boundary_bytes_device_to_device(bundle):
    """After stage 0 of a batch, rows of boundary 1 in the pair's *device* memory hold
    stage 0's outputs (the CPU replay of stage 0's plan): the simulated device moved
    them, nothing on the host did."""
    s = Served(bundle, handoff="device", early_exits=[], split=False, stretch=False)
    rng = np.random.default_rng(3)
    x, mask = query(rng)
    slots, need = shapes.request_layout(s.info.variants, 1, 8)
    io = np.zeros(need, np.uint8)
    for sl, a in zip(slots, (x, mask)):
        io[sl.offset:sl.offset + a.nbytes] = a.view(np.uint8).reshape(-1)
    req = Request(0, 1, 1, io, rows=1, seq_len=8, layout=tuple(slots), on_complete=s._complete)
    s.reqs.append(req)
    s.ex.submit(req)
    s.advance(0.2)
    assert s.done[0][0] == rings.OK
    b = s.batcher
    s0 = next(k for k, v in enumerate(bundle.variants) if v.stage == 0 and v.rows == 1)
    want = bundle.run_stage_cpu({"x": x, "mask": mask}, s0)
    ctx = b.ctx
    for name, nb in b.stages.boundaries[(1, 8)]:
        got = ctx.view(b.dev.ptr(0, 1, 8, name, 0), nb)
        np.testing.assert_array_equal(got, np.ascontiguousarray(want[name]).view(np.uint8)
                                      .reshape(-1))
    assert b.stats.boundary_host_bytes == 0


def test_a_bad_handoff_option_is_refused_with_the_choices(bundle):
    with pytest.raises(Exception, match=r"handoff must be one of \['auto', 'device', 'host'\]"):
        Served(bundle, handoff="gpu")


def test_a_bound_job_cancelled_before_it_starts_gives_its_buffer_set_back(bundle):
    """A stage job submitted with a buffer set the batcher bound (the device hand-off)
    whose only client leaves before the job started: the dispatcher drops the job and
    the set goes back to its pool (none left in use, none lost), the pipeline goes on,
    and the next request reuses the freed set instead of making another."""
    m = Served(bundle, pairs=1, split=False, stretch=False, handoff="device")
    pools = m.batcher.pools
    gone = [m.send(client=2), m.send(client=2)]
    # Submitted (the batch's stage-0 job holds a bound set), not started: no step yet.
    assert m.batcher.stats.jobs >= 1 and sum(p.in_use for p in pools.values()) >= 1
    created = sum(p.created for p in pools.values())
    m.ex.cancel_client(2)
    m.ex.stage.run_until_idle()
    assert {m.done[r.req_id][0] for r in gone} == {rings.E_CANCELLED}
    assert all(p.in_use == 0 for p in pools.values()), {k: p.in_use for k, p in pools.items()}
    assert sum(len(p.free) for p in pools.values()) == sum(p.created for p in pools.values())
    again = m.send(client=1)
    m.ex.stage.run_until_idle()
    assert m.done[again.req_id] == (rings.OK, None)
    np.testing.assert_allclose(m.output(again), again.want, rtol=1e-5, atol=1e-5)
    assert all(p.in_use == 0 for p in pools.values())
    assert sum(p.created for p in pools.values()) <= created + 1   # (stage 1's set, at most)
