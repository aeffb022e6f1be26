"""The cuda backend against the recording stand-in driver: call order, argument types
(replayed on the real binding), the notifQ region, launches, copies, events, errors."""
from __future__ import annotations

import gc
import logging

import numpy as np
import pytest
from cuda_fixtures import INFOS, KERNELS, PAIRS, SLOTS, image
from cuda.bindings import driver as real
from cuda_fake_driver import (REAL_DRIVER_PRESENT, FakeDriver, Violation, _STICKY_NAMES_OF_REAL,
                              fake_cubin, kernel_spec)

from paella import protocol
from paella.dispatcher.devices.base import DeviceError, KernelInfo, ModuleImage, OutOfMemory
from paella.dispatcher.devices.cuda import (STICKY, CudaContextLost, CudaDevice, CudaError, check)
from paella.gpus import preset

R = real.CUresult


def first(names, name):
    return names.index(name)


# --- start-up --------------------------------------------------------------------------

def test_startup_order_context_before_any_context_call(drv, dev):
    names = drv.names()
    assert names[0] == "cuInit"
    assert first(names, "cuDeviceGet") < first(names, "cuDevicePrimaryCtxRetain") < first(names, "cuCtxSetCurrent")
    for call in ("cuMemHostAlloc", "cuStreamCreate"):
        assert first(names, "cuCtxSetCurrent") < first(names, call)
    assert drv.primary_refs[0] == 1


def test_streams_are_a_pool_of_non_blocking_streams(drv, dev):
    creates = [args for name, args in drv.calls if name == "cuStreamCreate"]
    assert len(creates) == 4 == len(dev.streams)
    assert all(flags == int(real.CUstream_flags.CU_STREAM_NON_BLOCKING) for (flags,) in creates)


def test_props_come_from_device_attributes(dev):
    t4 = preset("t4")
    for f in ("arch", "sm_count", "max_threads_per_sm", "max_blocks_per_sm", "regs_per_sm",
              "regs_per_block", "smem_per_sm", "smem_per_block", "smem_per_block_optin",
              "reserved_smem_per_block", "max_threads_per_block", "warp_size"):
        assert getattr(dev.props, f) == getattr(t4, f), f
    assert dev.props.name == "Fake t4"
    # 40 SMs x 64 lanes x 2 FLOP x 1.59 GHz; 5.001 GHz x 2 x 256 bit
    assert dev.props.peak_flops == pytest.approx(8.1408e12)
    assert dev.props.mem_bw == pytest.approx(320.064e9)


@pytest.mark.parametrize("env,queues", [(None, 8), ("32", 32), ("4", 4), ("99", 32)])
def test_hw_queues_follow_cuda_device_max_connections(monkeypatch, env, queues):
    if env is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", env)
    d = CudaDevice(driver=FakeDriver(), notifq_slots=SLOTS, counter_pairs=PAIRS)
    assert d.props.hw_queues == queues and len(d.streams) == queues
    d.close()


def test_missing_device_ordinal_is_named():
    with pytest.raises(ValueError, match="CUDA device 3 does not exist.*1 device"):
        CudaDevice(3, driver=FakeDriver(devices=1))


# --- the notifQ region -------------------------------------------------------------------

def test_notifq_region_is_one_mapped_pinned_allocation_laid_out_as_protocol(drv, dev):
    allocs = [(i, a) for i, (n, a) in enumerate(drv.calls) if n == "cuMemHostAlloc"]
    assert len(allocs) == 1
    i, (size, flags) = allocs[0]
    assert size == protocol.notifq_region_bytes(SLOTS, PAIRS)
    assert flags == real.CU_MEMHOSTALLOC_DEVICEMAP | real.CU_MEMHOSTALLOC_PORTABLE
    gets = [(j, a) for j, (n, a) in enumerate(drv.calls) if n == "cuMemHostGetDevicePointer"]
    assert len(gets) == 1
    j, (p, gflags) = gets[0]
    assert j > i and p == dev._region_host and gflags == 0     # mapped before it is asked for
    assert int(dev.region_dptr) in drv.mapped and int(dev.region_dptr) != dev._region_host

    region = drv.region_of(int(dev.region_dptr))
    hdr = region[:16].view(np.uint32)
    assert (hdr[0], hdr[1], hdr[2]) == (0, SLOTS - 1, PAIRS - 1)
    assert not region.any() or (region[16:] == 0).all()          # the fake fills 0xA5: zeroed
    assert dev.notifq.dtype == np.uint64 and len(dev.notifq) == SLOTS
    dev.notifq[0] = 0x0102030405060708
    assert region[64:72].view(np.uint64)[0] == 0x0102030405060708    # slots at offset 64
    dev.notifq[0] = 0
    dev.counters[PAIRS - 1, 1] = 7
    off = protocol.notifq_counters_offset(SLOTS) + 8 * (PAIRS - 1) + 4
    assert region[off:off + 4].view(np.uint32)[0] == 7                # counters after the slots
    assert dev.counters.shape == (PAIRS, 2)


def test_counter_pairs_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        CudaDevice(driver=FakeDriver(), counter_pairs=6)


# --- modules --------------------------------------------------------------------------------

def test_cubin_for_the_device_loads_without_ptx(drv, dev):
    funcs = dev.load_module(image(75))
    assert set(funcs) == {"add1", "plain", "mixed"}
    loads = [a[0] for n, a in drv.calls if n == "cuModuleLoadData"]
    assert len(loads) == 1 and loads[0].startswith(b"FAKECUBIN 75")


def test_cubin_for_another_arch_falls_back_to_nul_terminated_ptx(drv, dev, caplog):
    caplog.set_level(logging.INFO, "paella.devices.cuda")
    funcs = dev.load_module(image(80))
    loads = [a[0] for n, a in drv.calls if n == "cuModuleLoadData"]
    assert [l[:8] for l in loads] == [b"FAKECUBI", b"FAKEPTX\n"]
    assert loads[1].endswith(b"\0")
    assert "JIT-compiling its PTX" in caplog.text and "CUDA_ERROR_NO_BINARY_FOR_GPU" in caplog.text
    assert "add1" in funcs


def test_no_usable_image_is_an_error_naming_the_fix(dev):
    with pytest.raises(CudaError, match=r"cuModuleLoadData\(m cubin\).*NO_BINARY_FOR_GPU.*rebuild"):
        dev.load_module(image(80, ptx=False))
    with pytest.raises(DeviceError, match="neither a usable cubin nor PTX"):
        dev.load_module(ModuleImage("empty", INFOS))


def test_driver_registers_and_smem_override_the_manifest(dev, caplog):
    caplog.set_level(logging.INFO, "paella.devices.cuda")
    f = dev.load_module(image())["mixed"]
    assert (f.info.regs_per_thread, f.info.static_smem) == (40, 1024)
    assert "driver reports 40 registers/thread and 1024 B" in caplog.text
    assert "manifest 32 and 0 B" in caplog.text
    assert dev.load_module(image())["add1"].info.regs_per_thread == 24


def test_missing_kernel_name_is_named(dev):
    bad = ModuleImage("m", [KernelInfo("nope", 8)], cubin=fake_cubin(75, KERNELS))
    with pytest.raises(CudaError, match=r"cuModuleGetFunction\(nope\).*CUDA_ERROR_NOT_FOUND"):
        dev.load_module(bad)


def test_a_missing_kernel_does_not_leave_its_module_loaded(drv, dev):
    bad = ModuleImage("m", [KernelInfo("add1", 24), KernelInfo("nope", 8)],
                      cubin=fake_cubin(75, KERNELS))
    with pytest.raises(CudaError, match="cuModuleGetFunction"):
        dev.load_module(bad)
    assert drv.modules == {} and dev._modules == []
    assert [n for n, _ in drv.calls if n == "cuModuleUnload"] == ["cuModuleUnload"]


def test_unload_module_unloads_once_and_keeps_the_others(drv, dev):
    a = dev.load_module(image())
    b = dev.load_module(image())
    assert len(drv.modules) == 2
    dev.unload_module(a)
    dev.unload_module(a)                     # again: nothing more to unload
    assert len(drv.modules) == 1 and len(dev._modules) == 1
    assert [n for n, _ in drv.calls].count("cuModuleUnload") == 1
    assert b["add1"].module is dev._modules[0]
    dev.close()                              # the rest at close, with no double unload
    assert drv.modules == {}


def test_allocated_bytes_follow_alloc_and_free(dev):
    p = dev.alloc(1000)
    q = dev.alloc(24)
    assert dev.allocated_bytes == 1024
    dev.free(p)
    assert dev.allocated_bytes == 24
    dev.free(q)
    assert dev.allocated_bytes == 0



def test_the_memory_size_comes_from_the_driver_and_a_full_gpu_raises_out_of_memory():
    drv = FakeDriver(preset("t4").with_(mem_bytes=4096))
    dev = CudaDevice(driver=drv, n_streams=2, notifq_slots=SLOTS, counter_pairs=PAIRS)
    try:
        assert dev.props.mem_bytes == 4096   # cuDeviceTotalMem
        p = dev.alloc(4000)
        with pytest.raises(OutOfMemory, match=r"cuMemAlloc\(200 B\) failed: "
                                              r"CUDA_ERROR_OUT_OF_MEMORY.*fix:") as e:
            dev.alloc(200)
        assert isinstance(e.value, CudaError) and not dev.context_lost   # not sticky
        assert dev.allocated_bytes == 4000
        dev.free(p)
        dev.free(dev.alloc(200))             # the device goes on
    finally:
        dev.close()


class PreCuda132Driver(FakeDriver):
    """A driver before CUDA 13.2: cuFuncGetParamCount is missing. ``binding="new"``: the
    binding knows the name and raises its RuntimeError when called (cuda-python 13.x on
    an older driver); ``"old"``: the binding does not have the name at all (12.x)."""

    def __init__(self, binding: str):
        super().__init__()
        self.binding = binding

    def __getattribute__(self, name):
        if name == "cuFuncGetParamCount":
            if object.__getattribute__(self, "binding") == "old":
                raise AttributeError(name)
            def missing(*a):
                raise RuntimeError('Function "cuFuncGetParamCount" not found')
            return missing
        return super().__getattribute__(name)


@pytest.mark.parametrize("binding", ["new", "old"])
def test_kernels_load_on_drivers_without_cuFuncGetParamCount(binding):
    """CUDA 12.4-13.1 drivers: parameters are counted with cuFuncGetParamInfo alone, up to
    the index the driver refuses, and the kernels load and launch as on a newer one."""
    drv = PreCuda132Driver(binding)
    dev = CudaDevice(driver=drv, n_streams=4, notifq_slots=SLOTS, counter_pairs=PAIRS)
    try:
        funcs = dev.load_module(image())
        assert [len(funcs[k].handle.params.sizes) for k in ("add1", "plain", "mixed")] == [4, 1, 4]
        x = dev.alloc(4 * 8)
        dev.launch(funcs["add1"], 3, 64, stream=2, launch_id=7, args=(x, 8))
        assert drv.launches[-1].args == [x, 8, int(dev.region_dptr), 7]
    finally:
        dev.close()


# --- launches ---------------------------------------------------------------------------------

def test_instrumented_launch_passes_own_args_then_region_pointer_then_launch_id(drv, dev):
    f = dev.load_module(image())["add1"]
    x = dev.alloc(4 * 8)
    dev.launch(f, 3, 64, stream=2, launch_id=0xABCDE, args=(x, 8))
    (rec,) = drv.launches
    assert len(rec.args) == 4
    assert rec.args == [x, 8, int(dev.region_dptr), 0xABCDE]
    assert [len(r) for r in rec.raw] == [8, 4, 8, 4]
    assert rec.stream == int(dev._streams[2]) and rec.grid == (3, 1, 1) and rec.block == (64, 1, 1)


def test_uninstrumented_launch_passes_only_its_own_args(drv, dev):
    f = dev.load_module(image())["plain"]
    dev.launch(f, 1, 32, stream=0, launch_id=5, args=(0x1234,), instrumented=False)
    assert drv.launches[-1].args == [0x1234]


def test_an_instrumented_launch_after_an_uninstrumented_one_posts_to_the_notifq(drv, dev):
    """An uninstrumented launch of an instrumentable kernel puts its caller's value in the
    notifQ pointer's slot; the next instrumented launch passes the region again."""
    f = dev.load_module(image())["add1"]
    x = dev.alloc(4 * 8)
    other = CudaDevice(driver=drv, n_streams=1, notifq_slots=SLOTS, counter_pairs=PAIRS)
    try:
        theirs = int(other.region_dptr)              # (another mapped region: the caller's)
        dev.launch(f, 1, 32, stream=0, launch_id=0, args=(x, 8, theirs, 1), instrumented=False)
        dev.launch(f, 1, 32, stream=0, launch_id=9, args=(x, 8))
        assert drv.launches[-2].args == [x, 8, theirs, 1]
        assert drv.launches[-1].args == [x, 8, int(dev.region_dptr), 9]
    finally:
        other.close()


def test_instrumented_launch_of_a_kernel_without_the_pass_is_refused(drv, dev):
    f = dev.load_module(image())["plain"]
    with pytest.raises(DeviceError, match="compiled without the Paella pass"):
        dev.launch(f, 1, 32, stream=0, launch_id=5, args=())
    assert not drv.launches


@pytest.mark.parametrize("args,exc,msg", [
    ((1,), DeviceError, "takes 2 argument"),
    ((1, 2, 3), DeviceError, "takes 2 argument"),
    ((1, "x"), TypeError, "parameter 1 cannot take a str"),
    ((1, 1 << 33), ValueError, "parameter 1 is 4 bytes"),
    ((1, np.float64(1.0)), TypeError, "4 bytes but a float64"),
])
def test_argument_mismatch_is_refused_before_the_driver(drv, dev, args, exc, msg):
    f = dev.load_module(image())["add1"]
    with pytest.raises(exc, match=msg):
        dev.launch(f, 1, 32, stream=0, launch_id=1, args=args)
    assert not drv.launches


def test_scalar_encodings_follow_the_compiled_parameter_sizes(drv, dev):
    f = dev.load_module(image())["mixed"]              # (4, 8 | region, id)
    dev.launch(f, 1, 32, stream=0, launch_id=2, args=(np.float32(1.5), -2))
    raw = drv.launches[-1].raw
    assert np.frombuffer(raw[0], np.float32)[0] == 1.5
    assert np.frombuffer(raw[1], np.int64)[0] == -2
    dev.launch(f, 1, 32, stream=0, launch_id=3, args=(2.5, 2.5))
    raw = drv.launches[-1].raw
    assert np.frombuffer(raw[0], np.float32)[0] == 2.5 and np.frombuffer(raw[1], np.float64)[0] == 2.5


def test_counter_pair_is_zeroed_before_each_launch(drv, dev):
    f = dev.load_module(image())["add1"]
    x = dev.alloc(64)
    dev.counters[3] = (9, 9)          # left over from an earlier launch with the same index
    dev.launch(f, 1, 32, stream=0, launch_id=3 + PAIRS, args=(x, 1))   # the fake checks (0, 0)
    assert len(drv.launches) == 1


def test_the_stand_in_catches_a_dirty_counter_pair(drv, dev):
    f = dev.load_module(image())["add1"]
    dev.counters[1] = (0, 4)
    f.handle.params.set(3, 1)                             # launch id 1 -> counter pair 1
    with pytest.raises(Violation, match="not zeroed"):
        drv.cuLaunchKernel(f.handle.fn, 1, 1, 1, 32, 1, 1, 0, dev._streams[0], f.handle.params.address, 0)


def test_a_counter_pair_still_in_flight_is_not_reused(drv, dev):
    f = dev.load_module(image())["add1"]
    x = dev.alloc(4 * 64)
    dev.launch(f, 20, 32, stream=0, launch_id=1, args=(x, 1))
    with pytest.raises(DeviceError, match=r"counter pair 1 is still used by launch 1 \(0/20"):
        dev.launch(f, 1, 32, stream=1, launch_id=1 + PAIRS, args=(x, 1))
    drv.run()
    dev.launch(f, 1, 32, stream=1, launch_id=1 + PAIRS, args=(x, 1))
    assert [l.launch_id for l in drv.launches] == [1, 1 + PAIRS]


def test_dynamic_shared_memory_cap_is_raised_once_before_the_launch(drv, dev):
    f = dev.load_module(image())["add1"]
    x = dev.alloc(64)
    dev.launch(f, 1, 32, stream=0, launch_id=1, args=(x, 1), dyn_smem=40 * 1024)
    assert "cuFuncSetAttribute" not in drv.names()              # within the 48 KiB default
    dev.launch(f, 1, 32, stream=0, launch_id=2, args=(x, 1), dyn_smem=56 * 1024)
    dev.launch(f, 1, 32, stream=0, launch_id=3, args=(x, 1), dyn_smem=56 * 1024)
    names = drv.names()
    sets = [a for n, a in drv.calls if n == "cuFuncSetAttribute"]
    assert len(sets) == 1 and sets[0][2] == 56 * 1024
    assert sets[0][1] == real.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    i = names.index("cuFuncSetAttribute")
    assert names[i + 1] == "cuLaunchKernel"


def test_end_to_end_copies_launch_and_notifications(drv, dev):
    f = dev.load_module(image())["add1"]
    host = np.arange(40, dtype=np.float32)
    out = np.zeros_like(host)
    x = dev.alloc(host.nbytes)
    dev.memcpy_htod(x, host, stream=1)
    dev.launch(f, 40, 128, stream=1, launch_id=77, args=(x, 40))
    dev.memcpy_dtoh(out, x, stream=1)
    assert not dev.stream_query(1)
    dev.synchronize()
    assert dev.stream_query(1)
    np.testing.assert_array_equal(out, host + 1)
    kind, sm, count, lid = protocol.decode_array(dev.notifq[dev.notifq != 0])
    assert (lid == 77).all()
    assert sorted(count[kind == protocol.PLACEMENT]) == [8, 16, 16]      # ceil(40/16) entries
    assert sorted(count[kind == protocol.COMPLETION]) == [8, 16, 16]
    assert dev.notifq_tail == 6
    assert tuple(dev.counters[77 % PAIRS]) == (40, 40)


# --- copies and host memory ----------------------------------------------------------------------

def test_copy_source_is_kept_alive_until_the_copy_completes(drv, dev):
    x = dev.alloc(4096)
    dev.memcpy_htod(x, np.full(1024, 7, dtype=np.int32), stream=0)
    gc.collect()
    for _ in range(100):                       # churn the allocator
        np.full(1024, -1, dtype=np.int32)
    out = np.zeros(1024, dtype=np.int32)
    dev.memcpy_dtoh(out, x, stream=0)
    dev.synchronize()
    assert (out == 7).all()


def test_register_host_pins_the_arena_and_silences_the_pageable_warning(drv, dev, caplog):
    arena = np.zeros(1 << 16, dtype=np.uint8)
    dev.register_host(arena)
    (args,) = [a for n, a in drv.calls if n == "cuMemHostRegister"]
    assert args == (arena.ctypes.data, arena.nbytes, real.CU_MEMHOSTREGISTER_PORTABLE)
    x = dev.alloc(256)
    dev.memcpy_htod(x, arena[:256], stream=0)
    assert "pageable" not in caplog.text
    with pytest.raises(DeviceError, match="already registered"):
        dev.register_host(arena)
    dev.memcpy_dtoh(np.zeros(8, np.uint8), x, stream=0)
    dev.memcpy_dtoh(np.zeros(8, np.uint8), x, stream=0)
    assert caplog.text.count("pageable host memory") == 1          # logged once
    dev.unregister_host(arena)
    assert not drv.registered


def test_free_of_an_unknown_pointer_is_an_error(dev):
    p = dev.alloc(16)
    dev.free(p)
    with pytest.raises(DeviceError, match="did not allocate"):
        dev.free(p)


# --- events and completion ---------------------------------------------------------------------

def test_event_not_ready_is_not_an_error_and_events_are_recycled(drv, dev):
    x = dev.alloc(64)
    dev.memcpy_htod(x, np.zeros(16, np.float32), stream=0)
    ev = dev.record_event(0)
    assert dev.event_query(ev) is False
    drv.run()
    assert dev.event_query(ev) is True
    n_queries = drv.names().count("cuEventQuery")
    assert dev.event_query(ev) is True                    # complete stays complete, no call
    assert drv.names().count("cuEventQuery") == n_queries
    creates = drv.names().count("cuEventCreate")
    dev.event_query(dev.record_event(1))                  # reuses a pooled CUevent
    assert drv.names().count("cuEventCreate") == creates


def test_event_query_errors_other_than_not_ready_raise(drv, dev):
    ev = dev.record_event(0)
    drv.fail("cuEventQuery", R.CUDA_ERROR_INVALID_HANDLE)
    with pytest.raises(CudaError, match="cuEventQuery failed: CUDA_ERROR_INVALID_HANDLE"):
        dev.event_query(ev)


def test_on_complete_callbacks_fire_from_poll_in_stream_order(drv, dev):
    f = dev.load_module(image())["add1"]
    x = dev.alloc(64)
    log = []
    dev.memcpy_htod(x, np.zeros(4, np.float32), stream=0, on_complete=lambda: log.append("h2d"))
    dev.launch(f, 1, 32, stream=0, launch_id=1, args=(x, 4), on_complete=lambda: log.append("k"))
    dev.memcpy_dtoh(np.zeros(4, np.float32), x, stream=1, on_complete=lambda: log.append("d2h"))
    dev.poll()
    assert log == []
    drv.run(int(dev._streams[0]))
    dev.poll()
    assert log == ["h2d", "k"]
    dev.synchronize()
    assert log == ["h2d", "k", "d2h"]


# --- errors -------------------------------------------------------------------------------------------

STARTUP_CALLS = ["cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
                 "cuDeviceGetAttribute", "cuDeviceGetName", "cuDeviceTotalMem", "cuMemHostAlloc", "cuMemHostGetDevicePointer",
                 "cuStreamCreate"]


@pytest.mark.parametrize("call", STARTUP_CALLS)
def test_every_failing_startup_call_raises_naming_it_and_releases_the_context(call):
    drv = FakeDriver()
    drv.fail(call, R.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(CudaError, match=rf"{call}\b.* failed: CUDA_ERROR_INVALID_VALUE"):
        CudaDevice(driver=drv, n_streams=2, notifq_slots=SLOTS, counter_pairs=PAIRS)
    assert drv.primary_refs[0] == 0
    assert not drv.host and not drv.streams


def _load(dev):
    dev.load_module(image())


def _launch(dev):
    f = dev.load_module(image())["add1"]
    dev.launch(f, 1, 32, stream=0, launch_id=1, args=(0, 1))


OPERATIONS = [
    ("cuModuleLoadData", _load), ("cuModuleGetFunction", _load), ("cuFuncGetAttribute", _load),
    ("cuFuncGetParamCount", _load), ("cuFuncGetParamInfo", _load), ("cuLaunchKernel", _launch),
    ("cuMemAlloc", lambda d: d.alloc(8)), ("cuMemFree", lambda d: d.free(d.alloc(8))),
    ("cuMemcpyHtoDAsync", lambda d: d.memcpy_htod(d.alloc(8), np.zeros(2, np.float32), 0)),
    ("cuMemcpyDtoHAsync", lambda d: d.memcpy_dtoh(np.zeros(2, np.float32), d.alloc(8), 0)),
    ("cuEventCreate", lambda d: d.record_event(0)), ("cuEventRecord", lambda d: d.record_event(0)),
    ("cuEventQuery", lambda d: d.event_query(d.record_event(0))),
    ("cuStreamQuery", lambda d: d.stream_query(0)), ("cuCtxSynchronize", lambda d: d.synchronize()),
    ("cuMemHostRegister", lambda d: d.register_host(np.zeros(64, np.uint8))),
]


@pytest.mark.parametrize("call,op", OPERATIONS, ids=[c for c, _ in OPERATIONS])
def test_every_failing_call_raises_naming_the_call_and_the_result(drv, dev, call, op):
    drv.fail(call, R.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(CudaError, match=rf"{call}\b.* failed: CUDA_ERROR_OUT_OF_MEMORY .*fix: free") as ei:
        op(dev)
    assert ei.value.call.startswith(call) and ei.value.result == R.CUDA_ERROR_OUT_OF_MEMORY
    assert not isinstance(ei.value, CudaContextLost)


def test_sticky_error_is_context_lost_and_stays(drv, dev):
    x = dev.alloc(64)
    drv.fail("cuCtxSynchronize", R.CUDA_ERROR_ILLEGAL_ADDRESS)
    with pytest.raises(CudaContextLost, match="ILLEGAL_ADDRESS.*context is lost.*restart") as ei:
        dev.synchronize()
    assert isinstance(ei.value, CudaError) and dev.context_lost is ei.value
    with pytest.raises(CudaContextLost):
        dev.memcpy_htod(x, np.zeros(4, np.float32), 0)
    dev.close()                                           # logs, does not raise


def test_sticky_set_matches_the_bindings_documentation():
    assert STICKY == _STICKY_NAMES_OF_REAL()
    assert R.CUDA_ERROR_LAUNCH_FAILED in STICKY and R.CUDA_ERROR_OUT_OF_MEMORY not in STICKY


def test_check_unwraps_every_return_convention():
    assert check((R.CUDA_SUCCESS,), "x") is None
    assert check((R.CUDA_SUCCESS, 5), "x") == 5
    assert check((R.CUDA_SUCCESS, 1, 2), "x") == (1, 2)
    assert check(R.CUDA_SUCCESS, "x") is None
    with pytest.raises(CudaError, match=r"^cuFoo failed: CUDA_ERROR_NOT_READY \(This indicates"):
        check((R.CUDA_ERROR_NOT_READY, None), "cuFoo")


# --- shutdown -----------------------------------------------------------------------------------------

def test_close_releases_everything_once(drv):
    d = CudaDevice(driver=drv, n_streams=2, notifq_slots=SLOTS, counter_pairs=PAIRS)
    d.load_module(image())
    d.alloc(64)
    d.register_host(np.zeros(64, np.uint8))
    d.event_query(d.record_event(0))
    d.close()
    assert not drv.streams and not drv.host and not drv.device_mem and not drv.modules
    assert not drv.registered and not drv.events and drv.primary_refs[0] == 0
    assert len(d.notifq) == 0                              # no view into freed memory
    n = len(drv.calls)
    d.close()
    assert len(drv.calls) == n


# --- the stand-in itself ----------------------------------------------------------------------------------

@pytest.mark.skipif(REAL_DRIVER_PRESENT, reason="the binding replay runs only without a real driver")
def test_the_stand_in_replays_calls_on_the_real_binding_to_check_types(drv, dev):
    mod = dev._modules[0] if dev._modules else None
    dev.load_module(image())
    mod = dev._modules[0]
    with pytest.raises(Violation, match="real binding rejects"):
        drv.cuModuleGetFunction(mod, "add1")               # str, not bytes
    with pytest.raises(Violation, match="real binding rejects"):
        drv.cuLaunchKernel(object(), 1, 1, 1, 1, 1, 1, 0, dev._streams[0], 0, 0)


def test_the_stand_in_refuses_host_pointers_as_notifq(drv, dev):
    f = dev.load_module(image())["add1"]
    pack = f.handle.params
    pack.set(2, dev._region_host)                         # the bug: host instead of device pointer
    pack.set(3, 1)
    pack.set(0, 0)
    pack.set(1, 1)
    with pytest.raises(Violation, match="not a device pointer"):
        drv.cuLaunchKernel(f.handle.fn, 1, 1, 1, 32, 1, 1, 0, dev._streams[0], pack.address, 0)


def test_a_dispatcher_numbering_more_counter_pairs_than_the_device_has_is_refused(dev):
    """Launches on pairs p and p + PAIRS would share the device's counters."""
    from paella.dispatcher.core import Dispatcher
    assert dev.counter_pairs == PAIRS
    with pytest.raises(ValueError, match=rf"counter_pairs \({2 * PAIRS}\) exceed the device's "
                                         rf"notifQ counter pairs \({PAIRS}\)"):
        Dispatcher(dev, "paella", counter_pairs=2 * PAIRS)
    assert Dispatcher(dev, "paella", counter_pairs=PAIRS).tracker is not None


def test_a_faulting_instrumented_kernel_surfaces_through_poll(drv, dev, monkeypatch):
    """An instrumented kernel posts through the notifQ, not an event: when it faults and
    nothing else is in flight, poll()'s periodic query of the driver still returns the
    sticky error, as CudaContextLost (the daemon then fails its requests and exits)."""
    f = dev.load_module(image())["add1"]
    x = dev.alloc(4 * 8)
    dev.launch(f, 3, 64, stream=2, launch_id=1, args=(x, 8))
    dev.poll()                                            # healthy: nothing raised
    drv.sticky = R.CUDA_ERROR_ILLEGAL_ADDRESS             # the kernel faulted on the GPU
    monkeypatch.setattr(dev, "_next_health", 0.0)
    with pytest.raises(CudaContextLost, match="cuStreamQuery \\(health check\\)"):
        dev.poll()
    assert dev.context_lost is not None
