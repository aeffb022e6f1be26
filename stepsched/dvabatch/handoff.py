"""The device-memory stage hand-off: a stage job reads its boundary-in tensors from, and
writes its boundary-out tensors to, the buffer pair's *device* memory at the run's row
offset, with no copy through the host between stages (the paper's design).

How a job is bound (``paella.dispatcher.adaptor``): a plan job runs on a
:class:`~paella.dispatcher.adaptor.BufferSet` -- a device pointer per plan buffer and
the plan's steps bound to them -- which the dispatcher normally takes from the model's
pool. Here the batcher binds the set itself, per job, and hands it to
``ctx.submit(bindings=)`` (``Dispatcher.submit_group``):

* the plan's **boundary buffers** (the buffers its boundary tensors are copied into and
  out of) point into the pair's device memory: tensor ``t`` of boundary ``b`` at row
  ``k`` is ``base(pair, b, t) + k x row_bytes(t)``;
* every **other buffer** (intermediates, workspace) comes from a pool of sets of the
  stage variant's own (:class:`HandoffPool`), one per job in flight;
* the **params** are the variant's registered model's (shared, never uploaded again).

The hand-off plan (:func:`handoff_plan`) is the stage variant's plan without the copies
of its boundary tensors: stage 0 keeps the H2D of the model's inputs (they come from the
host: the requests), and a run whose rows leave after it (the last stage, or an early
exit) keeps the D2H of its outputs (*fetch*): the answers go to the host, once.
Everything between stays on the device.

When it applies: every boundary tensor must be *alone in its buffer* (the tensor's bytes
are the whole buffer), otherwise binding that buffer to pair rows would also move the
intermediates TVM's static memory plan placed beside it (:func:`plan_boundaries` says
which tensor is not; ``paella compile --stages`` gives each boundary tensor a buffer of
its own, see ``compiler_pass/stage_variants.py``). A stage variant whose out shares its
in's buffer (a tensor passing through the stage, or storage reused in place) has those
two bound to one pair memory: each row of a boundary is read by one stage run only, so
a run writing its own rows of it in place harms no one.

On the simulated GPU the stage's functional effect (``Bundle.run_stage_cpu``) reads the
inputs from, and writes the outputs to, the pair's memory through the same bound
pointers, so the bytes really travel device to device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from paella.dispatcher.adaptor import BufferArg, BufferSet, Plan, PlanAdaptor, PlanOp

from .stage_io import StageModel, StageVariant


class HandoffUnavailable(ValueError):
    """The stage variants cannot be bound to the pairs' device memory; says why."""


@dataclass(frozen=True)
class PlanBoundaries:
    """A stage variant's boundary tensors in its plan: ``(tensor name, plan buffer)``
    for its ins and its outs, in io order."""
    ins: tuple[tuple[str, str], ...]
    outs: tuple[tuple[str, str], ...]

    @property
    def buffers(self) -> frozenset[str]:
        return frozenset(b for _, b in (*self.ins, *self.outs))


def plan_boundaries(plan: Plan, v: StageVariant) -> PlanBoundaries:
    """Which plan buffer each boundary tensor is copied into (ins) and out of (outs);
    raises :class:`HandoffUnavailable` if a boundary tensor is not alone in its buffer."""
    by_io = {(op.kind, op.io_offset): op for op in plan.ops if op.kind in ("h2d", "d2h")}

    def find(kind: str, slots: tuple) -> list[tuple[str, str]]:
        out = []
        for t in slots:
            op = by_io.get((kind, t.offset))
            if op is None or op.nbytes != t.nbytes:
                raise HandoffUnavailable(f"variant {v.index}: no {kind} copy of tensor "
                                         f"{t.name!r} in its plan")
            if op.buffer_offset != 0 or plan.buffers[op.buffer] != t.nbytes:
                raise HandoffUnavailable(
                    f"stage {v.stage} (batch {v.rows}): boundary tensor {t.name!r} ({t.nbytes} "
                    f"B) is at byte {op.buffer_offset} of a {plan.buffers[op.buffer]}-B buffer it "
                    f"shares with other tensors; recompile with `paella compile --stages` "
                    f"(boundary tensors get buffers of their own)")
            out.append((t.name, op.buffer))
        return out

    ins, outs = find("h2d", v.inputs), find("d2h", v.outputs)
    for group in (ins, outs):
        bufs = [b for _, b in group]
        if len(set(bufs)) != len(bufs):
            raise HandoffUnavailable(f"stage {v.stage}: two boundary tensors share one buffer")
    return PlanBoundaries(tuple(ins), tuple(outs))


def handoff_plan(plan: Plan, stage: int, fetch: bool) -> Plan:
    """``plan`` without its boundary copies: stage 0 keeps its H2D copies (the model's
    inputs), ``fetch`` keeps the D2H copies (rows leaving after this stage)."""
    ops = [op for op in plan.ops
           if not (op.kind == "h2d" and stage > 0 or op.kind == "d2h" and not fetch)]
    return Plan(f"{plan.name}/handoff{'+fetch' if fetch else ''}", plan.kernels, ops,
                dict(plan.buffers), plan.io_bytes, dict(plan.params), plan.cubin, plan.ptx,
                dict(plan.effects), plan.notif_group, plan.block_offsets)


class _BoundSet(BufferSet):
    """A buffer set bound to pair rows; ``inner`` is its pool's set of intermediates."""
    __slots__ = ("inner",)


class HandoffPool:
    """The buffer sets of one hand-off model. :meth:`bind` (the batcher, per job) takes
    a set of intermediates and binds it, with the boundary buffers at the pair's rows;
    the dispatcher gives the set back through :meth:`release`. Bound sets are kept per
    (intermediates, pair, row), so the kernel core's per-set operands are made once.
    :meth:`acquire` serves the profiling runs (pair 0, row 0: before any batch)."""

    shared = None

    def __init__(self, name: str, adaptor: "HandoffAdaptor", ptrs: Callable[[int, int], dict]):
        self.name = name
        self.adaptor = adaptor
        self._ptrs = ptrs                  # (pair, row) -> {boundary buffer: pointer}
        self.free: list[BufferSet] = []
        self.created = 0
        self.in_use = 0
        self.peak = 0
        self.waiting: Any = _NoWaiting()
        self.closed = False
        self.set_bytes = adaptor.set_bytes
        self._bound: dict[tuple[int, int, int], _BoundSet] = {}

    def bind(self, pair: int, row: int) -> BufferSet:
        inner = self.free.pop() if self.free else self._new()
        self.in_use += 1
        self.peak = max(self.peak, self.in_use)
        key = (id(inner), pair, row)
        b = self._bound.get(key)
        if b is None:
            ptrs = {**inner.ptrs, **self._ptrs(pair, row)}
            b = self._bound[key] = _BoundSet(ptrs, [], self.adaptor.bind(ptrs))
            b.inner = inner
        return b

    def _new(self) -> BufferSet:
        self.created += 1
        return self.adaptor.new_inner()

    def acquire(self) -> BufferSet:
        return self.bind(0, 0)

    def rebind(self, b: BufferSet) -> BufferSet:
        return b                            # (never: no job of it waits for a set)

    def release(self, b: BufferSet) -> None:
        self.in_use -= 1
        inner = b.inner if isinstance(b, _BoundSet) else b
        if self.closed:
            self._drop(inner)
        else:
            self.free.append(inner)

    def _drop(self, inner: BufferSet) -> None:
        self._bound = {k: v for k, v in self._bound.items() if v.inner is not inner}
        self.adaptor.free_inner(inner)

    @property
    def owner(self) -> "HandoffPool":
        return self

    @property
    def held_bytes(self) -> int:
        return self.created * self.set_bytes

    def trim(self) -> int:
        n = len(self.free)
        while self.free:
            self._drop(self.free.pop())
        self.created -= n
        return n * self.set_bytes

    def close(self) -> None:
        self.closed = True
        while self.free:
            self._drop(self.free.pop())


class _NoWaiting(list):
    """A pool whose jobs never wait for a set (the batcher binds them): always empty."""

    def append(self, job: Any) -> None:     # (acquire never returns None)
        raise RuntimeError("a hand-off job never waits for a buffer set")


class HandoffAdaptor(PlanAdaptor):
    """A stage variant's hand-off plan, sharing the variant's registered model's params
    and loaded kernels (it uploads and loads nothing); its sets hold the intermediates
    only, the boundary buffers being bound per job (:class:`HandoffPool`)."""

    def __init__(self, plan: Plan, base: PlanAdaptor, boundary: frozenset[str],
                 ptrs: Callable[[int, int], dict]):
        super().__init__(plan)
        self.base = base
        self.boundary = boundary
        self._inner = {n: b for n, b in plan.request_buffers.items() if n not in boundary}
        self.set_bytes = sum(self._inner.values())
        self._pair_ptrs = ptrs

    def init(self, device: Any) -> None:
        self.device = device
        self.funcs = self.base.funcs
        self.buffers = dict(self.base.buffers)       # the params: the variant's own
        self.buffer_pool = HandoffPool(self.plan.name, self, self._pair_ptrs)

    def new_inner(self) -> BufferSet:
        ptrs, own = dict(self.buffers), []
        try:
            for name, nbytes in self._inner.items():
                ptrs[name] = p = self.device.alloc(nbytes)
                own.append(p)
        except Exception:
            for p in own:
                self.device.free(p)
            raise
        return BufferSet(ptrs, own, [])

    def free_inner(self, b: BufferSet) -> None:
        for p in b.own:
            self.device.free(p)
        b.own = []

    def close(self, device: Any) -> None:
        pool, self.buffer_pool = self.buffer_pool, None
        if pool is not None:
            pool.close()
        self.buffers, self.funcs = {}, {}            # (the variant's model frees them)


@dataclass
class DevicePairs:
    """The pairs' boundary tensors in device memory: per (pair, boundary, bucket, tensor)
    ``rows`` x its row bytes, allocated through ``alloc`` (the scheduler's context).
    ``alias[(b + 1, bucket, out)] = (b, bucket, in)``: an out of stage ``b`` in its in's
    buffer has that in's memory."""
    model: StageModel
    pairs: int
    rows: int
    alias: dict[tuple[int, int, str], tuple[int, int, str]]
    alloc: Callable[[int], int]
    base: list[dict[tuple[int, int, str], int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        sm = self.model
        self.row_bytes = {(b, ln, name): nb for (b, ln), ts in sm.boundaries.items()
                          for name, nb in ts}
        for _ in range(self.pairs):
            mine: dict[tuple[int, int, str], int] = {}
            for key in sorted(self.row_bytes):
                src = self._root(key)
                if src != key:
                    continue
                mine[key] = self.alloc(self.rows * self.row_bytes[key])
            for key in self.row_bytes:
                mine[key] = mine[self._root(key)]
            self.base.append(mine)

    def _root(self, key: tuple[int, int, str]) -> tuple[int, int, str]:
        while key in self.alias:
            key = self.alias[key]
        return key

    def ptr(self, pair: int, boundary: int, seq_len: int, name: str, row: int) -> int:
        key = (boundary, seq_len, name)
        return self.base[pair][key] + row * self.row_bytes[key]

    @property
    def nbytes(self) -> int:
        return self.pairs * sum(self.rows * self.row_bytes[k] for k in self.row_bytes
                                if self._root(k) == k)


def make_handoff(sm: StageModel, adaptors: dict[int, Any], pairs: int, rows: int,
                 alloc: Callable[[int], int]) -> tuple[DevicePairs, dict]:
    """The pairs' device memory and, per stage variant, its boundaries and hand-off plan
    makers. ``adaptors``: the variants' registered adaptors by index. Raises
    :class:`HandoffUnavailable` when a variant cannot be bound (its plan is not a plan,
    a boundary tensor shares its buffer, aliases differ between batch sizes)."""
    found: dict[int, PlanBoundaries] = {}
    alias: dict[tuple[int, int, str], tuple[int, int, str]] = {}
    for v in sm.by_key.values():
        ad = adaptors[v.index]
        if not isinstance(ad, PlanAdaptor) or ad.plan is None:
            raise HandoffUnavailable(f"variant {v.index} is not served by a launch plan")
        pb = found[v.index] = plan_boundaries(ad.plan, v)
        ins = {b: n for n, b in pb.ins}
        mine = {(v.stage + 1, v.seq_len, n): (v.stage, v.seq_len, ins[b])
                for n, b in pb.outs if b in ins}
        for k, src in mine.items():
            if alias.setdefault(k, src) != src:
                raise HandoffUnavailable(f"stage {v.stage}: tensor {k[2]!r} shares another "
                                         f"in's buffer at another batch size")
        for n, b in pb.outs:
            key = (v.stage + 1, v.seq_len, n)
            if b not in ins and key in alias:
                raise HandoffUnavailable(f"stage {v.stage}: tensor {n!r} shares its in's "
                                         f"buffer at some batch sizes only")
    return DevicePairs(sm, pairs, rows, alias, alloc), found


__all__ = ["DevicePairs", "HandoffAdaptor", "HandoffPool", "HandoffUnavailable",
           "PlanBoundaries", "handoff_plan", "make_handoff", "plan_boundaries"]
