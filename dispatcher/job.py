"""Jobs: the execution of a list of requests (one by default), and the CUDA-like API that
code inside a job calls (§4.2).

A job depends on its dispatcher only through :class:`JobHost`, the narrow interface the
dispatcher implements: the clock, checked launch records, device memory, the waitlist
callback, failure, and the instruments. Nothing here reaches into the dispatcher, the
tracker or the device.

A job runs one of two ways, decided by its model:

* a **launch plan** (:class:`~paella.dispatcher.replay.ReplayPlan`) is replayed by the
  dispatcher: every op goes into the job's waitlist at start, no greenlet;
* any other adaptor's ``run(io)`` executes inside the job's greenlet. Its CUDA calls
  (:mod:`paella.dispatcher.cudart`, or the methods below) never reach the device: they
  append ops to the job's :class:`~paella.dispatcher.waitlist.Waitlist` and return.
  Synchronous calls (stream/event/device synchronize) switch back to the dispatcher
  loop, which switches into the job again once what it waits for has completed; a
  synchronize with nothing pending returns at once, without yielding.

**Requests.** ``job.requests`` are the requests the job serves; ``job.io`` is the io
buffer its work reads and writes (the single request's own by default; a batcher that
groups requests gives the job the buffer it laid out). Completion, the "almost
finished" wake-up and cancellation are per request (see the dispatcher).
"""
from __future__ import annotations

from collections import deque
from typing import Any, Protocol, Sequence

import greenlet
import numpy as np

from paella.dispatcher.devices.base import D2H, H2D, KERNEL, Function, OutOfMemory
from paella.plugins import PLUGIN_ERRORS
from paella.wire import DEFAULT_PRIORITY as DEFAULT_LEVEL

from .instruments import Instruments
from .ops import KernelLaunch, Op
from .waitlist import DONE, Event, Node, VStream, Waitlist

RUNNING, FINISHED = 0, 1

_current: "Job | None" = None


class NotInJobError(RuntimeError):
    """A CUDA-like call was made outside a job (adaptor.run() under the dispatcher)."""


def current() -> "Job":
    """The job whose greenlet is running; the CUDA-like calls act on it."""
    if _current is None:
        raise NotInJobError("paella.dispatcher.cudart calls are only valid inside a job "
                            "adaptor's run(io), executed by the dispatcher")
    return _current


class JobHost(Protocol):
    """What a job needs of the dispatcher that runs it, and all it may use."""

    #: The device clock as of the current loop iteration (seconds).
    now: float
    #: Whether new waitlists release eagerly (the policy's ``eager``).
    eager: bool
    #: Kernels of one stream that may be released and not completed (1: none ahead).
    lookahead: int
    #: The dispatcher's instruments (``op_issued`` is the job's to call).
    instruments: Instruments

    def kernel_launch(self, func: Function, grid: Any, block: Any,
                      dyn_smem: int) -> KernelLaunch:
        """The checked launch record: raises OccupancyError if a block can never fit on
        an SM, ValueError if the launch would post more notifQ entries than the ring has."""

    def alloc(self, nbytes: int) -> int:
        """Device memory (freed with :meth:`free`)."""

    def free(self, ptr: int) -> None:
        """Free what :meth:`alloc` returned."""

    def memory_blocked(self, job: "Job") -> bool:
        """``job``'s own allocation found the device full: True if it is to wait (another
        job holds memory it will give back; the host resumes it to try again), False if
        it is to fail (nothing running could make room)."""

    def op_active(self, op: Node) -> None:
        """The waitlist callback: ``op`` has no unmet dependency left."""

    def job_failed(self, job: "Job") -> None:
        """The job's code raised (``job.error`` says why): drop its unreleased work."""


class Job:
    """One job's execution: its greenlet or replayed plan, waitlist and scheduling state.

    What a policy may read: ``seq`` (arrival order), ``client_id`` (its first request's
    client), ``model`` (``name``, ``profile``), ``estimate`` and ``remaining`` (the SRPT
    estimate, charged by the dispatcher before ``released``), ``ready[0]`` (the next
    kernel: an :class:`~paella.dispatcher.ops.Op`, ``.launch`` its record). A policy keeps
    its own per-job state in ``policy_state``, which nothing else reads or writes.
    """

    # Slots, no __dict__: a job is read on every kernel (policies keep their state in
    # ``policy_state``).
    __slots__ = ("host", "requests", "io", "model", "client_id", "seq", "waitlist", "ready",
                 "in_policy", "left_policy", "policy_state", "estimate", "remaining", "kcount",
                 "glet", "state", "returned", "error", "wait_op", "wait_all", "blocked",
                 "almost_sent", "almost_next", "cancelled", "allocations", "bindings",
                 "t_arrival", "t_start", "pin", "waited_memory", "waiting_memory", "core",
                 "level", "answered", "home", "__weakref__")

    def __init__(self, host: JobHost, model: Any, requests: list[Any], io: np.ndarray,
                 seq: int):
        # model: the dispatcher's Model (name, adaptor, profile, pool, replay); requests:
        # its Request records (client_id, t_submit, ...). Duck-typed: a job knows nothing
        # of the dispatcher's module.
        self.host = host
        self.requests = requests
        self.io = io
        self.model = model
        self.client_id = requests[0].client_id
        #: Its priority class, its most urgent request's (1 the most urgent .. 255; a
        #: request naming none counts as the middle class, 128): every built-in policy
        #: orders by it first.
        self.level = min((getattr(r, "priority", 0) or DEFAULT_LEVEL) for r in requests)
        self.seq = seq                       # arrival order
        self.waitlist = Waitlist(host.op_active)
        self.waitlist.eager = host.eager
        self.ready: deque[Op] = deque()      # released-able kernels, issue order
        self.in_policy = False               # the dispatcher's: announced to the policy
        self.left_policy = False             # job_finished() was called
        self.policy_state: Any = None        # the policy's own, opaque to everything else
        # SRPT estimate (see profile.py).
        self.estimate = model.profile.total
        self.remaining = self.estimate
        self.kcount: dict[str, int] = {}
        # Greenlet and synchronization.
        self.glet: greenlet.greenlet | None = None
        self.state = RUNNING
        self.returned = False                # run() has returned (or raised), or the plan is issued
        self.error: str | None = None
        self.wait_op: Node | None = None
        self.wait_all = False
        self.blocked = False
        self.almost_sent = False
        self.almost_next = False
        self.cancelled = False
        self.allocations: list[int] = []
        # The adaptor's per-request device buffers (adaptor.BufferSet), acquired by the
        # dispatcher before the job starts and returned when it finishes.
        self.bindings: Any = None
        self.t_arrival = requests[0].t_submit
        self.waited_memory = False          # it found the device's memory full once
        self.waiting_memory = False         # its greenlet waits in malloc for memory
        self.t_start = float("nan")        # (never started: cancelled or failed waiting)
        #: The real stream its ops go to (-1: the dispatcher's stream map chooses);
        #: set by ``Dispatcher.submit_group(stream=...)``.
        self.pin = -1
        #: In ``single`` stream mode, the real stream all its ops go to (-1: not chosen
        #: yet): stream 0, unless the device holds a kernel there (StreamMap.ungated).
        self.home = -1
        #: Its handle in the dispatcher's kernel core (-1: not run by one).
        self.core = -1
        #: Its answer was computed before it started (the dispatcher's ``answer_ahead``):
        #: it is not asked again.
        self.answered = False

    def __repr__(self) -> str:
        ids = ",".join(str(r.req_id) for r in self.requests)
        return f"<Job {self.seq} req={ids} model={self.model.name}>"

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
            self.model.adaptor.run(self.io)
        except PLUGIN_ERRORS as e:   # the adaptor's failure (sys.exit() too) fails this job only
            self.fail(e)
        self.returned = True

    def fail(self, exc: BaseException) -> None:
        """The job's code (or its plan's checks) raised: fail it, through the host."""
        self.error = f"{type(exc).__name__}: {exc}"
        self.host.job_failed(self)

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
        # Refuse what can never run, now, with the kernel's name.
        launch = self.host.kernel_launch(func, grid, block, dyn_smem)
        return self.issue(Op(KERNEL, self, self._stream(stream), launch, tuple(args)))

    def memcpy_htod(self, dst: int, src: np.ndarray, stream: VStream | None = None) -> Op:
        return self.issue(Op(H2D, self, self._stream(stream), host=_contiguous(src, "source"),
                             dptr=dst))

    def memcpy_dtoh(self, dst: np.ndarray, src: int, stream: VStream | None = None) -> Op:
        return self.issue(Op(D2H, self, self._stream(stream),
                             host=_contiguous(dst, "destination"), dptr=src))

    def event_create(self) -> Event:
        return Event()

    def event_record(self, event: Event, stream: VStream | None = None) -> None:
        _check_event(event)
        self._check_running()
        event.marker = self.waitlist.record(self._stream(stream))

    def event_query(self, event: Event) -> bool:
        _check_event(event)
        return event.done()

    def stream_wait_event(self, stream: VStream | None, event: Event) -> None:
        _check_event(event)
        self._check_running()
        self.waitlist.wait_event(self._stream(stream), event)

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
        """Device memory for this job, freed when the job ends. On a full device it
        waits, like a synchronize, while other jobs hold memory they will give back;
        with none, the ``OutOfMemory`` fails the job (docs/dispatcher.md)."""
        while True:
            try:
                ptr = self.host.alloc(nbytes)
                break
            except OutOfMemory:
                if greenlet.getcurrent() is not self.glet or not self.host.memory_blocked(self):
                    raise
                self.waiting_memory = True
                try:
                    self._yield()
                finally:
                    self.waiting_memory = False
        self.allocations.append(ptr)
        return ptr

    def almost_finished(self) -> None:
        """Arm the client's "almost finished" wake-up (§4.2) on the next op issued: it is
        sent when that op is released to the GPU (e.g. the last D2H copy)."""
        self.almost_next = True

    # -- issuing ---------------------------------------------------------------------------
    def issue(self, op: Op) -> Op:
        """Put ``op`` (of this job) into the waitlist, behind what it depends on."""
        self._check_running()
        host = self.host
        op.t_issue = host.now
        if self.almost_next:
            self.almost_next = False
            op.almost_finished = True
        self.waitlist.issue(op)
        if "op_issued" in host.instruments:
            host.instruments.call("op_issued", op)
        return op

    def issue_all(self, ops: list[Op]) -> None:
        """:meth:`issue` each of ``ops`` in order (a replayed plan's). Speed: the checks
        and the clock read once, not per op."""
        self._check_running()
        host = self.host
        now = host.now
        for op in ops:
            op.t_issue = now
        self.waitlist.issue_all(ops)
        if "op_issued" in host.instruments:
            for op in ops:
                host.instruments.call("op_issued", op)

    def _check_running(self) -> None:
        if self.state != RUNNING or self.error is not None:
            raise RuntimeError(f"job {self.seq} (model {self.model.name}) is no longer running")

    def _wait_for(self, op: Node | None) -> None:
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
