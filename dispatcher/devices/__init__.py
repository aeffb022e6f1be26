"""Device backends, and the one place that opens them: :func:`open_device`.

``auto`` picks ``cuda`` only when the NVIDIA driver library loads, ``cuInit`` succeeds
and at least one device is present; otherwise it picks ``sim`` and logs why. Asking for
``cuda`` explicitly where there is no driver fails at once with :class:`NoDriverError`.
Backends are imported lazily, so opening the simulator never touches cuda-python.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

from .base import Device, DeviceError

log = logging.getLogger("paella.devices")

BACKENDS = ("auto", "sim", "cuda")
#: The driver library the CUDA driver API lives in (Linux; the soname is stable).
DRIVER_LIBRARY = "libcuda.so.1"
#: Options only the simulator understands (see SimDevice).
SIM_ONLY = frozenset({"seed", "cost", "jitter", "realtime", "speed", "lose_after", "process"})
#: Options only the cuda backend understands (``driver`` substitutes the driver module: tests).
CUDA_ONLY = frozenset({"counter_pairs", "driver"})


class NoDriverError(DeviceError):
    """``--backend cuda`` was asked for, but no usable NVIDIA driver or GPU is present."""


@dataclass(frozen=True)
class GpuSummary:
    ordinal: int
    name: str
    arch: int
    sm_count: int


@dataclass(frozen=True)
class DriverProbe:
    """What :func:`probe_driver` found. ``ok`` means the cuda backend can start."""
    ok: bool
    reason: str
    driver_version: int | None = None       # e.g. 13000 for CUDA 13.0
    gpus: tuple[GpuSummary, ...] = ()

    @property
    def driver_version_str(self) -> str:
        v = self.driver_version
        return "unknown" if v is None else f"{v // 1000}.{v % 1000 // 10}"


def _load_library(name: str) -> Any:
    return ctypes.CDLL(name)


def probe_driver(driver: Any = None) -> DriverProbe:
    """Look for a usable NVIDIA driver and GPUs, without opening a device.

    ``driver`` substitutes the ``cuda.bindings.driver`` module (the tests' stand-in);
    with it the library check is skipped.
    """
    if driver is None:
        try:
            _load_library(DRIVER_LIBRARY)
        except OSError as e:
            detail = str(e) if DRIVER_LIBRARY in str(e) else f"{DRIVER_LIBRARY}: {e}"
            return DriverProbe(False, f"no NVIDIA driver found ({detail})")
        try:
            from cuda.bindings import driver
        except ImportError as e:
            return DriverProbe(False, f"cuda-python is not installed ({e}): pip install cuda-python")
    from .cuda import CudaError, check, device_spec
    try:
        from cuda.pathfinder import DynamicLibNotFoundError
    except ImportError:                       # older cuda-python: no pathfinder
        DynamicLibNotFoundError = OSError     # noqa: N806
    try:
        version = check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
        check(driver.cuInit(0), "cuInit")
        count = check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
        if count == 0:
            return DriverProbe(False, "the NVIDIA driver loads but sees no CUDA device "
                               "(check nvidia-smi and CUDA_VISIBLE_DEVICES)", version)
        gpus = []
        for i in range(count):
            dev = check(driver.cuDeviceGet(i), "cuDeviceGet")
            spec = device_spec(driver, dev)
            gpus.append(GpuSummary(i, spec.name, spec.arch, spec.sm_count))
    except DynamicLibNotFoundError as e:
        return DriverProbe(False, f"no NVIDIA driver found ({DRIVER_LIBRARY} loads, but cuda-python "
                           f"cannot use it: {e})")
    except CudaError as e:
        return DriverProbe(False, f"the NVIDIA driver does not initialise: {e}")
    listing = ", ".join(f"{g.ordinal}: {g.name} (sm_{g.arch}, {g.sm_count} SMs)" for g in gpus)
    return DriverProbe(True, f"{count} CUDA device(s): {listing}", version, tuple(gpus))


def pick_backend(driver: Any = None) -> tuple[str, str]:
    """``("cuda" | "sim", reason)``: the backend ``auto`` selects, and why."""
    probe = probe_driver(driver)
    if probe.ok:
        return "cuda", f"NVIDIA driver {probe.driver_version_str}, {probe.reason}"
    return "sim", probe.reason


def open_device(backend: str = "auto", *, gpu: str = "t4", device: int = 0, **options: Any) -> Device:
    """Open the device the daemon (or an experiment) runs on.

    ``backend``: ``auto``, ``sim`` or ``cuda``. ``gpu`` is the simulator's preset (a real
    GPU reports its own properties). ``device`` is the CUDA device ordinal.
    ``options``: ``n_streams`` and ``notifq_slots`` apply to both backends; ``seed``,
    ``cost``, ``jitter``, ``realtime``, ``speed``, ``lose_after`` and ``process`` (the
    real-time simulator in a process of its own) to the simulator only; ``counter_pairs``
    to cuda only. An option for the other backend is an error when the backend was named
    explicitly, and is logged and dropped when ``auto`` chose.

    Raises :class:`NoDriverError` if ``cuda`` is asked for and cannot start, ValueError
    for an unknown backend or option.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown device backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    chosen = backend
    if backend == "auto":
        chosen, reason = pick_backend(options.get("driver"))
        if chosen == "sim":
            log.warning("backend auto: sim, using the simulated GPU (%s): %s", gpu, reason)
        else:
            log.info("backend auto: cuda, using the GPU: %s", reason)
    foreign = (SIM_ONLY if chosen == "cuda" else CUDA_ONLY) & options.keys()
    if foreign:
        if backend != "auto":
            raise ValueError(f"option(s) {', '.join(sorted(foreign))} do not apply to the {chosen} backend")
        log.info("backend auto chose %s: ignoring option(s) %s", chosen, ", ".join(sorted(foreign)))
        options = {k: v for k, v in options.items() if k not in foreign}

    if chosen == "sim":
        if options.pop("process", False):    # real time, in a process of its own
            from .sim import SimProcessDevice
            return SimProcessDevice(gpu, **options)
        from .sim import SimDevice
        return SimDevice(gpu, **options)

    driver = options.get("driver")
    if backend == "cuda":
        probe = probe_driver(driver)
        if not probe.ok:
            raise NoDriverError(f"--backend cuda: {probe.reason}. The cuda backend needs an NVIDIA "
                                "GPU and its driver; install the driver, or use --backend sim "
                                "(or auto) to run on the simulated GPU")
    if gpu != "t4":
        log.info("backend cuda: --gpu %s is a simulator preset and is ignored; the GPU reports "
                 "its own properties", gpu)
    from .cuda import CudaDevice
    return CudaDevice(device, **options)


__all__ = ["BACKENDS", "Device", "DeviceError", "DriverProbe", "GpuSummary", "NoDriverError",
           "open_device", "pick_backend", "probe_driver"]
