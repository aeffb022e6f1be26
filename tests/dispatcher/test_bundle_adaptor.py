"""A compiled bundle through the built-in plan adaptor and the Dispatcher, on the
simulated GPU: bound kernel arguments, params uploaded at registration, one buffer set
per concurrent request, sets returned to the pool, requests waiting for a set."""
from __future__ import annotations

import numpy as np
import pytest

from paella.bundle import load_bundle
from paella.dispatcher.adaptor import (BufferArg, Plan, PlanAdaptor, PlanOp, ScalarArg,
                                       plan_from_bundle)
from paella.dispatcher.core import STATUS_CANCELLED, STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.base import DeviceError, KernelInfo
from paella.dispatcher.devices.sim import SimDevice


class RecordingSim(SimDevice):
    """Records every launch's arguments, and whether each pointer-sized int argument
    lay inside a live allocation at launch time."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.launches: list[tuple[str, tuple, list[bool]]] = []

    def _record(self, func, args):
        live = []
        for a in args:
            if type(a) is int:
                try:
                    self.memory.view(a, 1)
                    live.append(True)
                except DeviceError:
                    live.append(False)
        self.launches.append((func.name, tuple(args), live))

    def _launch(self, func, grid, block, fp, dyn_smem, args, *rest):
        self._record(func, args)
        super()._launch(func, grid, block, fp, dyn_smem, args, *rest)

    def launch_checked(self, k, stream, launch_id, args=(), *rest, **kw):
        self._record(k.func, args)           # (the dispatcher's launch)
        super().launch_checked(k, stream, launch_id, args, *rest, **kw)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from paella.compiler_pass.build import compile_bundle
    from paella.models.tiny import tiny_cnn
    return load_bundle(compile_bundle(tiny_cnn(), tmp_path_factory.mktemp("bundle") / "b"))


def setup(bundle, cls=PlanAdaptor, **options):
    dev = RecordingSim("gtx1660s", n_streams=16, seed=0)
    d = Dispatcher(dev, "paella", profile_runs=0, buffer_sets_ahead=0)
    adaptor = cls.from_bundle(bundle, **options)
    mid = d.register_model("tiny", adaptor)
    return dev, d, adaptor, mid


def request(bundle, d, mid, req_id, done, client=0, seed=None):
    rng = np.random.default_rng(req_id if seed is None else seed)
    x = rng.standard_normal(bundle.inputs[0].shape).astype(np.float32)
    io = bundle.pack_inputs({"x": x})
    d.submit(Request(req_id, client, mid, io,
                     on_complete=lambda r, st, err: done.__setitem__(r.req_id, (st, err))))
    return io


def expected_args(variant, launch, ptrs) -> tuple:
    out = []
    for a in launch.args:
        out.append(ptrs[str(a.buffer)] + a.offset if a.buffer is not None
                   else np.dtype(a.dtype).type(a.scalar))
    return tuple(out)


def owner(variant, launches, sets, name, args):
    """The buffer sets whose binding of some launch of ``name`` equals ``args``."""
    return [s for s in sets for op in launches
            if op.kernel == name and expected_args(variant, op, s.ptrs) == args]


def test_params_are_uploaded_once_at_registration(bundle):
    dev, d, adaptor, mid = setup(bundle)
    params = bundle.param_bytes()
    assert set(adaptor.buffers) == {str(i) for i in params}
    for bid, data in params.items():
        assert dev.memory.view(adaptor.buffers[str(bid)], len(data)).tobytes() == data
    assert adaptor.buffer_pool.created == 0 and not dev.launches    # nothing per request yet


def test_launches_get_the_kernels_params_as_bound_pointers(bundle):
    dev, d, adaptor, mid = setup(bundle)
    assert d.models[mid].replay is not None
    v = bundle.variants[0]
    done = {}
    io = request(bundle, d, mid, 1, done)
    d.run_until_idle()
    assert done == {1: (STATUS_OK, None)}
    (bs,) = adaptor.buffer_pool.free
    launches = v.launches()
    assert [n for n, _, _ in dev.launches] == [op.kernel for op in launches]
    for (name, args, live), op in zip(dev.launches, launches):
        assert len(args) == len(v.kernel(name).params)
        assert args == expected_args(v, op, bs.ptrs)
        assert all(live) and len(live) == sum(a.buffer is not None for a in op.args)
    # The input landed in this request's input buffer at its buffer_offset.
    x = v.inputs[0]
    assert dev.memory.view(bs.ptrs[str(x.buffer)] + x.buffer_offset, x.nbytes).tobytes() == \
        io[x.offset:x.offset + x.nbytes].tobytes()
    # The output is read back from the set's output buffer: plant a pattern in it (the
    # simulated kernels compute nothing) and serve a second request with the same set.
    y = v.outputs[0]
    pattern = np.arange(y.nbytes, dtype=np.uint8)
    dev.memory.view(bs.ptrs[str(y.buffer)] + y.buffer_offset, y.nbytes)[:] = pattern
    io2 = request(bundle, d, mid, 2, done)
    # The sim runs the kernels after the pattern was planted; the D2H is the last op and
    # nothing writes that buffer on the simulated GPU.
    d.run_until_idle()
    assert done[2] == (STATUS_OK, None) and adaptor.buffer_pool.created == 1
    assert np.array_equal(io2[y.offset:y.offset + y.nbytes], pattern)


def test_concurrent_requests_use_disjoint_buffer_sets_returned_to_the_pool(bundle):
    dev, d, adaptor, mid = setup(bundle)
    v = bundle.variants[0]
    pool = adaptor.buffer_pool
    done = {}
    for i in range(2):
        request(bundle, d, mid, i, done)
    d.step()
    assert pool.in_use == 2 and pool.created == 2
    d.run_until_idle()
    assert done == {0: (STATUS_OK, None), 1: (STATUS_OK, None)}
    assert pool.in_use == 0 and len(pool.free) == 2 and pool.peak == 2
    a, b = pool.free
    ranges = sorted((p, p + n) for s in (a, b)
                    for p, n in zip(s.own, v_sizes(v)))
    assert all(hi <= lo for (_, hi), (lo, _) in zip(ranges, ranges[1:])), "buffers overlap"
    shared = {str(i) for i in bundle.param_bytes()}
    assert all(a.ptrs[k] == b.ptrs[k] for k in shared)
    assert all(a.ptrs[k] != b.ptrs[k] for k in a.ptrs if k not in shared)
    # Every launch used exactly one set's bindings; each set served a whole plan.
    users = {id(a): 0, id(b): 0}
    for name, args, _ in dev.launches:
        (s,) = owner(v, v.launches(), (a, b), name, args)
        users[id(s)] += 1
    assert list(users.values()) == [len(v.launches())] * 2
    request(bundle, d, mid, 2, done)
    d.run_until_idle()
    assert done[2][0] == STATUS_OK and pool.created == 2       # reused, not grown


def v_sizes(v):
    return [b.nbytes for b in v.buffers if b.kind != "param"]


def test_an_exhausted_pool_makes_requests_wait_in_arrival_order(bundle):
    dev, d, adaptor, mid = setup(bundle, max_buffer_sets=1)
    pool = adaptor.buffer_pool
    done = {}
    for i in range(3):
        request(bundle, d, mid, i, done)
    d.step()
    assert pool.in_use == 1 and len(pool.waiting) == 2
    d.run_until_idle()
    order = list(done)                          # completion order (on_complete's)
    assert order == [0, 1, 2] and all(st == STATUS_OK for st, _ in done.values())
    assert pool.created == 1 and pool.in_use == 0 and not pool.waiting
    names = [n for n, _, _ in dev.launches]
    per = [op.kernel for op in bundle.variants[0].launches()]
    assert names == per * 3                     # one set: the plans never interleave


def test_a_request_waiting_for_a_set_can_be_cancelled(bundle):
    dev, d, adaptor, mid = setup(bundle, max_buffer_sets=1)
    pool = adaptor.buffer_pool
    done = {}
    request(bundle, d, mid, 0, done, client=0)
    request(bundle, d, mid, 1, done, client=1)
    d.step()
    assert len(pool.waiting) == 1
    assert d.cancel_client(1) == 1
    assert done[1][0] == STATUS_CANCELLED and not pool.waiting
    d.run_until_idle()
    assert done[0] == (STATUS_OK, None) and pool.in_use == 0 and d.in_flight == 0


def test_the_pool_limit_defaults_to_the_budget_over_one_sets_size(bundle):
    per_set = sum(v_sizes(bundle.variants[0]))
    assert PlanAdaptor.from_bundle(bundle).max_buffer_sets == (1 << 30) // per_set
    assert PlanAdaptor.from_bundle(bundle, buffer_budget=3 * per_set + 1).max_buffer_sets == 3
    assert PlanAdaptor.from_bundle(bundle, buffer_budget=1).max_buffer_sets == 1


def test_plan_from_bundle_keeps_offsets_args_and_params(bundle):
    plan = plan_from_bundle(bundle)
    v = bundle.variants[0]
    assert plan.io_bytes == v.io_bytes and plan.cubin and plan.ptx
    assert set(plan.params) == {str(b.id) for b in v.buffers if b.kind == "param"}
    assert set(plan.request_buffers) == {str(b.id) for b in v.buffers if b.kind != "param"}
    launches = [op for op in plan.ops if op.kind == "launch"]
    assert plan.block_offsets                # the kernels take the block offset (slicing)
    for mine, theirs in zip(launches, v.launches()):
        assert mine.args == tuple(BufferArg(str(a.buffer), a.offset) if a.buffer is not None
                                  else ScalarArg(a.scalar, a.dtype) for a in theirs.args)
        assert mine.args[-1] == ScalarArg(0, "uint32")
    with pytest.raises(ValueError, match="variant 1 does not exist"):
        plan_from_bundle(bundle, 1)


def offset_plan() -> Plan:
    """A copy into the middle of a buffer, a launch with scalars and offset pointers,
    and a copy back out of the middle."""
    k = KernelInfo("k", 32, duration=10e-6)
    ops = [PlanOp("h2d", buffer="tmp", buffer_offset=32, io_offset=0, nbytes=16),
           PlanOp("launch", kernel="k", grid=(2,), block=(64,),
                  args=(BufferArg("tmp", 32), ScalarArg(7, "int32"), ScalarArg(0.5, "float32"),
                        BufferArg("w", 8))),
           PlanOp("d2h", buffer="tmp", buffer_offset=32, io_offset=16, nbytes=16)]
    return Plan("offsets", [k], ops, {"tmp": 128, "w": 16}, 32, params={"w": bytes(range(16))})


def test_scalars_keep_their_dtype_and_copies_their_buffer_offset():
    dev = RecordingSim("gtx1660s", n_streams=8)
    d = Dispatcher(dev, "paella", profile_runs=0, buffer_sets_ahead=0)
    adaptor = PlanAdaptor(offset_plan())
    mid = d.register_model("o", adaptor)
    io = np.zeros(32, np.uint8)
    io[:16] = np.arange(100, 116)
    done = {}
    d.submit(Request(0, 0, mid, io, on_complete=lambda r, st, err: done.__setitem__(0, (st, err))))
    d.run_until_idle()
    assert done == {0: (STATUS_OK, None)}
    (bs,) = adaptor.buffer_pool.free
    ((name, args, live),) = dev.launches
    assert args[0] == bs.ptrs["tmp"] + 32 and args[3] == adaptor.buffers["w"] + 8 and live == [True, True]
    assert type(args[1]) is np.int32 and args[1] == 7
    assert type(args[2]) is np.float32 and args[2] == np.float32(0.5)
    assert dev.memory.view(bs.ptrs["tmp"], 32).tobytes() == bytes(32)   # before the offset: untouched
    assert dev.memory.view(bs.ptrs["tmp"] + 32, 16).tobytes() == bytes(range(100, 116))
    assert np.array_equal(io[16:], np.arange(100, 116))                  # round trip via offset 32
    assert dev.memory.view(adaptor.buffers["w"], 16).tobytes() == bytes(range(16))


@pytest.mark.parametrize("change, message", [
    (lambda ops: [ops[0], PlanOp("launch", kernel="k", args=(BufferArg("nope"),)), ops[2]],
     "argument 0 names unknown buffer 'nope'"),
    (lambda ops: [ops[0], PlanOp("launch", kernel="k", args=(BufferArg("tmp", 128),)), ops[2]],
     "offset 128 is outside buffer 'tmp'"),
    (lambda ops: [ops[0], PlanOp("launch", kernel="k", args=(ScalarArg(1 << 40, "int32"),)), ops[2]],
     "is not a valid 'int32'|does not fit dtype 'int32'"),
    (lambda ops: [ops[0], PlanOp("launch", kernel="k", args=(3,)), ops[2]],
     "argument 0 is a int; use BufferArg or ScalarArg"),
    (lambda ops: [PlanOp("h2d", buffer="tmp", buffer_offset=120, nbytes=16)] + ops[1:],
     "16 bytes at offset 120 exceed buffer 'tmp'"),
    (lambda ops: [PlanOp("h2d", buffer="w", nbytes=16)] + ops[1:],
     "writes param buffer 'w', which is shared"),
])
def test_bad_plans_are_refused_naming_the_op(change, message):
    p = offset_plan()
    with pytest.raises(ValueError, match=message):
        Plan(p.name, p.kernels, change(list(p.ops)), p.buffers, p.io_bytes, params=p.params)


def test_daemon_serves_bundles_functionally_on_sim_and_plainly_elsewhere(bundle):
    from paella.dispatcher import daemon
    dev = SimDevice("gtx1660s", n_streams=8)
    functional = daemon.bundle_adaptor(bundle, "tiny#1", dev)
    assert isinstance(functional, PlanAdaptor) and functional.plan.effects   # replayed, with effect
    assert "run" not in type(functional).__dict__                      # no run() override

    class OtherDevice:
        backend = "cuda"
    plain = daemon.bundle_adaptor(bundle, "tiny#1", OtherDevice())
    assert type(plain) is PlanAdaptor and plain.plan.params and not plain.plan.effects
    # The sim's functional outputs still equal the CPU build's, through the Dispatcher.
    d = Dispatcher(dev, "paella", profile_runs=0, buffer_sets_ahead=0)
    mid = d.register_model("tiny", functional)
    done = {}
    io = request(bundle, d, mid, 5, done)
    x = io[:bundle.inputs[0].nbytes].view(np.float32).reshape(bundle.inputs[0].shape).copy()
    d.run_until_idle()
    assert done == {5: (STATUS_OK, None)}
    ref = bundle.run_cpu({"x": x})["output0"]
    assert np.allclose(bundle.unpack_outputs(io)["output0"], ref, rtol=1e-5)


def test_daemon_names_the_missing_driver_for_backend_cuda():
    from paella.dispatcher.daemon import ConfigError, DaemonConfig, open_device_for
    with pytest.raises(ConfigError, match=r"no NVIDIA driver found.*--backend sim"):
        open_device_for(DaemonConfig(backend="cuda"))
