"""Job adaptors (Figure 8): ``init(device)`` once per model, then per request either
``run(io)`` or the replay of a launch plan.

``run`` executes inside the request's greenlet and talks to the GPU only through
:mod:`paella.dispatcher.cudart`. :class:`PlanAdaptor` is the built-in adaptor: it holds a
launch plan (copy the inputs from the io buffer, launch the kernels, copy the outputs
back), a record the dispatcher replays for every request with no greenlet
(:mod:`paella.dispatcher.replay`); it is what a compiled bundle needs
(:meth:`PlanAdaptor.from_bundle`). Users subclass :class:`JobAdaptor` for anything else.

The plan format here (:class:`Plan`) is the dispatcher's own; :func:`plan_from_bundle`
adapts a bundle variant to it.

Device memory of a plan (what makes it correct on a real GPU, not only on the
simulator):

* **params** (``Plan.params``: weights, folded constants) are allocated once per model
  in ``init`` and uploaded there, synchronously (``memcpy_htod`` then
  ``device.synchronize()``), before the model serves any request; the variants of one
  model share them (:mod:`.shared_params`: one device copy per contents object);
* **every other buffer** (inputs, intermediates, workspace, outputs) is per request:
  each job holds one :class:`BufferSet` from the model's :class:`BufferPool` for its
  whole life, so concurrent requests never share activations. The pool grows on
  demand up to its limit (:attr:`BufferPool.limit`) and takes a set back when the job
  finishes (after its last released op has completed). When every set is in use, a
  new request of that model **waits** in the dispatcher (FIFO per model, not yet
  announced to the policy) until a set comes back.
* Launch arguments are bound once per buffer set, not per request: a set carries, per
  plan step, the device pointer of a copy (buffer + ``buffer_offset``) or the argument
  tuple of a launch (buffer args become ``pointer + offset`` ints, scalars numpy
  scalars of their dtype), which the job's ops pass to ``device.launch(args=...)``.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from paella.dispatcher.devices.base import (Device, Function, KernelInfo, ModuleImage, OutOfMemory,
                                            dim3)
from paella.dispatcher.shared_params import shared_params, upload

#: Default device memory one model may spend on per-request buffer sets (bytes).
DEFAULT_BUFFER_BUDGET = 1 << 30
#: Bounds on a plan's stream and event numbers: each plan stream becomes a stream of
#: every request's job and each event an event of it, so a plan naming stream 10**9 is
#: a mistake to refuse at registration, not a loop to run per request.
MAX_PLAN_STREAMS = 1024
MAX_PLAN_EVENTS = 1 << 16
#: The step kinds of a plan.
PLAN_KINDS = ("h2d", "launch", "d2h", "record", "wait")


class JobAdaptor:
    """Base class of job adaptors. ``io_bytes`` sizes the profiling runs' io buffer.

    ``buffer_pool``: when an adaptor sets it (in ``init``), the dispatcher acquires one
    :class:`BufferSet` per job before the job starts (``job.bindings``), returns it when
    the job finishes, and holds a job back while the pool is exhausted.

    ``plan`` and ``funcs``: an adaptor with a :class:`Plan` (and its loaded kernels by
    name, after ``init``) is replayed by the dispatcher; ``run`` is then never called.
    """

    name = "adaptor"
    io_bytes = 0
    buffer_pool: "BufferPool | None" = None
    plan: "Plan | None" = None
    funcs: "dict[str, Function]" = {}

    def init(self, device: Device) -> None:
        """Load modules and parameters; called once when the model is registered."""

    def run(self, io: np.ndarray) -> None:
        raise NotImplementedError("a job adaptor must define run(io)")

    def close(self, device: Device) -> None:
        """Free what init() took."""


@dataclass(frozen=True)
class BufferArg:
    """A kernel argument that is a device buffer of the plan, ``offset`` bytes in."""
    buffer: str
    offset: int = 0


@dataclass(frozen=True)
class ScalarArg:
    """A kernel argument passed by value as ``dtype`` (a numpy dtype name)."""
    value: int | float
    dtype: str

    def typed(self) -> np.generic:
        return np.dtype(self.dtype).type(self.value)


@dataclass(frozen=True)
class PlanOp:
    """One step of a launch plan: ``h2d`` / ``d2h`` between the io buffer and a device
    buffer (``buffer_offset`` bytes into it), or ``launch`` of a kernel with ``args``
    (:class:`BufferArg` / :class:`ScalarArg`, the kernel's own parameters in order).
    ``stream`` is a plan-level stream number (0 is the default stream).

    ``record`` marks plan-level event ``event`` on ``stream`` (complete once everything
    issued to that stream before it has completed); ``wait`` makes later work on
    ``stream`` wait for the most recent ``record`` of ``event`` before it in the plan
    (cudaEventRecord / cudaStreamWaitEvent). Every request gets its own events. This is
    how a multi-stream plan (``paella compile --streams nimble``) orders its
    cross-stream dependencies.

    ``whole``: a slice of a kernel (:mod:`paella.dispatcher.slicing`) gives the blocks of
    the kernel's whole grid, of which its ``grid`` is a part (0: not a slice)."""
    kind: str
    stream: int = 0
    kernel: str = ""
    grid: tuple[int, ...] = (1,)
    block: tuple[int, ...] = (1,)
    dyn_smem: int = 0
    buffer: str = ""
    io_offset: int = 0
    nbytes: int = 0
    buffer_offset: int = 0
    args: tuple[BufferArg | ScalarArg, ...] = ()
    event: int = 0
    whole: int = 0


def _with_operands(ops: list[PlanOp], i: int, operands: Sequence[BufferArg]) -> str:
    """Append ``operands`` to launch ``ops[i]``'s arguments (in place); its kernel."""
    op = ops[i]
    ops[i] = PlanOp("launch", stream=op.stream, kernel=op.kernel, grid=op.grid, block=op.block,
                    dyn_smem=op.dyn_smem, args=tuple(op.args) + tuple(operands), whole=op.whole)
    return op.kernel


@dataclass
class Plan:
    """A launch plan. ``buffers``: name -> bytes. ``params``: name -> initial contents
    of the buffers that are allocated once per model and uploaded at ``init``; all
    other buffers are per request. ``cubin``/``ptx``: the device code (a real GPU needs
    one of them; the simulator ignores them)."""
    name: str
    kernels: Sequence[KernelInfo]
    ops: Sequence[PlanOp]
    buffers: dict[str, int] = field(default_factory=dict)   # name -> bytes
    io_bytes: int = 0
    params: dict[str, bytes] = field(default_factory=dict)
    cubin: bytes | None = None
    ptx: bytes | None = None
    #: Functional effects by kernel name, for a device that runs no code (the simulator:
    #: :mod:`paella.dispatcher.devices.sim.functional`); see :meth:`with_effect`.
    effects: dict[str, Any] = field(default_factory=dict)
    #: The blocks per notification the device code was compiled with (the bundle's
    #: ``group``; 0: compiled without the Paella pass; None: not known, e.g. a synthetic
    #: plan). A real GPU's kernels post by it, so the dispatcher must read by it too.
    notif_group: int | None = None
    #: Its kernels take a block offset as their last own argument (compiled by
    #: ``paella compile`` since bundle format 2), so they can be launched in slices.
    block_offsets: bool = False

    def __post_init__(self) -> None:
        names = {k.name for k in self.kernels}
        for name, data in self.params.items():
            if name not in self.buffers:
                raise ValueError(f"plan {self.name!r}: param {name!r} is not a declared buffer")
            if len(data) > self.buffers[name]:
                raise ValueError(f"plan {self.name!r}: param {name!r} has {len(data)} bytes, more "
                                 f"than its buffer's {self.buffers[name]}")
        recorded: set[int] = set()
        for i, op in enumerate(self.ops):
            where = f"plan {self.name!r} op {i}"
            self._check_stream_event(where, op, recorded)
            if op.kind == "launch":
                if op.kernel not in names:
                    raise ValueError(f"{where} launches unknown kernel {op.kernel!r}; "
                                     f"add it to the plan's kernels")
                for j, a in enumerate(op.args):
                    self._check_arg(f"{where} ({op.kernel}) argument {j}", a)
                if op.whole and (type(op.whole) is not int or op.whole < math.prod(op.grid)):
                    raise ValueError(f"{where}: a slice of {math.prod(op.grid)} blocks of a "
                                     f"kernel of {op.whole!r}; whole is the kernel's grid")
            elif op.kind in ("h2d", "d2h"):
                if op.buffer not in self.buffers:
                    raise ValueError(f"{where} copies to/from unknown buffer {op.buffer!r}; "
                                     f"declare it in the plan's buffers")
                if op.nbytes <= 0 or op.io_offset < 0 or op.io_offset + op.nbytes > self.io_bytes:
                    raise ValueError(f"{where}: io range [{op.io_offset}, {op.io_offset + op.nbytes}) "
                                     f"is outside the plan's io buffer of {self.io_bytes} bytes")
                if op.buffer_offset < 0 or op.buffer_offset + op.nbytes > self.buffers[op.buffer]:
                    raise ValueError(f"{where}: {op.nbytes} bytes at offset {op.buffer_offset} "
                                     f"exceed buffer {op.buffer!r} ({self.buffers[op.buffer]} bytes)")
                if op.kind == "h2d" and op.buffer in self.params:
                    raise ValueError(f"{where} writes param buffer {op.buffer!r}, which is shared "
                                     f"by every request; copy into a per-request buffer")
            elif op.kind not in ("record", "wait"):
                raise ValueError(f"{where} has unknown kind {op.kind!r}; use one of "
                                 f"{', '.join(PLAN_KINDS)}")

    @staticmethod
    def _check_stream_event(where: str, op: PlanOp, recorded: set[int]) -> None:
        """Stream and event numbers in range; a wait only after a record of its event."""
        if not isinstance(op.stream, int) or not 0 <= op.stream < MAX_PLAN_STREAMS:
            raise ValueError(f"{where}: stream {op.stream!r} is not a plan stream number; use "
                             f"0..{MAX_PLAN_STREAMS - 1} (0 is the default stream)")
        if not isinstance(op.event, int) or not 0 <= op.event < MAX_PLAN_EVENTS:
            raise ValueError(f"{where}: event {op.event!r} is not a plan event number; use "
                             f"0..{MAX_PLAN_EVENTS - 1}")
        if op.kind == "record":
            recorded.add(op.event)
        elif op.kind == "wait":
            if op.event not in recorded:
                raise ValueError(f"{where} waits for event {op.event}, which no earlier op "
                                 f"records; put a record of event {op.event} before the wait")
        elif op.event:
            raise ValueError(f"{where}: a {op.kind} op carries event {op.event}; only record "
                             f"and wait ops name an event")

    def _check_arg(self, where: str, a: Any) -> None:
        if isinstance(a, BufferArg):
            size = self.buffers.get(a.buffer)
            if size is None:
                raise ValueError(f"{where} names unknown buffer {a.buffer!r}; declare it in the "
                                 f"plan's buffers")
            if not 0 <= a.offset < size:
                raise ValueError(f"{where}: offset {a.offset} is outside buffer {a.buffer!r} "
                                 f"({size} bytes)")
        elif isinstance(a, ScalarArg):
            try:
                v = a.typed()
            except (TypeError, ValueError, OverflowError) as e:
                raise ValueError(f"{where}: scalar {a.value!r} is not a valid {a.dtype!r} ({e})") from None
            if v.dtype.kind in "iub" and int(v) != a.value:
                raise ValueError(f"{where}: scalar {a.value!r} does not fit dtype {a.dtype!r}")
        else:
            raise ValueError(f"{where} is a {type(a).__name__}; use BufferArg or ScalarArg")

    def with_effect(self, effect: Any, operands: Sequence[BufferArg],
                    start: Callable[[int], Any] | None = None,
                    start_operands: Sequence[BufferArg] = ()) -> "Plan":
        """This plan with ``effect`` on its last kernel launch, whose arguments get
        ``operands`` appended (the buffers the effect reads and writes, bound per
        request like every argument). That launch must come after every input copy and
        before every output copy in the plan's order of execution (:meth:`ancestors`:
        stream order and events), which a single-stream plan always satisfies.

        ``start`` (optional) makes an effect for the first launch that runs after every
        input copy and before the last launch, given that launch's own argument count;
        the effect goes on it, with ``start_operands`` appended, provided its kernel is
        not the last launch's and carries no effect yet (otherwise the plan has no
        ``start``; see :func:`paella.dispatcher.devices.sim.functional.model_effects`)."""
        launches = [i for i, op in enumerate(self.ops) if op.kind == "launch"]
        if not launches:
            raise ValueError(f"plan {self.name!r} launches no kernel to carry an effect")
        last = launches[-1]
        anc = self.ancestors()
        if any(op.kind == "h2d" and not anc[last] >> i & 1 or op.kind == "d2h" and not anc[i] >> last & 1
               for i, op in enumerate(self.ops)):
            raise ValueError(f"plan {self.name!r}: its last kernel ({self.ops[last].kernel}) is not "
                             f"ordered after every input copy and before every output copy, so it "
                             f"cannot carry the model's functional effect; order it with events")
        ops = list(self.ops)
        effects = {**self.effects, _with_operands(ops, last, operands): effect}
        if start is not None:
            inputs = [i for i, op in enumerate(ops) if op.kind == "h2d"]
            first = next((i for i in launches
                          if anc[last] >> i & 1 and all(anc[i] >> j & 1 for j in inputs)
                          and ops[i].kernel not in effects), None)
            if first is not None:
                own = len(ops[first].args)
                effects[_with_operands(ops, first, start_operands)] = start(own)
        return Plan(self.name, self.kernels, ops, dict(self.buffers), self.io_bytes,
                    dict(self.params), self.cubin, self.ptx, effects, self.notif_group,
                    self.block_offsets)

    def ancestors(self) -> list[int]:
        """Per op, the bitset of the ops that complete before it starts, as replay issues
        them: stream order, the legacy default stream's ordering with the other (blocking)
        streams, and each wait's record."""
        anc: list[int] = []
        last: dict[int, int] = {}
        recorded: dict[int, int] = {}
        for i, op in enumerate(self.ops):
            preds = [last[op.stream]] if op.stream in last else []
            if op.stream == 0:
                preds += [j for st, j in last.items() if st]
            elif 0 in last:
                preds.append(last[0])
            if op.kind == "wait":
                preds.append(recorded[op.event])
            a = 0
            for j in preds:
                a |= anc[j] | 1 << j
            anc.append(a)
            last[op.stream] = i
            if op.kind == "record":
                recorded[op.event] = i
        return anc

    @property
    def request_buffers(self) -> dict[str, int]:
        """The buffers each request gets its own copy of (name -> bytes)."""
        return {n: b for n, b in self.buffers.items() if n not in self.params}


def compile_binder(ops: Sequence["PlanOp"]) -> Callable[[dict[str, int]], list]:
    """A function of a buffer set's pointers (buffer name -> device pointer) returning
    the plan bound to them, as :meth:`PlanAdaptor.bind_reference`: per step a copy's
    device pointer, a launch's argument tuple, or None.

    Speed (a trick, labelled): the plan is compiled into one list display, generated
    once per plan and run by ``exec`` (as ``dataclasses`` makes its ``__init__``):
    a buffer argument becomes ``p['name'] + offset``, a scalar a constant made once.
    A new buffer set is made on the dispatcher's loop when a burst outgrows the pool;
    binding step by step cost 1.5 us of Figure 2's 10.7 us per set, this 0.1 us, and
    on Figure 2 near its knee every 4 us per set moved 2 of 8 seeds past the SLO
    (docs/benchmarks.md, round 16). Names go in as ``repr`` literals, so no plan text
    is ever code."""
    consts: list[Any] = []
    items: list[str] = []
    for op in ops:
        if op.kind == "launch":
            parts = []
            for a in op.args:
                if isinstance(a, BufferArg):
                    parts.append(f"p[{str(a.buffer)!r}] + {int(a.offset)}")
                else:
                    consts.append(a.typed())
                    parts.append(f"c[{len(consts) - 1}]")
            items.append("(" + "".join(x + ", " for x in parts) + ")")
        elif op.kind in ("h2d", "d2h"):
            items.append(f"p[{str(op.buffer)!r}] + {int(op.buffer_offset)}")
        else:
            items.append("None")
    src = "def bind(p):\n    return [" + ", ".join(items) + "]\n"
    scope: dict[str, Any] = {"c": tuple(consts)}
    exec(src, scope)                         # noqa: S102 - generated from the plan, see above
    return scope["bind"]


class BufferSet:
    """One request's device buffers and the plan bound to them: ``ptrs`` maps every
    buffer name (the model's params included) to its device pointer, ``own`` lists the
    allocations of this set, ``bound[i]`` is step i's device pointer (a copy) or
    argument tuple (a launch). ``core``: what a kernel core made of it once, for every
    job on it (the dispatcher's: ``(CoreModel, args, copies)``)."""

    __slots__ = ("ptrs", "own", "bound", "core")

    def __init__(self, ptrs: dict[str, int], own: list[int], bound: list):
        self.ptrs, self.own, self.bound = ptrs, own, bound
        self.core = None


class BufferPool:
    """The per-request buffer sets of one model: grown on demand up to ``limit`` sets,
    reused when a job finishes. :meth:`acquire` returns None when ``limit`` sets are in
    use; the dispatcher then parks the job in :attr:`waiting` until :meth:`release`.

    A plan without per-request buffers needs no sets: every job shares one, unlimited.
    """

    def __init__(self, name: str, make: Callable[[], BufferSet], destroy: Callable[[BufferSet], None],
                 limit: int, set_bytes: int):
        if limit < 1:
            raise ValueError(f"model {name!r}: the buffer pool limit must be at least 1, got {limit}")
        self.name = name
        self.limit = limit
        self.set_bytes = set_bytes
        self._make, self._destroy = make, destroy
        self.free: list[BufferSet] = []
        self.created = 0
        self.in_use = 0
        self.peak = 0
        self.waiting: deque = deque()        # jobs held back, owned by the dispatcher
        self.closed = False
        self.shared: BufferSet | None = make() if set_bytes == 0 else None

    def acquire(self) -> BufferSet | None:
        if self.shared is not None:
            return self.shared
        if self.free:
            b = self.free.pop()
        elif self.created < self.limit:
            b = self._make()
            self.created += 1
        else:
            return None
        self.in_use += 1
        if self.in_use > self.peak:
            self.peak = self.in_use
        return b

    def reserve(self, n: int) -> list[BufferSet]:
        """Make up to ``n`` more sets now (within ``limit``), idle in :attr:`free`: what a
        burst of requests would otherwise make on the serving path (returned, so the
        caller can prepare them further). They are reclaimed like any idle set
        (:meth:`trim`, when the device's memory is full)."""
        made: list[BufferSet] = []
        if self.shared is not None or self.closed:
            return made
        for _ in range(max(0, min(n, self.limit - self.created))):
            try:
                b = self._make()
            except OutOfMemory:              # (the device filled up meanwhile: fewer)
                break
            self.created += 1
            self.free.append(b)
            made.append(b)
        return made

    def rebind(self, b: BufferSet) -> BufferSet:
        """A set freed by one job, for the next job waiting in :attr:`waiting` (the
        same plan: as it is)."""
        return b

    def release(self, b: BufferSet) -> None:
        if b is self.shared:
            return
        self.in_use -= 1
        if self.closed:
            self._destroy(b)
        else:
            self.free.append(b)

    @property
    def owner(self) -> "BufferPool":
        """What holds this pool's memory (a chunked view answers its shared memory)."""
        return self

    @property
    def held_bytes(self) -> int:
        """Device bytes of the sets this pool holds, in use or idle."""
        return self.created * self.set_bytes

    def trim(self) -> int:
        """Free the idle sets (the device's memory is full); returns the bytes freed.
        The pool grows again on demand."""
        n = len(self.free)
        while self.free:
            self._destroy(self.free.pop())
        self.created -= n
        return n * self.set_bytes

    def close(self) -> None:
        """Free the idle sets now; sets still in use are freed when released. Call it
        only once the model takes no more requests."""
        self.closed = True
        while self.free:
            self._destroy(self.free.pop())


class PlanAdaptor(JobAdaptor):
    """Serves a :class:`Plan`, which the dispatcher replays (no ``run``). The "almost
    finished" wake-up goes out before the last D2H copy (or before the last kernel when
    the plan copies nothing back).

    ``max_buffer_sets`` caps the per-request buffer sets (concurrent requests of this
    model on the device); by default the cap is ``buffer_budget`` bytes divided by one
    set's size (at least 1). Requests beyond it wait for a set (see the module doc).
    """

    def __init__(self, plan: Plan, *, max_buffer_sets: int | None = None,
                 buffer_budget: int = DEFAULT_BUFFER_BUDGET, memory: Any = None):
        self.plan = plan
        self.name = plan.name
        self.io_bytes = plan.io_bytes
        self.funcs: dict[str, Function] = {}
        self.buffers: dict[str, int] = {}    # the model's own (param) buffers: name -> pointer
        self._shared: set[str] = set()       # those of them from the device's SharedParams
        self.buffer_pool = None
        self.device: Device | None = None
        self._binder: Callable[[dict[str, int]], list] | None = None
        #: (name, bytes) of each per-request buffer (Plan.request_buffers is made per call)
        self._request_buffers = tuple(plan.request_buffers.items())
        self._set_bytes = sum(n for _, n in self._request_buffers)
        if max_buffer_sets is None:
            max_buffer_sets = max(1, buffer_budget // self._set_bytes) if self._set_bytes else 1
        self.max_buffer_sets = max_buffer_sets
        #: A :class:`~paella.dispatcher.chunked_buffers.ChunkedMemory` shared with the
        #: model's other variants, instead of a pool of buffer sets of this plan's own.
        self.memory = memory

    @classmethod
    def from_bundle(cls, bundle: Any, variant: int = 0, *, name: str | None = None,
                    **options: Any) -> "PlanAdaptor":
        """The adaptor of a compiled bundle's variant (see :func:`plan_from_bundle`)."""
        return cls(plan_from_bundle(bundle, variant, name=name), **options)

    def init(self, device: Device) -> None:
        plan = self.plan
        self.device = device
        self.funcs = device.load_module(ModuleImage(plan.name, list(plan.kernels),
                                                    cubin=plan.cubin, ptx=plan.ptx,
                                                    effects=dict(plan.effects)))
        for op in plan.ops:
            if op.kind == "launch":
                # Refuse a kernel that can never run now, at registration, by name.
                device.block_footprint(self.funcs[op.kernel], dim3(op.block, "block"), op.dyn_smem)
        try:
            self._upload_params(device)
            self._open_pool()
        except Exception:
            self.close(device)
            raise

    def _open_pool(self) -> None:
        """The per-request buffer sets: a view of the shared memory, or a pool of its own."""
        if self.memory is not None and self._set_bytes:
            self.buffer_pool = self.memory.view(self)
        else:
            self.buffer_pool = BufferPool(self.plan.name, self._new_set, self._free_set,
                                          self.max_buffer_sets, self._set_bytes)

    def _upload_params(self, device: Device) -> None:
        """Allocate every param buffer and copy its initial contents to the device, then
        wait for it. A param with contents is shared with the other plans holding the
        same contents object (the model's other variants: :mod:`.shared_params`), and
        uploaded only by the first; one without (timing only) is this plan's own."""
        store = shared_params(device)
        pending = False
        for name, data in self.plan.params.items():
            nbytes = self.plan.buffers[name]
            if data:
                ptr, new = store.acquire(device, data, nbytes)
                self.buffers[name] = ptr
                self._shared.add(name)
                if new:
                    upload(device, ptr, data)
                    pending = True
            else:
                self.buffers[name] = device.alloc(nbytes)
        if pending:
            device.synchronize()

    def _new_set(self) -> BufferSet:
        device = self.device
        ptrs = dict(self.buffers)
        own: list[int] = []
        try:
            for name, nbytes in self._request_buffers:
                ptrs[name] = p = device.alloc(nbytes)
                own.append(p)
        except Exception:
            for p in own:
                device.free(p)
            raise
        return BufferSet(ptrs, own, self.bind(ptrs))

    def _free_set(self, b: BufferSet) -> None:
        for p in b.own:
            self.device.free(p)
        b.own = []

    def bind(self, ptrs: dict[str, int]) -> list:
        """Per step: a copy's device pointer, or a launch's argument tuple (what
        :meth:`bind_reference` computes, by the plan's compiled binder)."""
        binder = self._binder
        if binder is None:
            binder = self._binder = compile_binder(self.plan.ops)
        return binder(ptrs)

    def bind_reference(self, ptrs: dict[str, int]) -> list:
        """:meth:`bind`, step by step (the reference of the compiled binder)."""
        bound: list = []
        for op in self.plan.ops:
            if op.kind == "launch":
                bound.append(tuple(ptrs[a.buffer] + a.offset if isinstance(a, BufferArg) else a.typed()
                                   for a in op.args))
            elif op.kind in ("h2d", "d2h"):
                bound.append(ptrs[op.buffer] + op.buffer_offset)
            else:                          # record / wait: nothing to bind
                bound.append(None)
        return bound

    def close(self, device: Device) -> None:
        """Free the parameters and the idle buffer sets (sets still in use go when their
        job releases them) and unload the kernels. Once is enough; again does nothing."""
        self._close_pool()
        buffers, self.buffers = self.buffers, {}
        shared, self._shared = self._shared, set()
        store = shared_params(device) if shared else None
        for name, ptr in buffers.items():
            if name in shared:
                store.release(device, ptr)
            else:
                device.free(ptr)
        funcs, self.funcs = self.funcs, {}
        device.unload_module(funcs)

    def _close_pool(self) -> None:
        pool, self.buffer_pool = self.buffer_pool, None
        if pool is not None:
            pool.close()
            if pool.shared is not None:
                self._free_set(pool.shared)


def plan_from_bundle(bundle: Any, variant: int = 0, *, name: str | None = None,
                     weights: bool = True) -> Plan:
    """A compiled bundle's variant (:mod:`paella.bundle`) as a :class:`Plan`.

    Buffers are named by their id (``"5"``); ``param`` buffers carry their contents from
    ``params.npz`` and are shared by the model's requests; input, intermediate and
    workspace buffers are per request. Launch args keep their order, offsets and
    scalar dtypes; copies keep ``buffer_offset``. The module image is the bundle's cubin
    and PTX (whichever exist). ``weights=False`` leaves the params' contents out (their
    buffers are still allocated, never uploaded): for timing on the simulator, where a
    BERT-base's 340 MB per variant would only cost memory and copies.
    """
    if not 0 <= variant < len(bundle.variants):
        raise ValueError(f"bundle {bundle.model!r} has {len(bundle.variants)} variant(s); "
                         f"variant {variant} does not exist")
    v = bundle.variants[variant]
    kernels = [KernelInfo(k.name, k.registers, static_smem=k.static_smem, flops=k.flops,
                          bytes=k.bytes) for k in v.kernels]
    ops = []
    for op in v.plan:
        if op.op == "launch":
            args = tuple(BufferArg(str(a.buffer), a.offset) if a.buffer is not None
                         else ScalarArg(a.scalar, a.dtype) for a in op.args)
            ops.append(PlanOp("launch", stream=op.stream, kernel=op.kernel, grid=tuple(op.grid),
                              block=tuple(op.block), dyn_smem=op.dyn_smem, args=args))
        elif op.op in ("record", "wait"):
            ops.append(PlanOp(op.op, stream=op.stream, event=op.event))
        else:
            ops.append(PlanOp(op.op, stream=op.stream, buffer=str(op.buffer),
                              buffer_offset=op.buffer_offset, io_offset=op.io_offset,
                              nbytes=op.nbytes))
    if weights:
        params = {str(i): data for i, data in bundle.param_bytes(variant).items()}
    else:                       # timing only: the buffers, not their contents (see the doc)
        params = {str(b.id): b"" for b in v.buffers if b.kind == "param"}
    files = {**bundle.manifest.files, **v.files}
    code = {key: bundle.file(key, variant).read_bytes() if key in files else None
            for key in ("cubin", "ptx")}
    m = bundle.manifest
    return Plan(name or bundle.model, kernels, ops, {str(b.id): b.nbytes for b in v.buffers},
                v.io_bytes, params=params, cubin=code["cubin"], ptx=code["ptx"],
                notif_group=m.group if m.instrumented else 0, block_offsets=m.instrumented)


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
