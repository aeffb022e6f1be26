"""The simulated GPU's hardware: SMs, hardware queues, the block scheduler, copy engines,
and the device side of the notifQ. The engine that applies these rules is in C
(``_engine.c``); this module states the rules, builds the engine from a GPU preset and
a :class:`~.cost.CostModel`, and gives its SM state the interface of
:class:`paella.occupancy.SMResources`.

The rules that produce head-of-line blocking, stated once:

* stream ``s`` feeds hardware queue ``s mod N``; every queue is strictly FIFO;
* an operation may start only when every earlier operation of its stream has completed;
* only the head of a queue is considered; a kernel stays the head until all its blocks
  have been placed, and only then can the operation behind it start;
* a kernel may place blocks ``launch_latency`` after it became the head of its queue
  with its stream ready (the front end's cost, ``cost.py``);
* the block scheduler visits the placeable heads in launch order and places blocks of
  each while some SM has room for a whole block (the Occupancy Calculator's
  granularity, :class:`paella.occupancy.SMResources`), spreading them breadth-first
  over the SMs, round-robin from where it last stopped; a kernel that found every SM
  full looks again only at SMs that gained room since, in the order they did;
* a block's duration is set by the timing model (``cost.py``) from the state at the end
  of the virtual instant it was placed in (every block placed at one instant sees the
  others), and does not change afterwards; blocks of one kernel placed together on one SM form
  one *group*; a kernel's groups placed in one pass that end at the same instant end in
  one event (with ``jitter`` each group gets its own lognormal factor and event).

Copies go to one H2D and one D2H engine, each FIFO. Instrumented kernels post into the
notifQ exactly what the device header posts (``paella.protocol.group_posts``'s rule).
"""
from __future__ import annotations

import numpy as np

from paella import protocol
from paella.dispatcher.devices.base import D2H, H2D, NotifQOverrun   # noqa: F401 (re-exported: the copy engines' kinds)
from paella.dispatcher.native import load
from paella.gpus import GpuSpec
from paella.occupancy import Footprint, SMResources, sub_partitions

from .cost import CostModel


def build_engine(spec: GpuSpec, cost: CostModel, n_streams: int, notifq: np.ndarray,
                 seed: int = 0, jitter: float = 0.0):
    """The C engine (``_engine.Gpu``) for ``spec``; ``notifq`` is the uint64 ring it writes."""
    for what, value in (("peak_flops", spec.peak_flops), ("mem_bw", spec.mem_bw),
                        ("pcie_bw", spec.pcie_bw)):
        if not value > 0:
            raise ValueError(f"GPU spec {spec.name!r} has no {what}; the simulator's timing "
                             f"model needs it (see paella/gpus.py for the presets' figures)")
    if jitter < 0:
        raise ValueError(f"jitter must be >= 0, got {jitter}")
    parts = sub_partitions(spec)
    return load("devices.sim._engine").Gpu(
        n_sm=spec.sm_count, parts=parts, max_blocks=spec.max_blocks_per_sm,
        max_warps=spec.max_warps_per_sm, smem_per_sm=spec.smem_per_sm,
        part_regs=spec.regs_per_sm // parts, n_queues=spec.hw_queues, n_streams=n_streams,
        notifq=notifq, place_bits=protocol.PLACEMENT << protocol.KIND_SHIFT,
        done_bits=protocol.COMPLETION << protocol.KIND_SHIFT, count_shift=protocol.COUNT_SHIFT,
        sm_shift=protocol.SM_SHIFT, overrun=NotifQOverrun,
        sm_flops=spec.peak_flops / spec.sm_count, warps_to_hide=cost.warps_to_hide_arithmetic(spec),
        mem_bw=spec.mem_bw, mem_latency=cost.mem_latency, warp_bytes_in_flight=cost.bytes_in_flight_per_warp(),
        launch_latency=cost.launch_latency, pcie_latency=spec.pcie_latency,
        pcie_bw=spec.pcie_bw, seed=seed, jitter=jitter)


class Shapes(dict):
    """Footprint -> the engine's shape id, registered on first use."""

    def __init__(self, engine) -> None:
        super().__init__()
        self.engine = engine

    def __missing__(self, fp: Footprint) -> int:
        sid = self[fp] = self.engine.shape(fp.warps, fp.regs_per_warp, fp.smem)
        return sid


class SMView:
    """The engine's SM state with the interface of :class:`paella.occupancy.SMResources`
    (``fit``/``take``/``give`` per SM, the free-resource lists, ``used()``), for tests,
    tools and the experiments' ideal drivers. The engine applies the same rules; the
    tests check it step by step against ``SMResources``."""

    def __init__(self, spec: GpuSpec, engine, shapes: Shapes):
        self.spec = spec
        self.engine = engine
        self.shapes = shapes
        self.parts = sub_partitions(spec)
        self.part_regs = spec.regs_per_sm // self.parts

    def fit(self, sm: int, fp: Footprint) -> int:
        """How many more blocks of ``fp`` fit on ``sm`` right now."""
        return self.engine.fit(sm, self.shapes[fp])

    def take(self, sm: int, fp: Footprint, n: int) -> tuple[int, ...]:
        """Allocate ``n`` blocks on ``sm``; returns the warps taken per sub-partition."""
        return self.engine.take(sm, self.shapes[fp], n)

    def give(self, sm: int, fp: Footprint, n: int, split: tuple[int, ...]) -> None:
        self.engine.give(sm, self.shapes[fp], n, tuple(split))

    @property
    def blocks(self) -> list[int]:
        return self.engine.state()[0]

    @property
    def warps(self) -> list[int]:
        return self.engine.state()[1]

    @property
    def smem(self) -> list[int]:
        return self.engine.state()[2]

    @property
    def regs(self) -> list[int]:
        """Free registers per sub-partition, flat: ``sm * parts + p``."""
        return self.engine.state()[3]

    #: Totals in use over all SMs: SMResources' own, read through the properties above.
    used = SMResources.used
