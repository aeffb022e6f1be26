"""Kernel slicing: a long kernel of a less urgent job is launched one slice of its grid at
a time, so that more urgent work waits for at most one slice (issue 38).

Blocks cannot be preempted, and the hardware places a queued kernel's blocks before any
kernel launched after it. A best-effort job's 20 ms kernel, released a moment before a
latency-critical request arrives, would make that request wait up to 20 ms. Cut into
slices of at most ``slice_us`` each, released one after another, the same kernel lets
the urgent kernel in at the next slice boundary: it waits at most one slice.

The pieces:

* **The device code** (``paella compile``, compiler_pass/instrument.py): every
  instrumented kernel takes a block offset as its last own argument and computes its
  block indices from ``offset + its launched block number`` over the grid it was
  compiled for. A slice is a 1-D launch of ``n`` blocks at offset ``o``; it posts its own
  notifications under its own launch id, so the dispatcher sees it as a kernel.
* **The plan** (:func:`slice_plan`): each sliced launch becomes consecutive launches on
  the same stream, each of one slice, the offset argument rewritten, ``whole`` recording
  the grid's blocks so that the simulator charges a slice its share of the kernel
  (``paella.dispatcher.devices.sim.cost.slice_cost``). Stream order keeps the slices in
  order, and the kernel's successors wait for its last slice, as they waited for it.
* **The decision** (:class:`SliceRule`): a kernel is sliced only if it lasts more than
  the bound and has more than one wave; a slice is a whole number of waves (the blocks
  the GPU holds at once for the kernel's footprint) lasting at most the bound by the
  kernel's profiled time, and at least one wave.
* **Who gets the sliced plan** (the dispatcher, ``Dispatcher(slice_us=...)``): a job
  whose class is less urgent than the most urgent class the dispatcher has seen. Work of
  the most urgent class, and everything while all traffic is of one class, runs unsliced
  and pays nothing.

A slice costs a launch (a few microseconds of the dispatcher's CPU) and a tail: the
next slice starts only when the last block of the previous one has ended. Both are why
slicing is applied only where a more urgent class exists.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from paella.dispatcher.adaptor import Plan, PlanAdaptor, PlanOp, ScalarArg
from paella.dispatcher.devices.base import Device
from paella.occupancy import wave_blocks  # noqa: F401  (re-exported: the slicer's unit)

#: The block offset's dtype, as the compiler pass declares the parameter.
OFFSET_DTYPE = "uint32"


@dataclass(frozen=True)
class SliceRule:
    """How long a slice may last: ``bound`` seconds (the wait it imposes on more urgent
    work, beyond the blocks already running)."""

    bound: float

    def __post_init__(self) -> None:
        if not (isinstance(self.bound, (int, float)) and math.isfinite(self.bound) and self.bound > 0):
            raise ValueError(f"slice bound must be a positive number of seconds, got {self.bound!r}")

    def slice_blocks(self, seconds: float, blocks: int, wave: int) -> int | None:
        """Blocks per slice of a kernel of ``blocks`` blocks lasting ``seconds`` alone
        (its profiled time), ``wave`` blocks per wave; None: leave it whole (it is short
        enough, or one wave, which no slice can shorten)."""
        waves = -(-blocks // wave)
        if waves <= 1 or seconds <= self.bound:
            return None
        per_wave = seconds / waves
        k = max(1, int(self.bound / per_wave + 1e-9))   # (+1e-9: 1e-4 // 1e-5 is 9.0)
        return None if k >= waves else k * wave


def slices(blocks: int, per_slice: int) -> list[tuple[int, int]]:
    """``(offset, count)`` of each slice of a grid of ``blocks`` blocks: every block in
    exactly one slice, in order."""
    if per_slice < 1:
        raise ValueError(f"a slice has at least one block, got {per_slice}")
    return [(o, min(per_slice, blocks - o)) for o in range(0, blocks, per_slice)]


def sliceable(plan: Plan) -> bool:
    """Whether ``plan``'s launches can be cut: its kernels take the block offset (a bundle
    compiled by this version's ``paella compile``), or it has no device code at all (a
    synthetic plan, which only the simulator runs)."""
    return plan.block_offsets or (plan.cubin is None and plan.ptx is None)


def slice_plan(plan: Plan, per_slice: Mapping[int, int], name: str | None = None) -> Plan:
    """``plan`` with launch op ``i`` cut into slices of ``per_slice[i]`` blocks (ops not
    named stay whole). A kernel carrying a functional effect is never cut (its effect
    computes the whole output once). Raises ValueError for a plan that cannot be sliced
    or an op that is not a launch."""
    if not sliceable(plan):
        raise ValueError(f"plan {plan.name!r} was compiled without block offsets; recompile it "
                         f"with this version's `paella compile` to slice its kernels")
    ops: list[PlanOp] = []
    for i, op in enumerate(plan.ops):
        n = per_slice.get(i)
        if n is None:
            ops.append(op)
            continue
        if op.kind != "launch" or op.kernel in plan.effects or op.whole:
            raise ValueError(f"plan {plan.name!r} op {i} is not a whole kernel launch without "
                             f"an effect; only those are sliced")
        total = math.prod(op.grid)
        for offset, count in slices(total, n):
            args = op.args
            if plan.block_offsets:
                args = tuple(args[:-1]) + (ScalarArg(offset, OFFSET_DTYPE),)
            ops.append(PlanOp("launch", stream=op.stream, kernel=op.kernel, grid=(count,),
                              block=op.block, dyn_smem=op.dyn_smem, args=args, whole=total))
    return Plan(name or plan.name, plan.kernels, ops, dict(plan.buffers), plan.io_bytes,
                dict(plan.params), plan.cubin, plan.ptx, dict(plan.effects), plan.notif_group,
                plan.block_offsets)


class SlicedAdaptor(PlanAdaptor):
    """The sliced plan of a model whose :class:`PlanAdaptor` (``parent``) is initialized:
    it shares the parent's kernels and parameters (nothing is loaded or uploaded twice)
    and has per-request buffer sets of its own (a slice's arguments differ from the whole
    kernel's, so a set's bound arguments are per plan). Closing it closes only those; the
    dispatcher closes it before its parent."""

    def __init__(self, parent: PlanAdaptor, plan: Plan):
        super().__init__(plan, max_buffer_sets=parent.max_buffer_sets, memory=parent.memory)
        self.parent = parent

    def init(self, device: Device) -> None:
        self.device = device
        self.funcs = self.parent.funcs
        self.buffers = dict(self.parent.buffers)
        self._open_pool()

    def close(self, device: Device) -> None:
        self._close_pool()
        self.buffers = {}
        self.funcs = {}
