"""A compiled bundle through the Dispatcher and the cuda backend, on the recording
stand-in driver: params uploaded before the first request, every cuLaunchKernel with
the plan's pointers in order then the notifQ device pointer and the launch id, copies
at the buffer offsets, one buffer set per concurrent request."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from cuda_fake_driver import FakeDriver, fake_cubin, kernel_spec
from paella.bundle import load_bundle
from paella.dispatcher.adaptor import PlanAdaptor
from paella.dispatcher.core import STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.cuda import CudaDevice

PAIRS = 64


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from paella.compiler_pass.build import compile_bundle
    from paella.models.tiny import tiny_cnn
    return compile_bundle(tiny_cnn(), tmp_path_factory.mktemp("bundle") / "b")


@pytest.fixture
def bundle(compiled, tmp_path):
    """The compiled bundle with its cubin replaced by a stand-in image of the same
    kernels (parameter sizes from the manifest, then the notifQ pair)."""
    path = tmp_path / "b"
    shutil.copytree(compiled, path)
    b = load_bundle(path)
    sizes = {"buffer": 8}
    specs = [kernel_spec(k.name, [sizes.get(p["kind"]) or np.dtype(p["dtype"]).itemsize
                                  for p in k.params] + [8, 4], regs=k.registers, smem=k.static_smem)
             for k in b.kernels]
    cubin = path / b.manifest.files["cubin"]
    cubin.unlink()                      # a fresh file, never a shared one
    cubin.write_bytes(fake_cubin(75, specs))
    return load_bundle(path)


@pytest.fixture
def gpu():
    drv = FakeDriver()
    dev = CudaDevice(driver=drv, n_streams=4, notifq_slots=256, counter_pairs=PAIRS)
    ids = []
    launch = dev.launch_checked              # (the dispatcher's launch)

    def recording_launch(k, stream, launch_id, *a, **kw):
        ids.append(launch_id)
        return launch(k, stream, launch_id, *a, **kw)
    dev.launch_checked = recording_launch
    yield drv, dev, ids
    dev.close()


def drive(d, drv, limit=10_000):
    """The daemon's loop, with the stand-in GPU finishing its queued work each pass."""
    for _ in range(limit):
        if not d.in_flight:
            return
        d.step()
        drv.run()
    raise AssertionError(f"{d.in_flight} request(s) still in flight")


def submit(bundle, d, mid, req_id, done):
    x = np.random.default_rng(req_id).standard_normal(bundle.inputs[0].shape).astype(np.float32)
    io = bundle.pack_inputs({"x": x})
    d.submit(Request(req_id, 0, mid, io,
                     on_complete=lambda r, st, err: done.__setitem__(r.req_id, (st, err))))
    return io


def expected(op, ptrs):
    return [ptrs[str(a.buffer)] + a.offset if a.buffer is not None else a.scalar for a in op.args]


def test_params_are_uploaded_and_synchronized_before_the_first_request(bundle, gpu):
    drv, dev, _ = gpu
    d = Dispatcher(dev, "paella", counter_pairs=PAIRS, profile_runs=0, buffer_sets_ahead=0)
    adaptor = PlanAdaptor.from_bundle(bundle)
    d.register_model("tiny", adaptor)
    params = bundle.param_bytes()
    copies = [args for name, args in drv.calls if name == "cuMemcpyHtoDAsync"]
    assert sorted((int(a[0]), a[2]) for a in copies) == \
        sorted((adaptor.buffers[str(i)], len(b)) for i, b in params.items())
    names = drv.names()
    last_copy = max(i for i, n in enumerate(names) if n == "cuMemcpyHtoDAsync")
    assert "cuCtxSynchronize" in names[last_copy:]                  # waited for at registration
    assert "cuLaunchKernel" not in names
    for i, data in params.items():
        assert bytes(drv._device_view(adaptor.buffers[str(i)], len(data))) == data
    # The model's module is the bundle's cubin, loaded once.
    assert names.count("cuModuleLoadData") == 1


def test_every_launch_gets_the_plans_pointers_then_notifq_and_launch_id(bundle, gpu):
    drv, dev, ids = gpu
    d = Dispatcher(dev, "paella", counter_pairs=PAIRS, profile_runs=0, buffer_sets_ahead=0)
    adaptor = PlanAdaptor.from_bundle(bundle)
    mid = d.register_model("tiny", adaptor)
    assert d.models[mid].replay is not None              # the replayed plan, bindings and all
    v = bundle.variants[0]
    done = {}
    ios = [submit(bundle, d, mid, i, done) for i in range(2)]
    drive(d, drv)
    assert done == {0: (STATUS_OK, None), 1: (STATUS_OK, None)}
    pool = adaptor.buffer_pool
    assert pool.created == 2 and pool.in_use == 0
    sets = pool.free
    plan = v.launches()
    assert len(drv.launches) == 2 * len(plan) == len(ids)
    region = int(dev.region_dptr)
    used = {id(s): [] for s in sets}
    for rec, lid in zip(drv.launches, ids):
        own = rec.args[:-2]
        assert rec.args[-2:] == [region, lid]
        matches = [(s, op) for s in sets for op in plan
                   if op.kernel == rec.kernel and expected(op, s.ptrs) == own]
        assert len(matches) == 1, f"{rec.kernel}: {own} is not one set's binding"
        used[id(matches[0][0])].append(rec.kernel)
    assert all(names == [op.kernel for op in plan] for names in used.values())
    # Each request's input went to its own input buffer; outputs came back from its own.
    x, y = v.inputs[0], v.outputs[0]
    inputs = {bytes(drv._device_view(s.ptrs[str(x.buffer)] + x.buffer_offset, x.nbytes)) for s in sets}
    assert inputs == {io[x.offset:x.offset + x.nbytes].tobytes() for io in ios}
    pattern = (np.arange(y.nbytes) * 7 % 251).astype(np.uint8).tobytes()
    for s in sets:
        drv._device_view(s.ptrs[str(y.buffer)] + y.buffer_offset, y.nbytes)[:] = pattern
    io = submit(bundle, d, mid, 9, done)
    drive(d, drv)
    assert done[9] == (STATUS_OK, None)
    assert io[y.offset:y.offset + y.nbytes].tobytes() == pattern   # the stand-in computes nothing


def test_a_bundle_whose_kernels_disagree_with_the_compiled_ones_is_refused(bundle, gpu, tmp_path):
    """A launch whose arguments do not match the loaded kernel never reaches the driver."""
    drv, dev, _ = gpu
    cubin = bundle.path / bundle.manifest.files["cubin"]
    k = bundle.kernels[0]
    specs = [kernel_spec(x.name, [8] * (len(x.params) + (1 if x.name == k.name else 0)) + [8, 4],
                         regs=x.registers, smem=x.static_smem) for x in bundle.kernels]
    cubin.unlink()
    cubin.write_bytes(fake_cubin(75, specs))
    d = Dispatcher(dev, "paella", counter_pairs=PAIRS, profile_runs=0, buffer_sets_ahead=0)
    mid = d.register_model("tiny", PlanAdaptor.from_bundle(load_bundle(bundle.path)))
    done = {}
    submit(bundle, d, mid, 0, done)
    drive(d, drv)
    status, error = done[0]
    assert status != STATUS_OK and f"kernel {k.name!r} takes {len(k.params) + 1} argument(s)" in error
    assert not drv.launches


@pytest.mark.parametrize("edit,why", [({"group": 4}, "compiled with --group 4"),
                                      ({"instrumented": False}, r"without the Paella pass \(--no-instrument\)")])
def test_a_bundle_posting_by_another_group_is_refused_at_registration(bundle, gpu, edit, why):
    """Its kernels post one notification per 4 blocks (or none); the dispatcher reads by
    16 and reserves notifQ room by 16: refused with the fix, before any launch."""
    import json
    drv, dev, _ = gpu
    path = bundle.path / "manifest.json"
    m = json.loads(path.read_text())
    m.update(edit)
    path.write_text(json.dumps(m))
    d = Dispatcher(dev, "paella", counter_pairs=PAIRS, profile_runs=0, buffer_sets_ahead=0)
    with pytest.raises(ValueError, match=f"{why}, and this dispatcher reads notifications in "
                                         f"groups of 16: recompile it"):
        d.register_model("tiny", PlanAdaptor.from_bundle(load_bundle(bundle.path)))
    assert not drv.launches and not d.models


def test_the_daemon_pins_client_arenas_on_the_device(gpu, tmp_path):
    from paella.dispatcher.daemon import Daemon, DaemonConfig
    drv, dev, _ = gpu
    daemon = Daemon(DaemonConfig(socket=str(tmp_path / "s.sock")))
    arena = np.zeros(1 << 16, np.uint8)
    daemon._arena_mapped(3, arena)                      # before the device exists: remembered
    assert not drv.registered
    daemon.device = dev
    daemon._pin_arena(3, arena)
    assert drv.registered == {arena.ctypes.data: (arena.nbytes, int(drv.CU_MEMHOSTREGISTER_PORTABLE))}
    other = np.zeros(4096, np.uint8)
    daemon._arena_mapped(4, other)
    assert other.ctypes.data in drv.registered
    daemon._arena_released(3, arena)
    daemon._arena_released(4, other)
    assert not drv.registered and not daemon._arenas
    os.close(daemon._sig_r)
    os.close(daemon._sig_w)


def test_a_retired_model_frees_its_memory_and_unloads_its_module(bundle, gpu):
    """What a reload does to the model it replaces (Dispatcher.retire_model): once its
    last request is done, its params and buffer sets are freed and its module unloaded."""
    drv, dev, _ = gpu
    d = Dispatcher(dev, "paella", counter_pairs=PAIRS, profile_runs=0, buffer_sets_ahead=0)
    before = dict(drv.device_mem)           # (the notifQ's own, if any)
    mid = d.register_model("tiny", PlanAdaptor.from_bundle(bundle))
    done = {}
    submit(bundle, d, mid, 0, done)
    d.step()                                 # in flight: retiring waits for it
    d.retire_model(mid)
    assert "cuModuleUnload" not in drv.names()
    drive(d, drv)
    assert done == {0: (STATUS_OK, None)}
    assert mid not in d.models
    assert drv.modules == {} and drv.names().count("cuModuleUnload") == 1
    assert dev.allocated_bytes == 0 and dev._allocs == {}
    assert drv.device_mem.keys() == before.keys()
