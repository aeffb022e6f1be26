"""The C kernel core's own launches on a real GPU's driver (issue 36): it loads the driver
library and calls cuLaunchKernel itself. Here the library is a stub the test builds
(``stub_libcuda.c``), which records every call and hands it to the recording stand-in
driver (``cuda_fake_driver``), which checks the parameters and runs the kernel. The same
requests through the Python cuda backend (the reference) must make the same launches:
same kernels, dimensions, streams and parameter values, in the same order."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cuda.bindings import driver as real

from cuda_fake_driver import FakeDriver
from paella.dispatcher.adaptor import PlanAdaptor
from paella.dispatcher.core import STATUS_OK, Dispatcher
from paella.dispatcher.devices.cuda import CudaDevice

from test_bundle_on_cuda import PAIRS, bundle, compiled, drive, submit  # noqa: F401

HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, *[ctypes.c_uint] * 7, ctypes.c_uint64,
                        ctypes.c_uint64, ctypes.c_uint64)


class Call(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_uint64), ("stream", ctypes.c_uint64),
                ("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3),
                ("smem", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the stub driver library")
    out = tmp_path_factory.mktemp("stub") / "libcuda_stub.so"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(out),
                    str(Path(__file__).with_name("stub_libcuda.c"))], check=True)
    lib = ctypes.CDLL(str(out))
    lib.stub_call.restype = ctypes.POINTER(Call)
    return out, lib


def serve(bundle, kernel_core, stub=None, n=4, plan=None, implied=False, calls=None):
    """``implied``: the core's implied copies (off: the own path's schedule, launch for
    launch); ``calls``: a list given the driver's call names."""
    drv = FakeDriver()
    dev = CudaDevice(driver=drv, n_streams=4, notifq_slots=256, counter_pairs=PAIRS)
    hook = None
    if stub is not None:
        path, lib = stub
        dev.driver_library = str(path)

        def forward(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            r = drv.cuLaunchKernel(real.CUfunction(f), gx, gy, gz, bx, by, bz, smem,
                                   real.CUstream(stream), params, extra or 0)
            return int(r[0])
        hook = HOOK(forward)                 # (kept alive until the end of the run)
        lib.stub_reset()
        lib.stub_set_hook(hook)
    d = Dispatcher(dev, "paella", counter_pairs=PAIRS, profile_runs=0, kernel_core=kernel_core,
                   implied_copies=implied, buffer_sets_ahead=4)    # (4 made at registration)
    mid = d.register_model("tiny", PlanAdaptor(plan) if plan is not None
                           else PlanAdaptor.from_bundle(bundle))
    done = {}
    ios = [submit(bundle, d, mid, i, done) for i in range(n)]
    drive(d, drv)
    if stub is not None:
        stub[1].stub_set_hook(HOOK(0))
    launches = [(r.kernel, r.grid, r.block, r.dyn_smem, r.stream, r.args) for r in drv.launches]
    if calls is not None:
        calls.extend(c[0] for c in drv.calls)
    out = [io.tobytes() for io in ios]
    dev.close()
    del hook
    return done, launches, out, d


def test_the_c_core_launches_through_the_driver_as_the_python_backend(bundle, stub):
    ref_done, ref, ref_out, _ = serve(bundle, None)
    assert ref_done == {i: (STATUS_OK, None) for i in range(4)}
    done, got, out, d = serve(bundle, "c", stub)
    assert d.core is not None and d._core_driver
    assert done == ref_done
    assert got == ref                        # kernels, dims, streams, parameter values
    assert out == ref_out
    calls = [stub[1].stub_call(i).contents for i in range(stub[1].stub_calls())]
    assert len(calls) == len(got) > 0        # every launch went through the library
    for c, (name, grid, block, smem, stream, _) in zip(calls, got):
        assert (tuple(c.grid), tuple(c.block), c.smem) == (tuple(grid), tuple(block), smem)


def test_implied_copies_on_the_driver_save_their_events_and_answer_the_same(bundle, stub):
    """With implied copies (the default), an input copy that a kernel follows on its
    stream records no event: the same kernels, the same answers, and fewer cuEventRecord
    calls (kernel_core.implied_copies)."""
    ref_calls: list[str] = []
    ref_done, ref, ref_out, _ = serve(bundle, "c", stub, implied=False, calls=ref_calls)
    calls: list[str] = []
    done, got, out, d = serve(bundle, "c", stub, implied=True, calls=calls)
    assert d.core.implied_copies and d._core_driver
    assert done == ref_done == {i: (STATUS_OK, None) for i in range(4)}
    assert out == ref_out
    # The same launches; their order and streams may differ (a kernel goes behind its
    # copy at once, and the four requests overlap).
    strip = lambda rows: sorted((k, g, b, m) for k, g, b, m, _, _ in rows)  # noqa: E731
    assert strip(got) == strip(ref)
    h2d = sum(1 for op in PlanAdaptor.from_bundle(bundle).plan.ops if op.kind == "h2d")
    assert h2d > 0
    # (4 streams: at most half of them wait behind implied copies at once)
    assert ref_calls.count("cuEventRecord") - calls.count("cuEventRecord") >= 2
    assert calls.count("cuMemcpyHtoDAsync") == ref_calls.count("cuMemcpyHtoDAsync")


def test_a_refused_launch_fails_its_request_with_the_drivers_reason(bundle, stub):
    path, lib = stub
    drv = FakeDriver()
    dev = CudaDevice(driver=drv, n_streams=4, notifq_slots=256, counter_pairs=PAIRS)
    dev.driver_library = str(path)
    calls = {"n": 0}

    def refuse_second(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        calls["n"] += 1
        if calls["n"] == 2:
            return int(real.CUresult.CUDA_ERROR_INVALID_VALUE)
        r = drv.cuLaunchKernel(real.CUfunction(f), gx, gy, gz, bx, by, bz, smem,
                               real.CUstream(stream), params, extra or 0)
        return int(r[0])
    hook = HOOK(refuse_second)
    lib.stub_set_hook(hook)
    d = Dispatcher(dev, "paella", counter_pairs=PAIRS, profile_runs=0, kernel_core="c",
                   buffer_sets_ahead=0)
    mid = d.register_model("tiny", PlanAdaptor.from_bundle(bundle))
    done = {}
    for i in range(3):
        submit(bundle, d, mid, i, done)
    drive(d, drv)
    lib.stub_set_hook(HOOK(0))
    dev.close()
    failed = [k for k, (st, _) in done.items() if st != STATUS_OK]
    assert len(failed) == 1 and len(done) == 3
    assert "cuLaunchKernel" in done[failed[0]][1] and "CUDA_ERROR_INVALID_VALUE" in done[failed[0]][1]


def test_sliced_kernels_launch_through_the_driver_as_on_the_python_backend(bundle, stub):
    """A plan whose kernels are cut into slices (issue 38) on a real GPU's path: each
    slice is a 1-D launch whose last own parameter is its block offset, the slices of a
    kernel cover its grid once, and the C core's driver launches are the Python
    backend's."""
    from paella.dispatcher.adaptor import plan_from_bundle
    from paella.dispatcher.slicing import slice_plan
    import math
    plan = plan_from_bundle(bundle)
    assert plan.block_offsets
    cut = {i: max(1, math.prod(op.grid) // 2) for i, op in enumerate(plan.ops)
           if op.kind == "launch" and math.prod(op.grid) > 1}
    assert cut, "the test bundle has a kernel of more than one block"
    sliced = slice_plan(plan, cut)
    ref_done, ref, _, _ = serve(bundle, None, n=2, plan=sliced)
    assert ref_done == {i: (STATUS_OK, None) for i in range(2)}
    done, got, _, d = serve(bundle, "c", stub, n=2, plan=sliced)
    assert d._core_driver and done == ref_done and got == ref
    from collections import Counter
    want: Counter = Counter()                           # each cut kernel's blocks, per job
    for i in cut:
        op = plan.ops[i]
        want.update((op.kernel, b) for b in range(math.prod(op.grid)) for _ in range(2))
    seen: Counter = Counter()
    for name, grid, block, smem, stream, args in got:
        if any(name == k for k, _ in want):
            assert grid[1:] == (1, 1)                   # a slice: a 1-D launch
            # the block offset: the last own parameter, before the notifQ and launch id
            seen.update((name, b) for b in range(args[-3], args[-3] + grid[0]))
    assert seen == want                                 # every block once per job
