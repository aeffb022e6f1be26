"""Jobs: one greenlet per request, and the CUDA-like API that code inside it calls (§4.2).

An adaptor's ``run(io)`` executes inside the job's greenlet. Its CUDA calls
(:mod:`paella.dispatcher.cuda`, or the methods below) never reach the device: they
append ops to the job's :class:`~paella.dispatcher.waitlist.Waitlist` and return.
Synchronous calls (stream/event/device synchronize) switch back to the dispatcher
loop, which switches into the job again once what it waits for has completed; a
synchronize with nothing pending returns at once, without yielding.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Sequence

import greenlet
import numpy as np

from paella.dispatcher.devices.base import Function, dim3

from .waitlist import D2H, DONE, H2D, KERNEL, MARKER, READY, WAITING, Event, Op, VStream, Waitlist

if TYPE_CHECKING:
    from .core import Dispatcher, Request

RUNNING, FINISHED = 0, 1

_current: "Job | None" = None


class NotInJobError(RuntimeError):
    """A CUDA-like call was made outside a job (adaptor.run() under the dispatcher)."""


def current() -> "Job":
    """The job whose greenlet is running; the CUDA-like calls act on it."""
    if _current is None:
        raise NotInJobError("paella.dispatcher.cuda calls are only valid inside a job adaptor's "
                            "run(io), executed by the dispatcher")
    return _current


class Job:
    """One request's execution: its greenlet, waitlist and scheduling state."""

    # Slots: a job is read on every kernel, and with more attributes than CPython
    # shares keys for (30) every instance carried its own dict. ``__dict__`` stays for
    # the attributes policies add (``paella``'s ``infifo``, a plug-in's own).
    __slots__ = ("d", "req", "model", "client_id", "seq", "waitlist", "ready", "queued",
                 "in_policy", "left_policy", "pver", "punit", "estimate", "remaining", "kcount",
                 "glet", "state", "returned", "error", "wait_op", "wait_all", "blocked",
                 "almost_sent", "almost_next", "cancelled", "allocations", "bindings",
                 "t_arrival", "t_start", "plan", "cursor", "__dict__", "__weakref__")

    def __init__(self, dispatcher: "Dispatcher", req: "Request", model: Any, seq: int):
        self.d = dispatcher
        self.req = req
        self.model = model
        self.client_id = req.client_id
        self.seq = seq                       # arrival order
        self.waitlist = Waitlist(dispatcher._on_active)
        self.waitlist.eager = dispatcher.policy.eager
        self.ready: deque[Op] = deque()      # released-able kernels, issue order
        # Policy state.
        self.queued = False                  # owned by the policy
        self.in_policy = False               # owned by the dispatcher: announced as ready
        self.left_policy = False             # job_finished() was called
        self.pver = 0
        self.punit: Any = None
        # SRPT estimate (see profile.py).
        self.estimate = model.profile.total
        self.remaining = self.estimate
        self.kcount: dict[str, int] = {}
        # Greenlet and synchronization.
        self.glet: greenlet.greenlet | None = None
        self.state = RUNNING
        self.returned = False                # run() has returned (or raised)
        self.error: str | None = None
        self.wait_op: Op | None = None
        self.wait_all = False
        self.blocked = False
        self.almost_sent = False
        self.almost_next = False
        self.cancelled = False
        self.allocations: list[int] = []
        # The adaptor's per-request device buffers (adaptor.BufferSet), acquired by the
        # dispatcher before the job starts and returned when it finishes.
        self.bindings: Any = None
        self.t_arrival = req.t_submit
        self.t_start = 0.0
        # A lazily started straight-line plan (PlanTemplate.start): its template while
        # steps remain to be made, and the step of its current op.
        self.plan: PlanTemplate | None = None
        self.cursor = 0

    def __repr__(self) -> str:
        return f"<Job {self.seq} req={self.req.req_id} model={self.model.name}>"

    # -- lifecycle (dispatcher side) ----------------------------------------------------------
    def start(self) -> None:
        self.glet = greenlet.greenlet(self._main)
        self.resume()

    def resume(self) -> None:
        global _current
        self.blocked = False
        prev = _current
        _current = self
        try:
            self.glet.switch()
        finally:
            _current = prev

    def _main(self) -> None:
        try:
            self.model.adaptor.run(self.req.io)
        except Exception as e:   # the adaptor's failure fails this request only
            self.error = f"{type(e).__name__}: {e}"
            self.d._job_failed(self)
        self.returned = True

    def wake_if_satisfied(self) -> bool:
        """Called when one of its ops finished: is the job's synchronize satisfied?"""
        if self.wait_all:
            return self.waitlist.pending == 0
        op = self.wait_op
        return op is not None and op.state >= DONE

    # -- the CUDA-like API (job side) ----------------------------------------------------------
    def stream_create(self, non_blocking: bool = False) -> VStream:
        return self.waitlist.create_stream(non_blocking)

    def stream_destroy(self, stream: VStream) -> None:
        self.waitlist.destroy_stream(stream)

    def _stream(self, stream: VStream | None) -> VStream:
        if stream is None or stream == 0:
            return self.waitlist.default
        self.waitlist.check_stream(stream)
        return stream

    def launch(self, func: Function, grid: int | Sequence[int], block: int | Sequence[int],
               stream: VStream | None = None, *, dyn_smem: int = 0, args: Sequence[Any] = ()) -> Op:
        if not isinstance(func, Function):
            raise TypeError(f"launch needs a Function from device.load_module(), got {func!r}")
        g = dim3(grid, "grid")
        b = dim3(block, "block")
        # Refuse what can never run, now, with the kernel's name: an OccupancyError says
        # which limit is exceeded. (Footprints are cached on the Function.)
        fp = self.d.device.block_footprint(func, b, dyn_smem)
        blocks = g[0] * g[1] * g[2]
        self.d._check_launch_size(func, blocks)
        op = Op(KERNEL, self, self._stream(stream))
        op.func, op.key, op.grid, op.block, op.dyn_smem, op.args = func, func.name, g, b, dyn_smem, tuple(args)
        op.fp, op.blocks = fp, blocks
        self.d.tracker.prepare(op)
        return self._issue(op)

    def memcpy_htod(self, dst: int, src: np.ndarray, stream: VStream | None = None) -> Op:
        op = Op(H2D, self, self._stream(stream))
        op.dptr, op.host = dst, _contiguous(src, "source")
        return self._issue(op)

    def memcpy_dtoh(self, dst: np.ndarray, src: int, stream: VStream | None = None) -> Op:
        op = Op(D2H, self, self._stream(stream))
        op.dptr, op.host = src, _contiguous(dst, "destination")
        return self._issue(op)

    def event_create(self) -> Event:
        return Event()

    def event_record(self, event: Event, stream: VStream | None = None) -> None:
        _check_event(event)
        event.marker = self._issue(Op(MARKER, self, self._stream(stream)))

    def event_query(self, event: Event) -> bool:
        _check_event(event)
        return event.done()

    def stream_wait_event(self, stream: VStream | None, event: Event) -> None:
        _check_event(event)
        self.waitlist.wait_event(self._stream(stream), event, self)

    def stream_query(self, stream: VStream | None = None) -> bool:
        return self._stream(stream).idle()

    def stream_synchronize(self, stream: VStream | None = None) -> None:
        self._wait_for(self._stream(stream).last)

    def event_synchronize(self, event: Event) -> None:
        _check_event(event)
        self._wait_for(event.marker)

    def device_synchronize(self) -> None:
        if self.waitlist.pending:
            self.wait_all = True
            self._yield()
            self.wait_all = False

    def malloc(self, nbytes: int) -> int:
        """Device memory for this job, freed when the job ends."""
        ptr = self.d.device.alloc(nbytes)
        self.allocations.append(ptr)
        return ptr

    def almost_finished(self) -> None:
        """Arm the client's "almost finished" wake-up (§4.2) on the next op issued: it is
        sent when that op is released to the GPU (e.g. the last D2H copy)."""
        self.almost_next = True

    # -- helpers ---------------------------------------------------------------------------
    def _issue(self, op: Op) -> Op:
        if self.state != RUNNING or self.error is not None:
            raise RuntimeError(f"job of request {self.req.req_id} is no longer running")
        op.t_issue = self.d.now
        if self.almost_next:
            self.almost_next = False
            op.almost_finished = True
        return self.waitlist.issue(op)

    def _wait_for(self, op: Op | None) -> None:
        if op is None or op.state >= DONE:
            return                           # nothing pending: return at once
        self.wait_op = op
        self._yield()
        self.wait_op = None

    def _yield(self) -> None:
        if greenlet.getcurrent() is not self.glet:
            raise NotInJobError("a synchronize was called outside the job's own greenlet")
        self.blocked = True
        self.glet.parent.switch()


def _check_event(event: Any) -> None:
    if not isinstance(event, Event):
        raise TypeError(f"expected an Event from event_create(), got {event!r}")


def _contiguous(arr: Any, what: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
        raise TypeError(f"copy {what} must be a C-contiguous numpy array (got {type(arr).__name__}); "
                        f"use np.ascontiguousarray()")
    return arr


class PlanTemplate:
    """A launch plan compiled once per model, instantiated per request (Nimble-style).

    Everything a plan op needs is resolved at registration: the loaded function, dim3
    grid and block, the footprint (flattened for the tracker), the notifQ entries, the
    io range, the "almost finished" mark. What differs per request is bound ahead too:
    the job's buffer set (``job.bindings``, see :class:`~paella.dispatcher.adaptor.BufferSet`)
    carries each step's device pointer (copies) or argument tuple (launches), bound once
    when the set was created. A request then costs one :class:`Op` per step and no
    greenlet at all: :meth:`instantiate` issues the whole plan into the job's waitlist
    at once, which is what ``PlanAdaptor.run`` does up to its final
    ``device_synchronize`` (the job finishes when its last op completes, as that
    synchronize would return then).

    A straight-line plan (every op on stream 0) is linked directly: op i depends on op
    i-1 only, which is what :meth:`Waitlist.issue` computes for it, without the
    per-op dependency analysis. Other plans go through ``Waitlist.issue`` op by op.
    """

    __slots__ = ("name", "io_bytes", "specs", "protos", "streams", "straight", "n")

    def __init__(self, adaptor: Any, dispatcher: "Dispatcher"):
        device = dispatcher.device
        tracker = dispatcher.tracker
        self.name = adaptor.name
        self.io_bytes = adaptor.io_bytes
        self.streams = list(adaptor._streams)
        self.straight = not self.streams
        specs = []
        almost = adaptor._almost_at
        for i, (kind, a, b, c, d, s) in enumerate(adaptor._steps):
            if kind == 0:
                g, blk = dim3(b, "grid"), dim3(c, "block")
                fp = device.block_footprint(a, blk, d)
                blocks = g[0] * g[1] * g[2]
                specs.append((KERNEL, s, i == almost, a, a.name, g, blk, d, fp, blocks,
                              fp.warps, fp.regs, fp.smem, tracker.entries_for(blocks)))
            else:
                specs.append((H2D if kind == 1 else D2H, s, i == almost, b, c))
        self.specs = specs
        self.protos = [_proto(spec) for spec in specs]
        self.n = len(specs)

    def _check(self, job: Job, io: np.ndarray) -> list:
        """What ``PlanAdaptor.run`` checks first; returns the job's bound arguments."""
        if io.size < self.io_bytes:
            raise ValueError(f"io buffer of {io.size} bytes is smaller than model "
                             f"{self.name!r} needs ({self.io_bytes})")
        if job.bindings is None:
            raise RuntimeError(f"model {self.name!r}: the job holds no buffer set (the adaptor "
                               f"has no buffer_pool after init; internal error, please report)")
        return job.bindings.bound

    def make(self, job: Job, i: int, vs: VStream, bound: list, io: np.ndarray) -> Op:
        """Step ``i``'s op for ``job`` on virtual stream ``vs``, not yet issued."""
        # (One Op class for every op: a class per step, holding what its ops share, made
        # ops cheaper to build but every attribute read in the loop slower, since
        # CPython's inline caches specialise on one type per site.) Speed: the op is
        # made without Op.__init__, every other slot from the step's prototype in one
        # unpack (see _proto), which stores each slot once (~35% cheaper).
        proto = self.protos[i]
        op = _new_op(Op)
        (op.kind, op.almost_finished, op.func, op.key, op.grid, op.block, op.dyn_smem, op.fp,
         op.blocks, op.fw, op.fr, op.fs, op.entries, op.deps, op.pred, op.pred_pending, op.succ,
         op.dependents, op.state, op.host, op.dptr, op.args, op.stream, op.launch_id, op.placed,
         op.ended, op.t_release, op.t_first) = proto
        op.job = job
        op.vstream = vs
        op.t_issue = job.t_start
        if proto[0] == KERNEL:
            op.args = bound[i]
        else:
            spec = self.specs[i]
            op.dptr = bound[i]
            op.host = io[spec[3]:spec[4]]
        return op

    def start(self, job: Job, io: np.ndarray) -> Op | None:
        """Start ``job`` on a straight-line plan, lazily: only step 0's op exists, as
        the only op of the stream that can be active (``job.plan``, ``job.cursor``); the
        dispatcher makes the next one when it completes (:meth:`make`). Same
        dependencies, same order as :meth:`instantiate`, without building and linking
        the ops that wait. Not for eager policies, whose stream successors go to the
        GPU while their predecessor runs. Returns the first op (to activate), or None
        for an empty plan. Raises as ``PlanAdaptor.run`` would."""
        bound = self._check(job, io)
        job.t_start = job.d.now
        if not self.n:
            return None
        wl = job.waitlist
        op = self.make(job, 0, wl.default, bound, io)
        job.plan = self
        job.cursor = 0
        wl.default.last = op
        wl.pending = 1                       # the steps not yet made are not issued
        op.state = READY
        return op

    def materialize(self, job: Job) -> None:
        """Issue the steps a lazily started job has not made yet (the policy changed to
        an eager one, or the job is inspected as a whole): it becomes an ordinary
        waitlisted job."""
        if job.plan is not self:
            return
        job.plan = None
        bound, io, wl = job.bindings.bound, job.req.io, job.waitlist
        for i in range(job.cursor + 1, self.n):
            wl.issue(self.make(job, i, wl.default, bound, io))

    def instantiate(self, job: Job, io: np.ndarray) -> None:
        """Issue the whole plan for ``job``; raises as ``PlanAdaptor.run`` would."""
        bound = self._check(job, io)
        job.t_start = job.d.now
        wl = job.waitlist
        if not self.straight:
            streams = {0: wl.default}
            for s in self.streams:
                streams[s] = wl.create_stream()
            for i, spec in enumerate(self.specs):
                wl.issue(self.make(job, i, streams[spec[1]], bound, io))
            return
        # Inlined Waitlist.issue for a straight line (nothing is released yet).
        vs = wl.default
        prev = None
        first = None
        for i in range(self.n):
            op = self.make(job, i, vs, bound, io)
            if prev is None:
                first = op
            else:
                op.pred = prev
                op.pred_pending = True
                op.deps = 1
                prev.succ = op
            prev = op
        if first is not None:
            vs.last = prev
            wl.pending += self.n
            wl._activate(first)


_new_op = object.__new__


def _proto(spec: tuple) -> tuple:
    """The slots of a plan step's ops that are the same for every request, in the order
    :meth:`PlanTemplate.make` unpacks them: the step's own (kernel launch or copy) and
    :class:`Op`'s initial values for the rest (kept equal to ``Op.__init__``'s). A
    kernel's ``args``, a copy's ``dptr`` and ``host`` are the job's, set by ``make``."""
    if spec[0] == KERNEL:
        (kind, _, almost, func, key, grid, block, dyn_smem, fp, blocks, fw, fr, fs,
         entries) = spec
    else:
        kind, almost = spec[0], spec[2]
        func = key = grid = block = fp = None
        dyn_smem = blocks = fw = fr = fs = entries = 0
    return (kind, almost, func, key, grid, block, dyn_smem, fp, blocks, fw, fr, fs, entries,
            0, None, False, None, None, WAITING, None, 0, (), -1, -1, 0, 0, 0.0, 0.0)
