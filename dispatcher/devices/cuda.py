"""The real GPU, through cuda-python's driver API (``cuda.bindings.driver``).

Everything the dispatcher needs from a GPU, in the order it happens:

* **Start-up.** ``cuInit``; pick the device; retain its *primary* context (the one the
  runtime API and other libraries share) and make it current; read the limits the
  scheduler needs with ``cuDeviceGetAttribute`` into a :class:`~paella.gpus.GpuSpec`;
  create a pool of non-blocking streams (they never serialise against the legacy
  default stream); allocate the notifQ region.
* **notifQ.** ONE pinned, device-mapped host region laid out exactly as
  :mod:`paella.protocol` specifies (header, slots at offset 64, counter pairs after),
  from ``cuMemHostAlloc(DEVICEMAP | PORTABLE)``. The kernels get its *device* address
  (``cuMemHostGetDevicePointer``); the dispatcher reads :attr:`notifq`, a numpy view of
  just the slots. Memory ordering: see :meth:`CudaDevice._alloc_notifq`.
* **Modules.** The cubin is loaded first; if the driver says it is not for this GPU the
  PTX is JIT-compiled instead (logged). Each kernel's registers and static shared memory
  come from ``cuFuncGetAttribute`` and *override* the manifest (a difference is logged);
  its parameter count and sizes come from ``cuFuncGetParamCount``/``cuFuncGetParamInfo``,
  so a launch whose arguments do not match the compiled kernel is refused before it
  reaches the GPU.
* **Launch.** ``cuLaunchKernel`` with the kernel's own arguments followed, for an
  instrumented kernel, by the region's device pointer (8 bytes) and the uint32 launch
  id. Arguments go in as an array of pointers (``kernelParams``), built once per kernel;
  a launch only rewrites the values (the driver copies them during the call). The
  launch's counter pair in the region is zeroed by the host before the launch.
* **Copies** are ``cuMemcpyHtoDAsync``/``cuMemcpyDtoHAsync``; client arenas are
  page-locked with :meth:`CudaDevice.register_host` (``cuMemHostRegister``) so that the
  copies are true asynchronous DMA. The host array is kept alive until the copy is done.
* **Completion** of uninstrumented work is learned through events (``cuEventRecord`` and
  ``cuEventQuery``, whose ``CUDA_ERROR_NOT_READY`` means "not yet", not failure).
* **Errors.** Every driver result goes through :func:`check`, which raises
  :class:`CudaError` naming the call and the CUresult. A *sticky* error (the context is
  lost; every later call fails the same way) raises :class:`CudaContextLost` so the
  daemon can fail its in-flight jobs and exit non-zero for its service manager.

Not yet run on hardware: everything here is checked against a recording stand-in for
the driver module (``tests/cuda``) and the real binding's argument conversion.
"""
from __future__ import annotations

import collections
import ctypes
import logging
import os
import struct
import time
from dataclasses import replace
from typing import Any, Callable

import numpy as np
from cuda.bindings import driver as _drv

from paella import protocol
from paella.dispatcher.devices.base import (Callback, Device, DeviceError, DeviceLost, Dim3,
                                            Function, KernelInfo, ModuleImage, OutOfMemory)
from paella.gpus import GpuSpec
from paella.occupancy import Footprint

log = logging.getLogger("paella.devices.cuda")

CUresult = _drv.CUresult
_SUCCESS = CUresult.CUDA_SUCCESS
_NOT_READY = CUresult.CUDA_ERROR_NOT_READY

#: Results the driver documents as leaving the process "in an inconsistent state": any
#: further CUDA work returns the same error and the process must be restarted. A test
#: checks this set against the installed binding's own documentation.
#: (A name an older binding lacks is skipped, not an import error.) CUDA_ERROR_ASSERT is
#: documented in other words ("the context cannot be used anymore, and must be destroyed")
#: but means the same: every later call fails.
STICKY = frozenset(r for r in (getattr(CUresult, n, None) for n in (
    "CUDA_ERROR_CONTAINED", "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_TENSOR_MEMORY_LEAK", "CUDA_ERROR_MPS_CLIENT_TERMINATED",
    "CUDA_ERROR_EXTERNAL_DEVICE", "CUDA_ERROR_ASSERT")) if r is not None)

#: No kernel has more: 32 KB of parameters (CUDA 12.1's limit) of at least 4 bytes each.
MAX_KERNEL_PARAMS = 8192

#: cubin load failures after which the PTX is JIT-compiled instead.
_CUBIN_NOT_FOR_THIS_GPU = frozenset((CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU,
                                     CUresult.CUDA_ERROR_INVALID_IMAGE))

_FIXES = {
    CUresult.CUDA_ERROR_NOT_INITIALIZED: "cuInit must succeed first (is the NVIDIA driver loaded?)",
    CUresult.CUDA_ERROR_NO_DEVICE: "no CUDA-capable GPU is visible: check nvidia-smi and "
                                   "CUDA_VISIBLE_DEVICES, or use --backend sim",
    CUresult.CUDA_ERROR_INVALID_DEVICE: "the device ordinal does not exist: check nvidia-smi",
    CUresult.CUDA_ERROR_OUT_OF_MEMORY: "free device or pinned memory, or lower the pool sizes",
    CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU: "rebuild the bundle for this GPU's sm_XX or ship its PTX",
    CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION: "the PTX is newer than the driver: update the "
                                                 "NVIDIA driver or build with an older nvcc",
    CUresult.CUDA_ERROR_INVALID_PTX: "the PTX does not compile for this GPU: rebuild the bundle",
    CUresult.CUDA_ERROR_NOT_FOUND: "the kernel name is not in the module: rebuild the bundle",
    CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: "too many registers or threads per block for "
                                                 "this GPU: recompile with a register cap",
    CUresult.CUDA_ERROR_INVALID_CONTEXT: "no current CUDA context in this thread: use the device "
                                         "from the thread that opened it",
    CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: "the host range is already page-locked: "
                                                        "register each arena once",
}


class CudaError(DeviceError):
    """A driver call failed. ``call`` is the driver function, ``result`` the CUresult."""

    def __init__(self, call: str, result: Any, detail: str = ""):
        self.call, self.result = call, result
        name = getattr(result, "name", str(result))
        msg = f"{call} failed: {name}"
        if isinstance(result, CUresult):
            # the binding documents each CUresult; its first sentence says what went wrong
            doc = " ".join((result.__doc__ or "").split())
            if doc and not doc.startswith("CUresult"):
                msg += f" ({doc.split('. ')[0].rstrip('.')})"
        if detail:
            msg += f"; {detail}"
        fix = _FIXES.get(result)
        if fix:
            msg += f"; fix: {fix}"
        super().__init__(msg)


class CudaOutOfMemory(CudaError, OutOfMemory):
    """``CUDA_ERROR_OUT_OF_MEMORY``: the dispatcher's reclaim-and-wait path handles it."""


class CudaContextLost(CudaError, DeviceLost):
    """A sticky error: the CUDA context is gone and every later call fails the same way.

    The only recovery is a new process. The daemon fails its in-flight jobs with this
    message and exits non-zero, so that its service manager restarts it.
    """

    def __init__(self, call: str, result: Any, detail: str = ""):
        super().__init__(call, result, detail)
        self.args = (self.args[0] + "; the CUDA context is lost: fail the in-flight jobs and "
                     "restart the process",)


def _code(result: Any) -> Any:
    """The CUresult of a binding call's return (a bare result, or a (result, *outputs)
    tuple)."""
    return result[0] if isinstance(result, tuple) else result


def check(result: Any, call: str) -> Any:
    """Unwrap a cuda-python result: ``(CUresult, *outputs)`` or a bare CUresult.

    Returns None, the single output, or a tuple of outputs; raises :class:`CudaError`
    (:class:`CudaContextLost` for a sticky error) naming ``call`` and the CUresult.
    """
    if isinstance(result, tuple):
        err, out = result[0], result[1:]
    else:
        err, out = result, ()
    if err != _SUCCESS:
        if err in STICKY:
            raise CudaContextLost(call, err)
        if err == CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise CudaOutOfMemory(call, err)
        raise CudaError(call, err)
    if not out:
        return None
    return out[0] if len(out) == 1 else out


# --- device properties ---------------------------------------------------------------

#: FP32 lanes per SM by compute capability (CUDA C Programming Guide, "Arithmetic
#: Instructions" throughput table); used only for the roofline's peak FLOP/s.
_FP32_LANES = {60: 64, 61: 128, 62: 128, 70: 64, 72: 64, 75: 64, 80: 64, 86: 128, 87: 128,
               89: 128, 90: 128, 100: 128, 103: 128, 110: 128, 120: 128, 121: 128}

#: Hyper-Q connections a process gets unless CUDA_DEVICE_MAX_CONNECTIONS says otherwise
#: (CUDA C Programming Guide, environment variables: default 8, at most 32).
DEFAULT_CONNECTIONS = 8


def device_spec(drv: Any, dev: Any) -> GpuSpec:
    """A :class:`GpuSpec` read from ``cuDeviceGetAttribute`` for ``dev``."""
    A = drv.CUdevice_attribute

    def attr(name: str) -> int:
        return int(check(drv.cuDeviceGetAttribute(getattr(A, "CU_DEVICE_ATTRIBUTE_" + name), dev),
                         f"cuDeviceGetAttribute({name})"))

    name = check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = name.split(b"\0", 1)[0].decode(errors="replace") if isinstance(name, bytes) else str(name)
    arch = attr("COMPUTE_CAPABILITY_MAJOR") * 10 + attr("COMPUTE_CAPABILITY_MINOR")
    sms = attr("MULTIPROCESSOR_COUNT")
    if attr("CONCURRENT_KERNELS"):
        raw = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "")
        queues = int(raw) if raw.isdigit() else DEFAULT_CONNECTIONS
        queues = max(1, min(32, queues))
    else:
        queues = 1
    clock_khz = attr("CLOCK_RATE")
    lanes = _FP32_LANES.get(arch, 0)
    if not lanes:
        log.info("no FP32 lane count known for sm_%d: the roofline's peak FLOP/s is left at 0", arch)
    mem_khz, bus_bits = attr("MEMORY_CLOCK_RATE"), attr("GLOBAL_MEMORY_BUS_WIDTH")
    return GpuSpec(
        name=name, arch=arch, sm_count=sms,
        max_threads_per_sm=attr("MAX_THREADS_PER_MULTIPROCESSOR"),
        max_blocks_per_sm=attr("MAX_BLOCKS_PER_MULTIPROCESSOR"),
        regs_per_sm=attr("MAX_REGISTERS_PER_MULTIPROCESSOR"),
        regs_per_block=attr("MAX_REGISTERS_PER_BLOCK"),
        smem_per_sm=attr("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
        smem_per_block=attr("MAX_SHARED_MEMORY_PER_BLOCK"),
        smem_per_block_optin=attr("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        reserved_smem_per_block=attr("RESERVED_SHARED_MEMORY_PER_BLOCK"),
        max_threads_per_block=attr("MAX_THREADS_PER_BLOCK"),
        warp_size=attr("WARP_SIZE"),
        hw_queues=queues,
        peak_flops=2.0 * lanes * sms * clock_khz * 1e3,
        mem_bw=2.0 * mem_khz * 1e3 * bus_bits / 8,   # DDR: two transfers per clock
        mem_bytes=int(check(drv.cuDeviceTotalMem(dev), "cuDeviceTotalMem")),
    )


# --- kernel parameters -----------------------------------------------------------------

_INT_FORMATS = {1: ("b", "B"), 2: ("h", "H"), 4: ("i", "I"), 8: ("q", "Q")}
_FLOAT_FORMATS = {4: "f", 8: "d"}


class _ParamPack:
    """The ``kernelParams`` array of one kernel: N pointers into one value buffer.

    Built once when the kernel is loaded; a launch rewrites only the values (speed
    trick: the driver copies the values during ``cuLaunchKernel``, so the buffer may be
    reused by the next launch as soon as the call returns).
    """

    __slots__ = ("kernel", "sizes", "offsets", "values", "pointers", "address")

    def __init__(self, kernel: str, sizes: list[int]):
        self.kernel, self.sizes = kernel, sizes
        offsets, off = [], 0
        for size in sizes:
            align = 16 if size > 8 else 8
            off = -(-off // align) * align
            offsets.append(off)
            off += size
        self.offsets = offsets
        self.values = np.zeros(max(16, -(-off // 16) * 16), dtype=np.uint8)
        base = self.values.ctypes.data
        self.pointers = np.array([base + o for o in offsets] or [0], dtype=np.uint64)
        self.address = self.pointers.ctypes.data if sizes else None

    def set(self, index: int, value: Any) -> None:
        size, off, buf = self.sizes[index], self.offsets[index], self.values
        if isinstance(value, (bool, np.bool_)):
            value = int(value)
        if isinstance(value, np.generic):     # before float: np.float64 is a float subclass
            raw = value.tobytes()
            if len(raw) != size:
                raise TypeError(self._where(index) + f"is {size} bytes but a {value.dtype} "
                                f"({len(raw)} bytes) was given")
            buf[off:off + size] = np.frombuffer(raw, dtype=np.uint8)
        elif isinstance(value, int):
            fmts = _INT_FORMATS.get(size)
            if fmts is None:
                raise TypeError(self._where(index) + f"is {size} bytes; an int cannot fill it")
            signed = value < 0
            lo, hi = (-(1 << (8 * size - 1)), (1 << (8 * size)) - 1)
            if not lo <= value <= hi:
                raise ValueError(self._where(index) + f"is {size} bytes; {value} does not fit")
            struct.pack_into("<" + fmts[0 if signed else 1], buf, off, value)
        elif isinstance(value, float):
            fmt = _FLOAT_FORMATS.get(size)
            if fmt is None:
                raise TypeError(self._where(index) + f"is {size} bytes; a float cannot fill it")
            struct.pack_into("<" + fmt, buf, off, value)
        elif isinstance(value, (bytes, bytearray)):
            if len(value) != size:
                raise TypeError(self._where(index) + f"is {size} bytes but {len(value)} bytes were given")
            buf[off:off + size] = np.frombuffer(bytes(value), dtype=np.uint8)
        else:
            raise TypeError(self._where(index) + f"cannot take a {type(value).__name__}: pass an "
                            "int (device pointers are ints), a float, a numpy scalar or bytes")

    def _where(self, index: int) -> str:
        return f"kernel {self.kernel!r} parameter {index} "


class _Kernel:
    """The backend's handle of a loaded kernel (:attr:`Function.handle`)."""

    __slots__ = ("fn", "name", "params", "instrumentable", "max_dyn_smem", "static_smem")

    def __init__(self, fn: Any, name: str, params: _ParamPack, static_smem: int, max_dyn_smem: int):
        self.fn, self.name, self.params = fn, name, params
        sizes = params.sizes
        # The compiler pass appends (void* notifq_region, uint32_t launch_id).
        self.instrumentable = len(sizes) >= 2 and sizes[-2] == 8 and sizes[-1] == 4
        self.static_smem, self.max_dyn_smem = static_smem, max_dyn_smem


class _Event:
    """An event handle returned by :meth:`CudaDevice.record_event`.

    Once the driver reports it complete it stays complete, and its CUevent goes back to
    the device's pool; later queries answer from ``done`` without a driver call.
    """

    __slots__ = ("handle", "done")

    def __init__(self, handle: Any):
        self.handle, self.done = handle, False


class CudaDevice(Device):
    """A real NVIDIA GPU. See the module docstring for what happens where.

    ``driver`` is the ``cuda.bindings.driver`` module, or a stand-in with the same names
    (the tests' recording driver). ``n_streams`` defaults to the device's connection
    count (:data:`DEFAULT_CONNECTIONS`, or ``CUDA_DEVICE_MAX_CONNECTIONS``).
    """

    backend = "cuda"
    posts_by_compiled_group = True

    def __init__(self, device: int = 0, *, n_streams: int | None = None,
                 notifq_slots: int = protocol.DEFAULT_NOTIFQ_SLOTS,
                 counter_pairs: int = protocol.DEFAULT_COUNTER_PAIRS, driver: Any = None):
        if counter_pairs <= 0 or counter_pairs & (counter_pairs - 1):
            raise ValueError(f"notifQ counter pairs must be a power of two, got {counter_pairs}")
        self.drv = drv = _drv if driver is None else driver
        self.context_lost: CudaContextLost | None = None
        self._next_health = 0.0                  # when poll() next asks the driver
        self._closed = False
        self._ctx = None
        self._streams: list[Any] = []
        self._region_host = 0
        self._modules: list[Any] = []
        self._allocs: dict[int, Any] = {}
        self._registered: dict[int, tuple[int, np.ndarray]] = {}
        self._event_pool: list[Any] = []
        self._all_events: list[Any] = []
        # per stream: deque of (event, keep-alive object, callback) in submission order
        self._pending: list[collections.deque] = []
        self._pageable_warned = False
        self._counter_pairs = counter_pairs

        self._call(drv.cuInit(0), "cuInit")
        count = self._call(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= device < count:
            raise ValueError(f"CUDA device {device} does not exist: the driver sees {count} "
                             f"device(s) (check CUDA_VISIBLE_DEVICES)")
        self.dev = self._call(drv.cuDeviceGet(device), "cuDeviceGet")
        self.ordinal = device
        self._ctx = self._call(drv.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        try:
            self._call(drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            A = drv.CUdevice_attribute
            if not self._call(drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, self.dev),
                              "cuDeviceGetAttribute(CAN_MAP_HOST_MEMORY)"):
                raise DeviceError(f"CUDA device {device} cannot map host memory, which the notifQ "
                                  "needs: use a GPU that supports mapped pinned memory")
            props = device_spec(drv, self.dev)
            if n_streams is None:
                n_streams = props.hw_queues
            super().__init__(props, n_streams, notifq_slots)   # calls _alloc_notifq
            flags = int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
            for _ in range(n_streams):
                self._streams.append(self._call(drv.cuStreamCreate(flags), "cuStreamCreate"))
                self._pending.append(collections.deque())
        except BaseException:
            self.close()
            raise
        log.info("cuda device %d: %s (%s), %d SMs, %d streams, notifQ %d slots / %d counter pairs",
                 device, props.name, props.sm_name, props.sm_count, n_streams, notifq_slots,
                 counter_pairs)

    # -- error plumbing ----------------------------------------------------------------
    def _call(self, result: Any, call: str) -> Any:
        try:
            return check(result, call)
        except CudaContextLost as e:
            self.context_lost = e
            raise

    # -- notifQ ------------------------------------------------------------------------
    def _alloc_notifq(self, slots: int) -> np.ndarray:
        """The notifQ region: pinned, device-mapped, portable; see ``paella.protocol``.

        Memory ordering (host reads of device writes to mapped memory): the device
        header publishes an entry with ONE aligned 64-bit store after
        ``__threadfence_system()``, so the host sees either the old word or the whole
        new one; the dispatcher decodes each slot from a single load of that word and
        never combines two words, so no ordering between slots is needed. numpy reads
        the memory anew on every access (nothing is cached in Python). The host's own
        writes (header, zeroed counters, INVALID stored back) precede the driver call
        that releases the next launch, which orders them before that kernel runs.
        """
        drv, pairs = self.drv, self._counter_pairs
        nbytes = protocol.notifq_region_bytes(slots, pairs)
        flags = drv.CU_MEMHOSTALLOC_DEVICEMAP | drv.CU_MEMHOSTALLOC_PORTABLE
        host = int(self._call(drv.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc(notifQ)"))
        self._region_host = host
        region = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(host), dtype=np.uint8)
        region[:] = 0       # cuMemHostAlloc does not zero
        header = region[:protocol.NOTIFQ_HEADER_BYTES].view(np.uint32)
        header[protocol.NOTIFQ_TAIL_OFFSET // 4] = 0
        header[protocol.NOTIFQ_SLOT_MASK_OFFSET // 4] = slots - 1
        header[protocol.NOTIFQ_COUNTER_MASK_OFFSET // 4] = pairs - 1
        self.region = region
        self.region_dptr = self._call(drv.cuMemHostGetDevicePointer(host, 0),
                                      "cuMemHostGetDevicePointer(notifQ)")
        self._region_dptr_int = int(self.region_dptr)
        cstart = protocol.notifq_counters_offset(slots)
        #: counters[i] = (blocks started, blocks ended) of the launch with id & mask == i
        self.counters = region[cstart:cstart + 8 * pairs].view(np.uint32).reshape(pairs, 2)
        self._counter_mask = pairs - 1
        self._counter_owner: list[tuple[int, int] | None] = [None] * pairs
        return region[protocol.NOTIFQ_HEADER_BYTES:cstart].view(np.uint64)

    @property
    def counter_pairs(self) -> int:
        """Launch counter pairs in the notifQ region: a launch uses pair
        ``launch_id & (counter_pairs - 1)``, so a dispatcher may number its launches in
        flight over at most this many pairs (it checks)."""
        return self._counter_pairs

    @property
    def notifq_tail(self) -> int:
        """The device's writer index (total entries ever posted, modulo 2**32)."""
        return int(self.region[:4].view(np.uint32)[0])

    # -- kernels -------------------------------------------------------------------------
    def _load_module(self, image: ModuleImage) -> dict[str, Function]:
        drv = self.drv
        mod = None
        if image.cubin is not None:
            res = drv.cuModuleLoadData(image.cubin)
            err = _code(res)
            if err in _CUBIN_NOT_FOR_THIS_GPU and image.ptx is not None:
                log.info("module %s: the cubin is not for %s (%s); JIT-compiling its PTX",
                         image.name, self.props.sm_name, err.name)
            else:
                mod = self._call(res, f"cuModuleLoadData({image.name} cubin)")
        if mod is None:
            if image.ptx is None:
                raise DeviceError(f"module {image.name} has neither a usable cubin nor PTX for "
                                  f"{self.props.sm_name}: rebuild the bundle")
            ptx = image.ptx if image.ptx.endswith(b"\0") else image.ptx + b"\0"
            mod = self._call(drv.cuModuleLoadData(ptx), f"cuModuleLoadData({image.name} PTX)")
        try:
            funcs = {k.name: self._load_function(mod, k) for k in image.kernels}
        except BaseException:
            try:                             # a half-loaded module goes too
                self._call(drv.cuModuleUnload(mod), "cuModuleUnload")
            except CudaError as e:
                log.warning("module %s: unloading it after the failed load: %s", image.name, e)
            raise
        self._modules.append(mod)
        return funcs

    def _unload_module(self, funcs: dict[str, Function]) -> None:
        mods = {id(f.module): f.module for f in funcs.values() if f.module is not None}
        for mod in mods.values():
            kept = [m for m in self._modules if m is not mod]
            if len(kept) == len(self._modules):
                continue                     # not loaded here, or unloaded already
            self._modules = kept
            self._call(self.drv.cuModuleUnload(mod), "cuModuleUnload")

    def _load_function(self, mod: Any, info: KernelInfo) -> Function:
        drv, F = self.drv, self.drv.CUfunction_attribute
        fn = self._call(drv.cuModuleGetFunction(mod, info.name.encode()),
                        f"cuModuleGetFunction({info.name})")

        def fattr(name: str) -> int:
            return int(self._call(drv.cuFuncGetAttribute(getattr(F, "CU_FUNC_ATTRIBUTE_" + name), fn),
                                  f"cuFuncGetAttribute({info.name}, {name})"))

        regs, smem = fattr("NUM_REGS"), fattr("SHARED_SIZE_BYTES")
        max_dyn = fattr("MAX_DYNAMIC_SHARED_SIZE_BYTES")
        if regs != info.regs_per_thread or smem != info.static_smem:
            log.info("kernel %s: the driver reports %d registers/thread and %d B static shared "
                     "memory, the manifest %d and %d B; using the driver's", info.name, regs, smem,
                     info.regs_per_thread, info.static_smem)
            info = replace(info, regs_per_thread=regs, static_smem=smem)
        sizes = self._param_sizes(fn, info.name)
        n = len(sizes)
        pack = _ParamPack(info.name, sizes)
        kern = _Kernel(fn, info.name, pack, smem, max_dyn)
        if kern.instrumentable:
            pack.set(n - 2, self._region_dptr_int)     # (set again at every instrumented launch)
        return Function(info, kern, mod)

    def _param_sizes(self, fn: Any, name: str) -> list[int]:
        """The byte size of each of a kernel's parameters. ``cuFuncGetParamInfo`` is CUDA
        12.4's; ``cuFuncGetParamCount`` only CUDA 13.2's driver has (an older binding lacks
        the name; a newer binding on an older driver raises its own "function not found"
        RuntimeError): without it, parameters are asked for one by one until the driver
        says there is no such index."""
        drv = self.drv
        count = getattr(drv, "cuFuncGetParamCount", None)
        n = None
        if count is not None:
            try:
                res = count(fn)
            except RuntimeError as e:            # the driver predates the call (not a CUresult)
                log.debug("cuFuncGetParamCount is not available (%s); counting parameters "
                          "with cuFuncGetParamInfo", e)
            else:
                n = int(self._call(res, f"cuFuncGetParamCount({name})"))
        sizes: list[int] = []
        i = 0
        while n is None or i < n:
            res = drv.cuFuncGetParamInfo(fn, i)
            if n is None and _code(res) == CUresult.CUDA_ERROR_INVALID_VALUE:
                break                            # past the last parameter
            sizes.append(int(self._call(res, f"cuFuncGetParamInfo({name}, {i})")[1]))
            i += 1
            if i > MAX_KERNEL_PARAMS:
                raise DeviceError(f"kernel {name!r}: the driver reports more than "
                                  f"{MAX_KERNEL_PARAMS} parameters")
        return sizes

    # -- the kernel core's own launches (dispatcher/_kcore.c: use_driver) -------------------
    #: The driver library the kernel core loads to call cuLaunchKernel itself (the tests
    #: point it at a recording stub of their own build).
    driver_library = "libcuda.so.1"

    def core_driver(self) -> tuple:
        """What the C kernel core needs to launch on this GPU itself: the driver library,
        each real stream's CUstream handle, the notifQ region's device pointer, the
        address of the launches' counter pairs and their mask."""
        return (self.driver_library, [int(s) for s in self._streams], self._region_dptr_int,
                self.counters.ctypes.data, self._counter_mask)

    def core_kernel(self, k: Any) -> tuple | None:
        """A checked launch record as the C kernel core launches it: ``(CUfunction, grid,
        block, dynamic shared memory, parameter sizes, instrumented, name)``; None where
        this backend's own launch must decide (a kernel without the Paella parameters,
        or more dynamic shared memory than it can be given): it refuses it, as before."""
        kh: _Kernel = k.func.handle
        if not kh.instrumentable:
            return None
        if k.dyn_smem > kh.max_dyn_smem:
            try:
                self._raise_dyn_smem(k.func, k.dyn_smem)
            except DeviceError:
                return None
        return (int(kh.fn), tuple(k.grid), tuple(k.block), k.dyn_smem, list(kh.params.sizes),
                True, kh.name)

    def launch_failed(self, code: int, name: str) -> None:
        """The kernel core's cuLaunchKernel returned ``code``: raise what this backend's
        own launch would (CudaError; CudaContextLost for a sticky error)."""
        self._call((CUresult(code),), f"cuLaunchKernel({name})")

    def _launch(self, func: Function, grid: Dim3, block: Dim3, fp: Footprint, dyn_smem: int,
                args: tuple, stream: int, launch_id: int, instrumented: bool, group: int,
                on_complete: Callback) -> None:
        k: _Kernel = func.handle
        pack = k.params
        own = len(pack.sizes) - 2 if instrumented else len(pack.sizes)
        if instrumented and not k.instrumentable:
            raise DeviceError(f"kernel {k.name!r} is launched as instrumented but its parameters "
                              f"{pack.sizes} do not end with (notifQ pointer, uint32 launch id): "
                              "was it compiled without the Paella pass?")
        # ``group`` is informational here: a real kernel aggregates by the PAELLA_GROUP it
        # was compiled with (the manifest's), which the caller passes on.
        if len(args) != own:
            raise DeviceError(f"kernel {k.name!r} takes {own} argument(s) of its own "
                              f"(sizes {pack.sizes[:own]}), {len(args)} given")
        if dyn_smem > k.max_dyn_smem:
            self._raise_dyn_smem(func, dyn_smem)
        for i, a in enumerate(args):
            pack.set(i, a)
        if instrumented:
            idx = launch_id & self._counter_mask
            owner = self._counter_owner[idx]
            counters = self.counters[idx]
            if owner is not None and int(counters[1]) < owner[1]:
                raise DeviceError(
                    f"notifQ counter pair {idx} is still used by launch {owner[0]} ({int(counters[1])}"
                    f"/{owner[1]} blocks ended): more than {self._counter_mask + 1} instrumented "
                    "launches in flight; the dispatcher must bound them")
            counters[0] = 0
            counters[1] = 0
            # The region too, not only at load: an uninstrumented launch of the same kernel
            # (its caller's own value in that slot) may have overwritten it since.
            pack.set(own, self._region_dptr_int)
            pack.set(own + 1, launch_id)
        self._call(self.drv.cuLaunchKernel(k.fn, grid[0], grid[1], grid[2], block[0], block[1],
                                           block[2], dyn_smem, self._streams[stream], pack.address, 0),
                   f"cuLaunchKernel({k.name})")
        if instrumented:
            self._counter_owner[launch_id & self._counter_mask] = (launch_id, grid[0] * grid[1] * grid[2])
        if on_complete is not None:
            self._track(stream, None, on_complete)

    def _raise_dyn_smem(self, func: Function, dyn_smem: int) -> None:
        """Raise the kernel's dynamic shared memory cap (above the 48 KiB default)."""
        k: _Kernel = func.handle
        limit = self.props.smem_per_block_optin - k.static_smem
        if dyn_smem > limit:
            raise DeviceError(f"kernel {k.name!r} asks for {dyn_smem} B of dynamic shared memory; "
                              f"{self.props.name} allows at most {limit} B beside its "
                              f"{k.static_smem} B static: lower the tile size")
        self._call(self.drv.cuFuncSetAttribute(
            k.fn, self.drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dyn_smem),
            f"cuFuncSetAttribute({k.name}, MAX_DYNAMIC_SHARED_SIZE_BYTES={dyn_smem})")
        log.info("kernel %s: dynamic shared memory cap raised to %d B", k.name, dyn_smem)
        k.max_dyn_smem = dyn_smem

    # -- memory --------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> int:
        dptr = self._call(self.drv.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes} B)")
        ptr = int(dptr)
        self._allocs[ptr] = dptr
        return ptr

    def _free(self, ptr: int) -> None:
        dptr = self._allocs.pop(ptr, None)
        if dptr is None:
            raise DeviceError(f"free of {ptr:#x}, which this device did not allocate (or freed already)")
        self._call(self.drv.cuMemFree(dptr), "cuMemFree")

    def register_host(self, array: np.ndarray) -> None:
        """Page-lock a client arena (``cuMemHostRegister``) so copies to and from it are
        asynchronous DMA. Unregister with :meth:`unregister_host` before unmapping it."""
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or array.nbytes == 0:
            raise TypeError("register_host needs a non-empty C-contiguous numpy array")
        addr = array.ctypes.data
        if addr in self._registered:
            raise DeviceError(f"host range at {addr:#x} is already registered with this device")
        self._call(self.drv.cuMemHostRegister(addr, array.nbytes, self.drv.CU_MEMHOSTREGISTER_PORTABLE),
                   f"cuMemHostRegister({array.nbytes} B)")
        self._registered[addr] = (array.nbytes, array)

    def unregister_host(self, array: np.ndarray) -> None:
        addr = array.ctypes.data
        if addr not in self._registered:
            raise DeviceError(f"host range at {addr:#x} was not registered with this device")
        self._call(self.drv.cuMemHostUnregister(addr), "cuMemHostUnregister")
        del self._registered[addr]

    def _is_pinned(self, arr: np.ndarray) -> bool:
        lo, hi = arr.ctypes.data, arr.ctypes.data + arr.nbytes
        return any(a <= lo and hi <= a + n for a, (n, _) in self._registered.items())

    def _note_pageable(self, arr: np.ndarray, what: str) -> None:
        if not self._pageable_warned and not self._is_pinned(arr):
            self._pageable_warned = True
            log.warning("%s copy uses pageable host memory at %#x: the driver stages it "
                        "synchronously; register the arena with register_host() for DMA "
                        "(logged once)", what, arr.ctypes.data)

    def _memcpy_htod(self, dst: int, src: np.ndarray, stream: int, on_complete: Callback) -> None:
        self._note_pageable(src, "H2D")
        self._call(self.drv.cuMemcpyHtoDAsync(dst, src.ctypes.data, src.nbytes, self._streams[stream]),
                   f"cuMemcpyHtoDAsync({src.nbytes} B)")
        self._track(stream, src, on_complete)

    def _memcpy_dtoh(self, dst: np.ndarray, src: int, stream: int, on_complete: Callback) -> None:
        self._note_pageable(dst, "D2H")
        self._call(self.drv.cuMemcpyDtoHAsync(dst.ctypes.data, src, dst.nbytes, self._streams[stream]),
                   f"cuMemcpyDtoHAsync({dst.nbytes} B)")
        self._track(stream, dst, on_complete)

    # -- events and completion --------------------------------------------------------------
    def _new_event(self) -> Any:
        if self._event_pool:
            return self._event_pool.pop()
        flags = int(self.drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        ev = self._call(self.drv.cuEventCreate(flags), "cuEventCreate")
        self._all_events.append(ev)
        return ev

    def _record_event(self, stream: int) -> _Event:
        ev = self._new_event()
        self._call(self.drv.cuEventRecord(ev, self._streams[stream]), "cuEventRecord")
        return _Event(ev)

    def _event_query(self, event: Any) -> bool:
        if not isinstance(event, _Event):
            raise TypeError(f"not an event of this device: {event!r}")
        if event.done:
            return True
        res = self.drv.cuEventQuery(event.handle)
        err = _code(res)
        if err == _NOT_READY:
            return False
        self._call(res, "cuEventQuery")
        event.done = True
        self._event_pool.append(event.handle)
        event.handle = None
        return True

    def _stream_query(self, stream: int) -> bool:
        res = self.drv.cuStreamQuery(self._streams[stream])
        err = _code(res)
        if err == _NOT_READY:
            return False
        self._call(res, "cuStreamQuery")
        return True

    def _track(self, stream: int, keep: Any, on_complete: Callback) -> None:
        """Remember an operation until it completes: keeps its host array alive (an
        asynchronous copy reads or writes it later) and fires ``on_complete`` from
        :meth:`poll`."""
        self._pending[stream].append((self._record_event(stream), keep, on_complete))

    def poll(self) -> None:
        """Retire completed copies and callbacks. Work in a stream completes in order,
        so only the oldest pending operation of each stream is queried. Every
        ``HEALTH_SECONDS`` it also asks the driver about the context (below)."""
        for q in self._pending:
            while q and self._event_query(q[0][0]):
                _, _, cb = q.popleft()
                if cb is not None:
                    cb()
        now = time.monotonic()
        if now >= self._next_health:
            self._next_health = now + self.HEALTH_SECONDS
            self._health_check()

    #: How often :meth:`poll` makes a driver call while nothing else would: see
    #: :meth:`_health_check`.
    HEALTH_SECONDS = 0.01

    def _health_check(self) -> None:
        """An instrumented kernel reports through the notifQ, not through an event, so a
        kernel that faults (an illegal address, a device-side assert) posts nothing
        more, and with only such kernels in flight no driver call would ever return the
        sticky error: the loop would wait for their COMPLETIONs forever. A query of a
        stream returns that error, and :meth:`_call` turns it into
        :class:`CudaContextLost` (the daemon fails the requests in flight and exits for
        a restart). One cheap call every 10 ms."""
        res = self.drv.cuStreamQuery(self._streams[0])
        err = _code(res)
        if err != _SUCCESS and err != _NOT_READY:
            self._call(res, "cuStreamQuery (health check)")

    def _synchronize(self) -> None:
        self._call(self.drv.cuCtxSynchronize(), "cuCtxSynchronize")
        self.poll()

    def now(self) -> float:
        return time.perf_counter()

    # -- shutdown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Release everything, in reverse order of creation. After a sticky error the
        driver calls fail; they are attempted anyway and their errors logged, since the
        process is about to exit."""
        if self._closed:
            return
        self._closed = True
        drv = self.drv
        steps: list[tuple[str, Callable[[], Any]]] = []
        if self._ctx is not None and self.context_lost is None:
            # First let every kernel and DMA still running finish: freeing the notifQ or
            # unregistering an arena under them would let them write freed memory.
            steps.append(("cuCtxSynchronize", lambda: drv.cuCtxSynchronize()))
        steps += [("cuStreamDestroy", lambda s=s: drv.cuStreamDestroy(s)) for s in self._streams]
        steps += [("cuEventDestroy", lambda e=e: drv.cuEventDestroy(e)) for e in self._all_events]
        steps += [("cuMemHostUnregister", lambda a=a: drv.cuMemHostUnregister(a)) for a in self._registered]
        steps += [("cuMemFree", lambda d=d: drv.cuMemFree(d)) for d in self._allocs.values()]
        steps += [("cuModuleUnload", lambda m=m: drv.cuModuleUnload(m)) for m in self._modules]
        if self._region_host:
            steps.append(("cuMemFreeHost", lambda: drv.cuMemFreeHost(self._region_host)))
        if self._ctx is not None:
            steps.append(("cuDevicePrimaryCtxRelease", lambda: drv.cuDevicePrimaryCtxRelease(self.dev)))
        for call, step in steps:
            try:
                check(step(), call)
            except CudaError as e:
                log.warning("while closing the cuda device: %s", e)
        self._streams, self._all_events, self._event_pool = [], [], []
        self._registered, self._allocs, self._modules = {}, {}, []
        self._pending = []
        self._region_host = 0
        self._ctx = None
        # The views pointed into freed pinned memory: drop them so a late access fails
        # with an IndexError instead of reading freed memory.
        empty = np.zeros(0, dtype=np.uint8)
        self.region, self.notifq, self.counters = empty, empty.view(np.uint64), empty.view(np.uint32).reshape(0, 2)
