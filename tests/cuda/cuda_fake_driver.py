"""A recording stand-in for ``cuda.bindings.driver``: the same function names, a fake GPU.

What it checks, on every call:

* **Argument types, by the real binding.** While no NVIDIA driver is installed, each call
  is first replayed on the real ``cuda.bindings.driver`` function: it converts its
  arguments and only then fails to load libcuda. A ``TypeError`` there means the real
  binding would reject our call; that is a :class:`Violation`. (Skipped where a driver
  *is* present, so the fake handles never reach a real GPU.)
* **Call order and state,** as the driver documents it: nothing before ``cuInit``
  (``CUDA_ERROR_NOT_INITIALIZED``); context calls need a current context
  (``CUDA_ERROR_INVALID_CONTEXT``); ``cuMemHostGetDevicePointer`` only on memory
  allocated or registered with DEVICEMAP, with Flags 0 (``CUDA_ERROR_INVALID_VALUE``).
* **Launches:** ``kernelParams`` is an address of exactly as many pointers as the
  compiled kernel has parameters (the parameter sizes come from the fake image), the
  values are decoded and recorded; an instrumented kernel's notifQ pointer must be the
  *device* pointer of a DEVICEMAP region, and its launch's counter pair must be zero at
  launch time. Launching on the legacy default stream is a violation.

Protocol breaches raise :class:`Violation` (an AssertionError) out of the call, so the
backend under test cannot swallow them. Driver errors are returned as CUresults, like
the real thing. Work is queued per stream and runs when the test calls :meth:`run`, or
at ``cuCtxSynchronize``; a finished instrumented kernel has written exactly the words the
device header would (``group`` blocks per entry), computed here independently of
``paella.protocol.group_posts``.
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cuda.bindings import driver as real

from paella import protocol
from paella.gpus import GpuSpec, preset

CUresult = real.CUresult
OK = CUresult.CUDA_SUCCESS

try:                      # is a real driver present? then never replay calls on it
    from cuda.pathfinder import DynamicLibNotFoundError
    real.cuDriverGetVersion()
    REAL_DRIVER_PRESENT = True
except DynamicLibNotFoundError:
    REAL_DRIVER_PRESENT = False


class Violation(AssertionError):
    """The backend broke the driver's or the notifQ's contract."""


# --- fake images -------------------------------------------------------------------------

def kernel_spec(name: str, params: list[int], *, regs: int = 32, smem: int = 0,
                instrumented: bool = True, body: str | None = None) -> dict:
    """A kernel in a fake image. ``params``: parameter sizes in bytes, in order (for an
    instrumented kernel, ending with the notifQ pointer (8) and the launch id (4))."""
    return {"name": name, "params": list(params), "regs": regs, "smem": smem,
            "instrumented": instrumented, "body": body}


def fake_cubin(arch: int, kernels: list[dict]) -> bytes:
    return b"FAKECUBIN %d\n" % arch + json.dumps(kernels).encode()


def fake_ptx(kernels: list[dict], terminate: bool = True) -> bytes:
    return b"FAKEPTX\n" + json.dumps(kernels).encode() + (b"\0" if terminate else b"")


# --- the fake GPU ----------------------------------------------------------------------

def spec_attributes(spec: GpuSpec) -> dict[str, int]:
    return {
        "COMPUTE_CAPABILITY_MAJOR": spec.major, "COMPUTE_CAPABILITY_MINOR": spec.minor,
        "MULTIPROCESSOR_COUNT": spec.sm_count,
        "MAX_THREADS_PER_MULTIPROCESSOR": spec.max_threads_per_sm,
        "MAX_BLOCKS_PER_MULTIPROCESSOR": spec.max_blocks_per_sm,
        "MAX_REGISTERS_PER_MULTIPROCESSOR": spec.regs_per_sm,
        "MAX_REGISTERS_PER_BLOCK": spec.regs_per_block,
        "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": spec.smem_per_sm,
        "MAX_SHARED_MEMORY_PER_BLOCK": spec.smem_per_block,
        "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": spec.smem_per_block_optin,
        "RESERVED_SHARED_MEMORY_PER_BLOCK": spec.reserved_smem_per_block,
        "MAX_THREADS_PER_BLOCK": spec.max_threads_per_block, "WARP_SIZE": spec.warp_size,
        "CONCURRENT_KERNELS": 1, "CAN_MAP_HOST_MEMORY": 1, "UNIFIED_ADDRESSING": 1,
        "CLOCK_RATE": 1_590_000, "MEMORY_CLOCK_RATE": 5_001_000, "GLOBAL_MEMORY_BUS_WIDTH": 256,
    }


@dataclass
class FakeKernel:
    name: str
    params: list[int]
    regs: int
    smem: int
    instrumented: bool
    body: str | None
    max_dyn: int


@dataclass
class Launch:
    """One recorded launch, with its parameters decoded as unsigned ints."""
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dyn_smem: int
    stream: int
    args: list[int]
    raw: list[bytes] = field(repr=False)

    @property
    def launch_id(self) -> int:
        return self.args[-1]


_MAPPED_BASE = 0x7E00_0000_0000    # device addresses of mapped host memory (never == host)
_DEVICE_BASE = 0x7000_0000        # device memory


class FakeDriver:
    """The stand-in module. Handles are real cuda-python handle types (CUdevice,
    CUcontext, CUstream, ...), so the real binding's conversion accepts them."""

    def __init__(self, spec: GpuSpec | None = None, *, devices: int = 1, group: int = protocol.DEFAULT_GROUP):
        self.spec = spec or preset("t4")
        self.attributes = spec_attributes(self.spec)
        self.n_devices = devices
        self.group = group
        self.calls: list[tuple[str, tuple]] = []
        self.launches: list[Launch] = []
        self._fail: dict[str, list] = collections.defaultdict(list)
        self.sticky: Any = None
        self.initialized = False
        self.current_ctx: int | None = None
        self.primary_refs: dict[int, int] = collections.Counter()
        self.host: dict[int, tuple[int, int, Any]] = {}      # addr -> (nbytes, flags, keepalive)
        self.registered: dict[int, tuple[int, int]] = {}      # addr -> (nbytes, flags)
        self.mapped: dict[int, int] = {}                      # device addr -> host addr
        self.device_mem: dict[int, bytearray] = {}
        self.modules: dict[int, dict[str, FakeKernel]] = {}
        self.functions: dict[int, FakeKernel] = {}
        self.streams: dict[int, int] = {}                     # handle -> flags
        self.queues: dict[int, collections.deque] = {}
        self.events: dict[int, tuple[int, int] | None] = {}   # handle -> (stream, seq) recorded
        self.done_seq: dict[int, int] = collections.Counter()  # stream -> last completed seq
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._next_mapped = _MAPPED_BASE
        self._next_dev = _DEVICE_BASE

    # -- test controls ------------------------------------------------------------------
    def fail(self, call: str, result: Any, times: int = 1) -> None:
        """Make the next ``times`` calls of ``call`` return ``result``. A sticky result
        then sticks: every later call returns it, as on a real GPU."""
        self._fail[call].extend([result] * times)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def pending(self, stream: int | None = None) -> int:
        qs = self.queues.values() if stream is None else [self.queues[stream]]
        return sum(len(q) for q in qs)

    def run(self, stream: int | None = None) -> None:
        """Complete the queued work (of one stream, or of all, stream by stream)."""
        for s, q in self.queues.items():
            if stream is not None and s != stream:
                continue
            while q:
                seq, op = q.popleft()
                op()
                self.done_seq[s] = seq

    def region_of(self, dptr: int) -> np.ndarray:
        """The host bytes of a mapped device pointer."""
        host = self.mapped[dptr]
        n = self.host[host][0] if host in self.host else self.registered[host][0]
        return np.frombuffer((ctypes.c_uint8 * n).from_address(host), dtype=np.uint8)

    # -- plumbing ---------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("cu"):
            raise AttributeError(f"the fake driver does not implement {name}: add it, with the "
                                 "checks the driver documents")
        return getattr(real, name)      # enums, flags, handle types

    def _enter(self, name: str, args: tuple, outputs: int, needs_init: bool = True,
               needs_ctx: bool = True) -> tuple | None:
        """Record the call, check it; returns an error tuple to return, or None."""
        self.calls.append((name, args))
        if not REAL_DRIVER_PRESENT:
            try:
                getattr(real, name)(*args)
            except DynamicLibNotFoundError:
                pass                     # conversion passed; the driver load failed: expected
            except (TypeError, ValueError, OverflowError) as e:
                raise Violation(f"{name}{args!r}: the real binding rejects these arguments: {e}") from None
        err = None
        if self._fail.get(name):
            err = self._fail[name].pop(0)
        elif self.sticky is not None:
            err = self.sticky
        elif needs_init and not self.initialized:
            err = CUresult.CUDA_ERROR_NOT_INITIALIZED
        elif needs_ctx and self.current_ctx is None:
            err = CUresult.CUDA_ERROR_INVALID_CONTEXT
        if err is None:
            return None
        if err in _STICKY_NAMES_OF_REAL():
            self.sticky = err
        return (err,) + (None,) * outputs

    def _enqueue(self, stream: int, op) -> None:
        self.queues[stream].append((next(self._seq), op))

    # -- initialisation and devices -----------------------------------------------------------
    def cuInit(self, Flags):
        if (e := self._enter("cuInit", (Flags,), 0, needs_init=False, needs_ctx=False)):
            return e
        if Flags != 0:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.initialized = True
        return (OK,)

    def cuDriverGetVersion(self):
        if (e := self._enter("cuDriverGetVersion", (), 1, needs_init=False, needs_ctx=False)):
            return e
        return (OK, 13000)

    def cuDeviceGetCount(self):
        if (e := self._enter("cuDeviceGetCount", (), 1, needs_ctx=False)):
            return e
        return (OK, self.n_devices)

    def cuDeviceGet(self, ordinal):
        if (e := self._enter("cuDeviceGet", (ordinal,), 1, needs_ctx=False)):
            return e
        if not 0 <= ordinal < self.n_devices:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
        return (OK, real.CUdevice(ordinal))

    def cuDeviceGetName(self, length, dev):
        if (e := self._enter("cuDeviceGetName", (length, dev), 1, needs_ctx=False)):
            return e
        return (OK, (b"Fake " + self.spec.name.encode() + b"\0" * length)[:length])

    def cuDeviceTotalMem(self, dev):
        if (e := self._enter("cuDeviceTotalMem", (dev,), 1, needs_ctx=False)):
            return e
        return (OK, self.spec.mem_bytes)

    def cuDeviceGetAttribute(self, attrib, dev):
        if (e := self._enter("cuDeviceGetAttribute", (attrib, dev), 1, needs_ctx=False)):
            return e
        if not isinstance(attrib, real.CUdevice_attribute):
            raise Violation(f"cuDeviceGetAttribute: attribute must be a CUdevice_attribute, got {attrib!r}")
        key = attrib.name.removeprefix("CU_DEVICE_ATTRIBUTE_")
        if key not in self.attributes:
            raise Violation(f"the fake GPU has no value for {attrib.name}: add it to spec_attributes")
        return (OK, self.attributes[key])

    def cuDevicePrimaryCtxRetain(self, dev):
        if (e := self._enter("cuDevicePrimaryCtxRetain", (dev,), 1, needs_ctx=False)):
            return e
        self.primary_refs[int(dev)] += 1
        return (OK, real.CUcontext(0xC0 + int(dev)))

    def cuDevicePrimaryCtxRelease(self, dev):
        if (e := self._enter("cuDevicePrimaryCtxRelease", (dev,), 0, needs_ctx=False)):
            return e
        if self.primary_refs[int(dev)] <= 0:
            raise Violation("cuDevicePrimaryCtxRelease without a matching retain")
        self.primary_refs[int(dev)] -= 1
        if self.primary_refs[int(dev)] == 0 and self.current_ctx == 0xC0 + int(dev):
            self.current_ctx = None
        return (OK,)

    def cuCtxSetCurrent(self, ctx):
        if (e := self._enter("cuCtxSetCurrent", (ctx,), 0, needs_ctx=False)):
            return e
        self.current_ctx = int(ctx)
        return (OK,)

    def cuCtxSynchronize(self):
        if (e := self._enter("cuCtxSynchronize", (), 0)):
            return e
        self.run()
        return (OK,)

    # -- pinned host memory ---------------------------------------------------------------------
    def cuMemHostAlloc(self, bytesize, Flags):
        if (e := self._enter("cuMemHostAlloc", (bytesize, Flags), 1)):
            return e
        buf = (ctypes.c_uint8 * bytesize)()
        ctypes.memset(buf, 0xA5, bytesize)      # the driver does not zero: neither do we
        addr = ctypes.addressof(buf)
        self.host[addr] = (bytesize, int(Flags), buf)
        return (OK, addr)

    def cuMemFreeHost(self, p):
        if (e := self._enter("cuMemFreeHost", (p,), 0)):
            return e
        if int(p) not in self.host:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.host[int(p)]
        self.mapped = {d: h for d, h in self.mapped.items() if h != int(p)}
        return (OK,)

    def cuMemHostGetDevicePointer(self, p, Flags):
        if (e := self._enter("cuMemHostGetDevicePointer", (p, Flags), 1)):
            return e
        p = int(p)
        if Flags != 0:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
        if p in self.host:
            mapped = self.host[p][1] & real.CU_MEMHOSTALLOC_DEVICEMAP
        elif p in self.registered:
            mapped = self.registered[p][1] & real.CU_MEMHOSTREGISTER_DEVICEMAP
        else:
            mapped = 0
        if not mapped:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
        for d, h in self.mapped.items():
            if h == p:
                return (OK, real.CUdeviceptr(d))
        d = self._next_mapped
        self._next_mapped += 1 << 32
        self.mapped[d] = p
        return (OK, real.CUdeviceptr(d))

    def cuMemHostRegister(self, p, bytesize, Flags):
        if (e := self._enter("cuMemHostRegister", (p, bytesize, Flags), 0)):
            return e
        p = int(p)
        for a, (n, _) in self.registered.items():
            if a < p + bytesize and p < a + n:
                return (CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,)
        self.registered[p] = (bytesize, int(Flags))
        return (OK,)

    def cuMemHostUnregister(self, p):
        if (e := self._enter("cuMemHostUnregister", (p,), 0)):
            return e
        if self.registered.pop(int(p), None) is None:
            return (CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,)
        return (OK,)

    # -- device memory and copies -----------------------------------------------------------------
    def cuMemAlloc(self, bytesize):
        if (e := self._enter("cuMemAlloc", (bytesize,), 1)):
            return e
        if bytesize == 0:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
        if self.spec.mem_bytes and sum(map(len, self.device_mem.values())) + bytesize > self.spec.mem_bytes:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
        d = self._next_dev
        self._next_dev += -(-bytesize // 256) * 256 + 256
        self.device_mem[d] = bytearray(bytesize)
        return (OK, real.CUdeviceptr(d))

    def cuMemFree(self, dptr):
        if (e := self._enter("cuMemFree", (dptr,), 0)):
            return e
        if self.device_mem.pop(int(dptr), None) is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return (OK,)

    def _device_view(self, dptr: int, n: int) -> memoryview:
        for base, mem in self.device_mem.items():
            if base <= dptr and dptr + n <= base + len(mem):
                return memoryview(mem)[dptr - base:dptr - base + n]
        raise Violation(f"device range {dptr:#x}+{n} is not inside any cuMemAlloc allocation")

    def _stream_key(self, name: str, hStream) -> int:
        s = int(hStream)
        if s not in self.streams:
            raise Violation(f"{name} on stream {s:#x}, which is not a stream of the pool "
                            "(0 would be the legacy default stream)")
        return s

    def cuMemcpyHtoDAsync(self, dstDevice, srcHost, ByteCount, hStream):
        if (e := self._enter("cuMemcpyHtoDAsync", (dstDevice, srcHost, ByteCount, hStream), 0)):
            return e
        s = self._stream_key("cuMemcpyHtoDAsync", hStream)
        dst = self._device_view(int(dstDevice), ByteCount)
        src = int(srcHost)

        def op():
            dst[:] = ctypes.string_at(src, ByteCount)
        self._enqueue(s, op)
        return (OK,)

    def cuMemcpyDtoHAsync(self, dstHost, srcDevice, ByteCount, hStream):
        if (e := self._enter("cuMemcpyDtoHAsync", (dstHost, srcDevice, ByteCount, hStream), 0)):
            return e
        s = self._stream_key("cuMemcpyDtoHAsync", hStream)
        src = self._device_view(int(srcDevice), ByteCount)
        dst = int(dstHost)

        def op():
            ctypes.memmove(dst, bytes(src), ByteCount)
        self._enqueue(s, op)
        return (OK,)

    # -- streams and events ------------------------------------------------------------------------
    def cuStreamCreate(self, Flags):
        if (e := self._enter("cuStreamCreate", (Flags,), 1)):
            return e
        h = 0x5000 + next(self._ids)
        self.streams[h] = int(Flags)
        self.queues[h] = collections.deque()
        return (OK, real.CUstream(h))

    def cuStreamDestroy(self, hStream):
        if (e := self._enter("cuStreamDestroy", (hStream,), 0)):
            return e
        if self.streams.pop(int(hStream), None) is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        return (OK,)

    def cuStreamQuery(self, hStream):
        if (e := self._enter("cuStreamQuery", (hStream,), 0)):
            return e
        s = self._stream_key("cuStreamQuery", hStream)
        return (CUresult.CUDA_ERROR_NOT_READY,) if self.queues[s] else (OK,)

    def cuEventCreate(self, Flags):
        if (e := self._enter("cuEventCreate", (Flags,), 1)):
            return e
        h = 0xE000 + next(self._ids)
        self.events[h] = None
        return (OK, real.CUevent(h))

    def cuEventDestroy(self, hEvent):
        if (e := self._enter("cuEventDestroy", (hEvent,), 0)):
            return e
        if int(hEvent) not in self.events:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        del self.events[int(hEvent)]
        return (OK,)

    def cuEventRecord(self, hEvent, hStream):
        if (e := self._enter("cuEventRecord", (hEvent, hStream), 0)):
            return e
        if int(hEvent) not in self.events:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        s = self._stream_key("cuEventRecord", hStream)
        q = self.queues[s]
        self.events[int(hEvent)] = (s, q[-1][0] if q else 0)
        return (OK,)

    def cuEventQuery(self, hEvent):
        if (e := self._enter("cuEventQuery", (hEvent,), 0)):
            return e
        if int(hEvent) not in self.events:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        rec = self.events[int(hEvent)]
        if rec is None:
            return (OK,)           # never recorded: complete, as documented
        s, seq = rec
        if seq and self.done_seq[s] < seq:
            return (CUresult.CUDA_ERROR_NOT_READY,)
        return (OK,)

    # -- modules and kernels ------------------------------------------------------------------------
    def cuModuleLoadData(self, image):
        if (e := self._enter("cuModuleLoadData", (image,), 1)):
            return e
        data = bytes(image)
        if data.startswith(b"FAKECUBIN "):
            head, body = data.split(b"\n", 1)
            arch = int(head.split()[1])
            # a cubin runs on its own major version, at the same or a later minor one
            if arch // 10 != self.spec.major or arch % 10 > self.spec.minor:
                return (CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU, None)
        elif data.startswith(b"FAKEPTX\n"):
            if not data.endswith(b"\0"):
                raise Violation("cuModuleLoadData: PTX must be NUL-terminated (the driver reads a C string)")
            body = data[len(b"FAKEPTX\n"):-1]
        else:
            return (CUresult.CUDA_ERROR_INVALID_IMAGE, None)
        h = 0x3000 + next(self._ids)
        self.modules[h] = {k["name"]: FakeKernel(k["name"], k["params"], k["regs"], k["smem"],
                                                 k["instrumented"], k.get("body"),
                                                 self.spec.smem_per_block - k["smem"])
                           for k in json.loads(body)}
        return (OK, real.CUmodule(h))

    def cuModuleUnload(self, hmod):
        if (e := self._enter("cuModuleUnload", (hmod,), 0)):
            return e
        if self.modules.pop(int(hmod), None) is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        return (OK,)

    def cuModuleGetFunction(self, hmod, name):
        if (e := self._enter("cuModuleGetFunction", (hmod, name), 1)):
            return e
        kern = self.modules.get(int(hmod), {}).get(name.decode())
        if kern is None:
            return (CUresult.CUDA_ERROR_NOT_FOUND, None)
        h = 0xF000 + next(self._ids)
        self.functions[h] = kern
        return (OK, real.CUfunction(h))

    def _kernel(self, hfunc) -> FakeKernel | None:
        return self.functions.get(int(hfunc))

    def cuFuncGetAttribute(self, attrib, hfunc):
        if (e := self._enter("cuFuncGetAttribute", (attrib, hfunc), 1)):
            return e
        k = self._kernel(hfunc)
        if k is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE, None)
        F = real.CUfunction_attribute
        values = {F.CU_FUNC_ATTRIBUTE_NUM_REGS: k.regs, F.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: k.smem,
                  F.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: k.max_dyn,
                  F.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: self.spec.max_threads_per_block}
        if attrib not in values:
            raise Violation(f"the fake driver has no value for {attrib!r}")
        return (OK, values[attrib])

    def cuFuncSetAttribute(self, hfunc, attrib, value):
        if (e := self._enter("cuFuncSetAttribute", (hfunc, attrib, value), 0)):
            return e
        k = self._kernel(hfunc)
        if k is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        if attrib != real.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
            raise Violation(f"unexpected cuFuncSetAttribute({attrib!r})")
        if value + k.smem > self.spec.smem_per_block_optin:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        k.max_dyn = value
        return (OK,)

    def cuFuncGetParamCount(self, func):
        if (e := self._enter("cuFuncGetParamCount", (func,), 1)):
            return e
        k = self._kernel(func)
        return (OK, len(k.params)) if k else (CUresult.CUDA_ERROR_INVALID_VALUE, None)

    def cuFuncGetParamInfo(self, func, paramIndex):
        if (e := self._enter("cuFuncGetParamInfo", (func, paramIndex), 2)):
            return e
        k = self._kernel(func)
        if k is None or not 0 <= paramIndex < len(k.params):
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None, None)
        off = 0
        for size in k.params[:paramIndex]:
            off = -(-off // min(size, 8)) * min(size, 8) + size
        size = k.params[paramIndex]
        return (OK, -(-off // min(size, 8)) * min(size, 8), size)

    def cuLaunchKernel(self, f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                       sharedMemBytes, hStream, kernelParams, extra):
        args = (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                hStream, kernelParams, extra)
        if (e := self._enter("cuLaunchKernel", args, 0)):
            return e
        k = self._kernel(f)
        if k is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        s = self._stream_key("cuLaunchKernel", hStream)
        if extra not in (0, None):
            raise Violation("cuLaunchKernel: parameters must come through kernelParams only (extra=0)")
        grid, block = (gridDimX, gridDimY, gridDimZ), (blockDimX, blockDimY, blockDimZ)
        if min(grid + block) < 1 or blockDimX * blockDimY * blockDimZ > self.spec.max_threads_per_block:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        if sharedMemBytes > k.max_dyn:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        raw = self._read_params(k, kernelParams)
        vals = [int.from_bytes(r, "little") for r in raw]
        rec = Launch(k.name, grid, block, sharedMemBytes, s, vals, raw)
        self.launches.append(rec)
        if k.instrumented:
            region, lid = self._check_instrumented(k, vals)
            self._enqueue(s, lambda: self._execute(k, rec, region, lid))
        else:
            self._enqueue(s, lambda: self._execute(k, rec, None, None))
        return (OK,)

    def _read_params(self, k: FakeKernel, kernelParams) -> list[bytes]:
        n = len(k.params)
        if n == 0:
            if kernelParams not in (0, None):
                raise Violation(f"kernel {k.name} takes no parameters but kernelParams was given")
            return []
        if not isinstance(kernelParams, int) or kernelParams == 0:
            raise Violation(f"kernel {k.name}: kernelParams must be the address of {n} pointers, "
                            f"got {kernelParams!r}")
        ptrs = (ctypes.c_uint64 * n).from_address(kernelParams)
        return [ctypes.string_at(ptrs[i], size) for i, size in enumerate(k.params)]

    def _check_instrumented(self, k: FakeKernel, vals: list[int]) -> tuple[np.ndarray, int]:
        if len(k.params) < 2 or k.params[-2:] != [8, 4]:
            raise Violation(f"instrumented kernel {k.name} must end with (void*, uint32) parameters")
        dptr, lid = vals[-2], vals[-1]
        if dptr not in self.mapped:
            raise Violation(f"kernel {k.name}: notifQ pointer {dptr:#x} is not a device pointer from "
                            "cuMemHostGetDevicePointer (a host pointer passed by mistake?)")
        region = self.region_of(dptr)
        hdr = region[:16].view(np.uint32)
        slot_mask, counter_mask = int(hdr[1]), int(hdr[2])
        for what, m in (("slot_mask", slot_mask), ("counter_mask", counter_mask)):
            if m & (m + 1):
                raise Violation(f"notifQ header {what} {m:#x} is not a power of two minus one")
        slots = slot_mask + 1
        if len(region) != protocol.NOTIFQ_HEADER_BYTES + 8 * slots + 8 * (counter_mask + 1):
            raise Violation(f"notifQ region of {len(region)} B does not match its header")
        ctr = self._counters(region, slots, counter_mask, lid)
        if ctr[0] or ctr[1]:
            raise Violation(f"kernel {k.name}: counter pair {lid & counter_mask} of launch {lid} is "
                            f"({ctr[0]}, {ctr[1]}), not zeroed before the launch")
        return region, lid

    @staticmethod
    def _counters(region: np.ndarray, slots: int, counter_mask: int, lid: int) -> np.ndarray:
        off = protocol.NOTIFQ_HEADER_BYTES + 8 * slots + 8 * (lid & counter_mask)
        return region[off:off + 8].view(np.uint32)

    def _execute(self, k: FakeKernel, rec: Launch, region: np.ndarray | None, lid: int | None) -> None:
        blocks = rec.grid[0] * rec.grid[1] * rec.grid[2]
        if region is not None:
            hdr = region[:16].view(np.uint32)
            slots, counter_mask = int(hdr[1]) + 1, int(hdr[2])
            ring = region[protocol.NOTIFQ_HEADER_BYTES:protocol.NOTIFQ_HEADER_BYTES + 8 * slots].view(np.uint64)
            ctr = self._counters(region, slots, counter_mask, lid)
            g = self.group
            for phase, kind in ((0, protocol.PLACEMENT), (1, protocol.COMPLETION)):
                for b in range(blocks):
                    ctr[phase] += 1                       # atomicAdd(&counters[phase], 1) + 1
                    v = int(ctr[phase])
                    if v % g == 0 or v == blocks:
                        slot = int(hdr[0]) & (slots - 1)  # atomicAdd(&tail, 1) & slot_mask
                        hdr[0] += 1
                        if ring[slot] != 0:
                            raise Violation(f"notifQ overrun: slot {slot} not consumed before reuse")
                        count = (v - 1) % g + 1
                        sm = b % self.spec.sm_count
                        ring[slot] = (kind << 56) | (sm << 48) | (count << 40) | lid
        if k.body == "add1_f32":                           # (float* x, int n, ...)
            ptr, n = rec.args[0], rec.args[1]
            view = self._device_view(ptr, 4 * n)
            arr = np.frombuffer(view, dtype=np.float32)
            view[:] = (arr + np.float32(1)).tobytes()
        elif k.body == "add1_f32_blocks":                  # (float* x, int n, uint offset, ...)
            # As `paella compile` emits a kernel: block b of the launch is block
            # offset + b of the grid, each block its blockDim.x elements (slicing).
            ptr, n, offset = rec.args[0], rec.args[1], rec.args[2]
            view = self._device_view(ptr, 4 * n)
            arr = np.frombuffer(view, dtype=np.float32).copy()
            t = rec.block[0]
            for b in range(offset, offset + blocks):
                arr[b * t:min((b + 1) * t, n)] += np.float32(1)
            view[:] = arr.tobytes()


_STICKY_CACHE: frozenset | None = None


def _STICKY_NAMES_OF_REAL() -> frozenset:
    """CUresults the binding documents as leaving the process in an inconsistent state
    ("terminated and relaunched"), or its context unusable ("cannot be used anymore":
    CUDA_ERROR_ASSERT)."""
    global _STICKY_CACHE
    if _STICKY_CACHE is None:
        _STICKY_CACHE = frozenset(
            m for m in CUresult
            if any(phrase in " ".join((m.__doc__ or "").split())
                   for phrase in ("terminated and relaunched", "cannot be used anymore")))
    return _STICKY_CACHE
