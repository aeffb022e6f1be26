"""The device interface the dispatcher drives: one base class, one file per backend.

Public methods live here and check their arguments once; a backend fills in the
underscore hooks (tinygrad's pattern). Everything a backend needs to know about a
kernel arrives in a :class:`Function`; backends know nothing of jobs or policies.

Completion is learned in two ways, as on a real GPU:
* instrumented kernels post PLACEMENT/COMPLETION words into :attr:`Device.notifq`,
  a numpy ``uint64`` ring that the caller polls and clears (see ``paella.protocol``);
* everything else (copies, uninstrumented kernels) is observed through events
  (:meth:`record_event` / :meth:`event_query`) or :meth:`stream_query`.

The dispatcher launches through :meth:`launch_checked`, with a launch record it checked
once per shape; it reaches the same ``_launch`` hook unless a backend overrides it for
speed (the simulator does).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from paella import protocol
from paella.gpus import GpuSpec
from paella.occupancy import Footprint, OccupancyError, footprint, occupancy

Dim3 = tuple[int, int, int]
Callback = Callable[[], None] | None

#: Kinds of device operations, defined once for the dispatcher and every backend: a
#: kernel launch, a host-to-device or device-to-host copy, an event marker.
KERNEL, H2D, D2H, MARKER = 0, 1, 2, 3
KIND_NAMES = ("kernel", "h2d", "d2h", "marker")


class DeviceError(RuntimeError):
    """A device operation failed; the message names the operation and the cause."""


class DeviceLost(DeviceError):
    """The device can run nothing any more (on a GPU, a sticky error lost the context).

    Unlike other device errors it does not fail one request: the dispatcher re-raises
    it, and the daemon fails every in-flight request and exits non-zero so that its
    service manager restarts it.
    """


class OutOfMemory(DeviceError):
    """The device has no room for an allocation. Not a fault of the work that asked: the
    dispatcher frees idle buffers and retries, or lets the job wait until running jobs
    give memory back, and fails a request only when nothing it holds ever could."""


class NotifQOverrun(DeviceError):
    """The device wrote into a notifQ slot the dispatcher had not consumed yet.

    The dispatcher's flow control must bound outstanding blocks so this never happens;
    it is raised, not ignored, so that a flow-control bug never passes silently.
    """


@dataclass(frozen=True)
class KernelInfo:
    """A kernel as a bundle's manifest describes it."""
    name: str
    regs_per_thread: int
    static_smem: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    duration: float | None = None   # seconds; synthetic kernels use it as given


#: What a kernel computes, for a backend that runs no device code (the simulator):
#: ``effect(view, args)`` with ``view(ptr, nbytes)`` a writable uint8 view of device
#: memory and ``args`` the launch's arguments, applied when the kernel completes.
KernelEffect = Callable[[Callable[[int, int], np.ndarray], tuple], None]


@dataclass
class ModuleImage:
    """What :meth:`Device.load_module` loads: kernel descriptions plus device code, and
    (``effects``, by kernel name) the functional effects that stand in for device code
    on the simulator. A real GPU runs the code and ignores ``effects``."""
    name: str
    kernels: Sequence[KernelInfo]
    cubin: bytes | None = None
    ptx: bytes | None = None
    effects: dict[str, KernelEffect] = field(default_factory=dict)


@dataclass(eq=False)
class Function:
    """A loaded kernel. ``handle`` is the backend's own (a CUfunction for ``cuda``)."""
    info: KernelInfo
    handle: Any = None
    #: The backend's module it was loaded from (a CUmodule for ``cuda``; None when the
    #: backend keeps no module), what :meth:`Device.unload_module` gives back.
    module: Any = None
    _footprints: dict = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.info.name


def dim3(value: int | Sequence[int], what: str) -> Dim3:
    # Fast paths first: this runs on every launch.
    if type(value) is int and value > 0:
        return (value, 1, 1)
    if type(value) is tuple and len(value) == 3:
        x, y, z = value              # (unrolled: a generator here cost 0.3 us per launch)
        if type(x) is int and type(y) is int and type(z) is int and x > 0 and y > 0 and z > 0:
            return value  # type: ignore[return-value]
    if isinstance(value, int):
        value = (value,)
    dims = tuple(value) + (1,) * (3 - len(tuple(value)))
    if len(dims) != 3 or any((not isinstance(d, int)) or d < 1 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 positive integers, got {value!r}")
    return dims  # type: ignore[return-value]


class Device:
    """Base class of the device backends (``sim``, ``cuda``)."""

    #: Backend name, as the configuration spells it.
    backend = "base"
    #: Whether the kernels themselves post the notifQ entries, by the group compiled into
    #: them (a real GPU), rather than the device by the ``group`` of each launch (the
    #: simulator): then a dispatcher must read by the group the code was compiled with.
    posts_by_compiled_group = False
    #: Whether a kernel's functional effect (``ModuleImage.effects``) may be applied
    #: after its notifications are visible (the simulator in its own process applies it
    #: when the completion reaches the parent): work ordered behind the kernel on the
    #: device sees it, a host reading it at the notifications may not.
    late_effects = False

    def __init__(self, props: GpuSpec, n_streams: int, notifq_slots: int):
        if notifq_slots <= 0 or notifq_slots & (notifq_slots - 1):
            raise ValueError(f"notifQ slots must be a power of two, got {notifq_slots}")
        if n_streams < 1:
            raise ValueError(f"need at least one stream, got {n_streams}")
        self.props = props
        self.streams: list[int] = list(range(n_streams))
        self.notifq: np.ndarray = self._alloc_notifq(notifq_slots)
        self._sizes: dict[int, int] = {}     # live allocations: pointer -> bytes
        self._allocated = 0                  # their sum (read by the metrics thread)
        #: Bytes this process may allocate (0: as much as the GPU has): a daemon sharing
        #: its GPU with other processes keeps to its share (``[limits] device_memory``).
        self.memory_limit = 0
        #: Kernels that failed without losing the device: launch id -> the reason. Only
        #: the simulator fills it (a functional effect that raised: the kernel's outputs
        #: could not be computed); on a GPU a faulting kernel is a sticky error
        #: (:class:`DeviceLost`). The dispatcher pops an entry when it sees that kernel
        #: complete and fails the kernel's job with the reason, so one request's failure
        #: is not the daemon's.
        self.faults: dict[int, str] = {}
        #: Kernels that failed after their completion was reported, without losing the
        #: device: launch id -> the reason. Only the simulator in its own process fills it
        #: (an answer that failed once the child had reported the kernel done; the
        #: dispatcher may have read its notifications already, so ``faults`` comes too
        #: late). What reads the kernel's output is not applied before the dispatcher's
        #: next pass, which pops each entry first and fails that kernel's job.
        self.late_faults: dict[int, str] = {}

    # -- kernels ---------------------------------------------------------------
    def load_module(self, image: ModuleImage) -> dict[str, Function]:
        """Load a module's kernels; returns them by name."""
        return self._load_module(image)

    def unload_module(self, funcs: dict[str, Function]) -> None:
        """Give back what :meth:`load_module` returned (a model's adaptor, when the model
        is removed): the caller launches none of ``funcs`` again. A long-running daemon
        reloads changed models; without this every reload would keep the old code."""
        if funcs:
            self._unload_module(funcs)

    def block_footprint(self, func: Function, block: Dim3, dyn_smem: int) -> Footprint:
        """The rounded per-block demand of ``func`` at this block size (cached)."""
        key = (block, dyn_smem)
        fp = func._footprints.get(key)
        if fp is None:
            threads = block[0] * block[1] * block[2]
            try:
                fp = footprint(self.props, threads, func.info.regs_per_thread,
                               func.info.static_smem + dyn_smem)
            except OccupancyError as e:
                raise OccupancyError(f"kernel {func.name!r} can never run on {self.props.name}: {e}") from None
            if occupancy(self.props, threads, func.info.regs_per_thread,
                         func.info.static_smem + dyn_smem).blocks_per_sm < 1:
                raise OccupancyError(f"kernel {func.name!r}: not even one block of {threads} threads "
                                     f"fits on an SM of {self.props.name}")
            func._footprints[key] = fp
        return fp

    def launch(self, func: Function, grid: int | Sequence[int], block: int | Sequence[int],
               stream: int, launch_id: int, *, dyn_smem: int = 0, args: Sequence[Any] = (),
               instrumented: bool = True, group: int = protocol.DEFAULT_GROUP,
               on_complete: Callback = None) -> None:
        """Launch ``func`` on ``stream``. Instrumented launches post notifQ entries
        tagged ``launch_id``, one per ``group`` blocks; ``on_complete`` (simulator only)
        runs when the last block finishes."""
        g, b = dim3(grid, "grid"), dim3(block, "block")
        if not 0 <= launch_id <= protocol.LAUNCH_MASK:
            raise ValueError(f"launch id {launch_id} does not fit in 32 bits")
        if not 1 <= group <= protocol.MAX_GROUP:
            raise ValueError(f"notification group must be 1..{protocol.MAX_GROUP}, got {group}")
        self._check_stream(stream)
        fp = self.block_footprint(func, b, dyn_smem)
        self._launch(func, g, b, fp, dyn_smem, tuple(args), stream, launch_id, instrumented, group,
                     on_complete)

    def launch_checked(self, k: Any, stream: int, launch_id: int, args: Sequence[Any] = (),
                       group: int = protocol.DEFAULT_GROUP, on_complete: Callback = None) -> None:
        """The dispatcher's launch, once per kernel: ``k`` is a checked launch record
        (``paella.dispatcher.ops.KernelLaunch``: ``func``, dims, ``fp``, ``dyn_smem``,
        ``blocks``) made through :meth:`block_footprint`, and the dispatcher's own
        bookkeeping guarantees the stream, the launch id and the group, so :meth:`launch`'s
        checks are skipped. Instrumented. A backend may override it for speed."""
        self._launch(k.func, k.grid, k.block, k.fp, k.dyn_smem, tuple(args), stream, launch_id,
                     True, group, on_complete)

    # -- memory ----------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        limit = self.memory_limit
        if limit and self._allocated + nbytes > limit:
            raise OutOfMemory(f"out of device memory: {nbytes} B asked, {self._allocated} of "
                              f"the {limit} B this process may use (device_memory) in use")
        ptr = self._alloc(nbytes)
        self._sizes[ptr] = nbytes
        self._allocated += nbytes
        return ptr

    def free(self, ptr: int) -> None:
        self._free(ptr)
        self._allocated -= self._sizes.pop(ptr, 0)

    @property
    def memory_capacity(self) -> int:
        """The bytes this process may allocate: its ``memory_limit``, or the GPU's
        memory (0: not known)."""
        total, limit = self.props.mem_bytes, self.memory_limit
        if limit and total:
            return min(limit, total)
        return limit or total

    @property
    def allocated_bytes(self) -> int:
        """Device memory allocated through :meth:`alloc` and not freed (bytes): what
        ``paella status`` reports, and how a leak shows."""
        return self._allocated

    def memcpy_htod(self, dst: int, src: np.ndarray, stream: int, on_complete: Callback = None) -> None:
        """Asynchronous host-to-device copy of ``src``'s bytes to ``dst``."""
        self._check_stream(stream)
        self._memcpy_htod(dst, _as_bytes(src, "source"), stream, on_complete)

    def memcpy_dtoh(self, dst: np.ndarray, src: int, stream: int, on_complete: Callback = None) -> None:
        """Asynchronous device-to-host copy into ``dst`` (its whole size)."""
        self._check_stream(stream)
        self._memcpy_dtoh(_as_bytes(dst, "destination"), src, stream, on_complete)

    def register_host(self, arr: np.ndarray) -> None:
        """Pin host memory the device will copy to and from (client arenas), so copies
        are true asynchronous DMA. Nothing to do on the simulator."""

    def unregister_host(self, arr: np.ndarray) -> None:
        """Undo :meth:`register_host` before the memory goes away."""

    # -- ordering --------------------------------------------------------------
    def record_event(self, stream: int) -> Any:
        self._check_stream(stream)
        return self._record_event(stream)

    def event_query(self, event: Any) -> bool:
        return self._event_query(event)

    def stream_query(self, stream: int) -> bool:
        """True when everything submitted to ``stream`` has completed."""
        self._check_stream(stream)
        return self._stream_query(stream)

    def synchronize(self) -> None:
        self._synchronize()

    def poll(self) -> None:
        """Called by the dispatcher every loop iteration. A real GPU needs nothing; the
        real-time simulator advances its clock to the wall clock here."""

    def now(self) -> float:
        """The device's clock, seconds."""
        raise NotImplementedError("need now")

    def close(self) -> None:
        """Release everything the device holds."""

    # -- helpers ---------------------------------------------------------------
    def _check_stream(self, stream: int) -> None:
        if not 0 <= stream < len(self.streams):
            raise ValueError(f"stream {stream} is not in the device's pool of {len(self.streams)}")

    def _alloc_notifq(self, slots: int) -> np.ndarray:
        return np.zeros(slots, dtype=np.uint64)

    # -- hooks a backend fills in ------------------------------------------------
    def _load_module(self, image: ModuleImage) -> dict[str, Function]:
        raise NotImplementedError("need load_module")

    def _unload_module(self, funcs: dict[str, Function]) -> None:
        """Backends that hold something per loaded kernel give it back here."""

    def _launch(self, func: Function, grid: Dim3, block: Dim3, fp: Footprint, dyn_smem: int,
                args: tuple, stream: int, launch_id: int, instrumented: bool, group: int,
                on_complete: Callback) -> None:
        raise NotImplementedError("need launch")

    def _alloc(self, nbytes: int) -> int:
        raise NotImplementedError("need alloc")

    def _free(self, ptr: int) -> None:
        raise NotImplementedError("need free")

    def _memcpy_htod(self, dst: int, src: np.ndarray, stream: int, on_complete: Callback) -> None:
        raise NotImplementedError("need memcpy_htod")

    def _memcpy_dtoh(self, dst: np.ndarray, src: int, stream: int, on_complete: Callback) -> None:
        raise NotImplementedError("need memcpy_dtoh")

    def _record_event(self, stream: int) -> Any:
        raise NotImplementedError("need record_event")

    def _event_query(self, event: Any) -> bool:
        raise NotImplementedError("need event_query")

    def _stream_query(self, stream: int) -> bool:
        raise NotImplementedError("need stream_query")

    def _synchronize(self) -> None:
        raise NotImplementedError("need synchronize")


def _as_bytes(arr: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
        raise TypeError(f"copy {what} must be a C-contiguous numpy array")
    return arr.reshape(-1).view(np.uint8)
