"""Job adaptors (Figure 8): ``init(device)`` once per model, ``run(io)`` per request.

``run`` executes inside the request's greenlet and talks to the GPU only through
:mod:`paella.dispatcher.cuda`. :class:`PlanAdaptor` is the built-in adaptor: it runs a
launch plan (copy the inputs from the io buffer, launch the kernels, copy the outputs
back) and is what a compiled bundle needs. Users subclass :class:`JobAdaptor` for
anything else.

The plan format here (:class:`Plan`) is the dispatcher's own; ``from_bundle`` adapts
a bundle variant to it when :mod:`paella.bundle` is available.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from paella.dispatcher.devices.base import Device, Function, KernelInfo, ModuleImage, dim3

from . import cuda


class JobAdaptor:
    """Base class of job adaptors. ``io_bytes`` sizes the profiling runs' io buffer."""

    name = "adaptor"
    io_bytes = 0

    def init(self, device: Device) -> None:
        """Load modules and parameters; called once when the model is registered."""

    def run(self, io: np.ndarray) -> None:
        raise NotImplementedError("a job adaptor must define run(io)")

    def close(self, device: Device) -> None:
        """Free what init() took."""


@dataclass(frozen=True)
class PlanOp:
    """One step of a launch plan: ``h2d`` / ``d2h`` between the io buffer and a device
    buffer, or ``launch`` of a kernel. ``stream`` is a plan-level stream number (0 is
    the default stream)."""
    kind: str
    stream: int = 0
    kernel: str = ""
    grid: tuple[int, ...] = (1,)
    block: tuple[int, ...] = (1,)
    dyn_smem: int = 0
    buffer: str = ""
    io_offset: int = 0
    nbytes: int = 0


@dataclass
class Plan:
    name: str
    kernels: Sequence[KernelInfo]
    ops: Sequence[PlanOp]
    buffers: dict[str, int] = field(default_factory=dict)   # name -> bytes
    io_bytes: int = 0

    def __post_init__(self) -> None:
        names = {k.name for k in self.kernels}
        for i, op in enumerate(self.ops):
            where = f"plan {self.name!r} op {i}"
            if op.kind == "launch":
                if op.kernel not in names:
                    raise ValueError(f"{where} launches unknown kernel {op.kernel!r}; "
                                     f"add it to the plan's kernels")
            elif op.kind in ("h2d", "d2h"):
                if op.buffer not in self.buffers:
                    raise ValueError(f"{where} copies to/from unknown buffer {op.buffer!r}; "
                                     f"declare it in the plan's buffers")
                if op.nbytes <= 0 or op.io_offset < 0 or op.io_offset + op.nbytes > self.io_bytes:
                    raise ValueError(f"{where}: io range [{op.io_offset}, {op.io_offset + op.nbytes}) "
                                     f"is outside the plan's io buffer of {self.io_bytes} bytes")
                if op.nbytes > self.buffers[op.buffer]:
                    raise ValueError(f"{where}: {op.nbytes} bytes exceed buffer {op.buffer!r}")
            else:
                raise ValueError(f"{where} has unknown kind {op.kind!r}; use h2d, launch or d2h")


class PlanAdaptor(JobAdaptor):
    """Runs a :class:`Plan`. The "almost finished" wake-up goes out before the last
    D2H copy (or before the last kernel when the plan copies nothing back)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.name = plan.name
        self.io_bytes = plan.io_bytes
        self.funcs: dict[str, Function] = {}
        self.buffers: dict[str, int] = {}
        self._steps: list[tuple] = []
        ops = plan.ops
        last = max((i for i, op in enumerate(ops) if op.kind == "d2h"), default=-1)
        if last < 0:
            last = max((i for i, op in enumerate(ops) if op.kind == "launch"), default=-1)
        self._almost_at = last
        self._streams = sorted({op.stream for op in ops if op.stream})

    def init(self, device: Device) -> None:
        self.funcs = device.load_module(ModuleImage(self.plan.name, list(self.plan.kernels)))
        # Buffers are per model: the simulator moves no real tensors between kernels,
        # and a real backend would hand each job its own activations (future work).
        self.buffers = {name: device.alloc(n) for name, n in self.plan.buffers.items()}
        steps = []
        for op in self.plan.ops:
            if op.kind == "launch":
                func = self.funcs[op.kernel]
                # Refuse a kernel that can never run now, at registration, by name.
                device.block_footprint(func, dim3(op.block, "block"), op.dyn_smem)
                steps.append((0, func, op.grid, op.block, op.dyn_smem, op.stream))
            else:
                steps.append((1 if op.kind == "h2d" else 2, self.buffers[op.buffer],
                              op.io_offset, op.io_offset + op.nbytes, 0, op.stream))
        self._steps = steps

    def close(self, device: Device) -> None:
        for ptr in self.buffers.values():
            device.free(ptr)
        self.buffers = {}

    def run(self, io: np.ndarray) -> None:
        if io.size < self.io_bytes:
            raise ValueError(f"io buffer of {io.size} bytes is smaller than model "
                             f"{self.name!r} needs ({self.io_bytes})")
        streams: dict[int, Any] = {0: None}
        for s in self._streams:
            streams[s] = cuda.stream_create()
        almost = self._almost_at
        for i, (kind, a, b, c, d, s) in enumerate(self._steps):
            if i == almost:
                cuda.almost_finished()
            if kind == 0:
                cuda.launch(a, b, c, streams[s], dyn_smem=d)
            elif kind == 1:
                cuda.memcpy_htod(a, io[b:c], streams[s])
            else:
                cuda.memcpy_dtoh(io[b:c], a, streams[s])
        cuda.device_synchronize()


def synthetic_plan(name: str, kernels: Sequence[tuple[str, int, int, int, float]],
                   in_bytes: int = 0, out_bytes: int = 0, smem: int = 0) -> Plan:
    """A plan from ``(name, grid, block, regs, seconds)`` kernel rows, run in order on
    stream 0, with an optional input and output copy. For experiments and tests."""
    infos = {}
    ops: list[PlanOp] = []
    buffers = {}
    if in_bytes:
        buffers["in"] = in_bytes
        ops.append(PlanOp("h2d", buffer="in", io_offset=0, nbytes=in_bytes))
    for kname, grid, block, regs, seconds in kernels:
        if kname not in infos:
            infos[kname] = KernelInfo(kname, regs, static_smem=smem, duration=seconds)
        ops.append(PlanOp("launch", kernel=kname, grid=(grid,), block=(block,)))
    if out_bytes:
        buffers["out"] = out_bytes
        ops.append(PlanOp("d2h", buffer="out", io_offset=in_bytes, nbytes=out_bytes))
    return Plan(name, list(infos.values()), ops, buffers, in_bytes + out_bytes)
