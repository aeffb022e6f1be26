"""Launch plans replayed by the dispatcher: compiled once per model, issued per request.

A :class:`~paella.dispatcher.adaptor.PlanAdaptor`'s plan is not code: it is a record
(``Plan``, ``PlanOp``), and the dispatcher replays it for every request with no greenlet
and no per-kernel adaptor code (Nimble's ahead-of-time replay). :class:`ReplayPlan`
resolves at registration everything a step needs (the loaded function, the checked
:class:`~paella.dispatcher.ops.KernelLaunch` with its tracker demand, the io range, the
"almost finished" mark); what differs per request is bound ahead too: the job's buffer
set (``job.bindings``, see :class:`~paella.dispatcher.adaptor.BufferSet`) carries each
step's device pointer (copies) or argument tuple (launches). A request then costs one
:class:`~paella.dispatcher.ops.Op` per step, issued through the job's own ``issue`` into
its waitlist, exactly as the same calls made through :mod:`~paella.dispatcher.cudart`
would be (``tests/dispatcher/test_hot_path.py`` compares the two). The job finishes when
its last op completes.

A multi-stream plan orders its streams with ``record`` / ``wait`` steps on plan-level
event numbers: each request gets fresh :class:`~paella.dispatcher.waitlist.Event` s, and
the steps become the waitlist's own event record and stream-wait-event, the same MARKER
nodes ``cudart.event_record`` / ``cudart.stream_wait_event`` make.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from paella.dispatcher.devices.base import D2H, H2D, KERNEL, Function

#: Step kinds of a plan's event steps (no device op: waitlist MARKERs).
RECORD, WAIT = -1, -2

from .ops import KernelLaunch, Op
from .waitlist import Event

if TYPE_CHECKING:
    from .adaptor import Plan
    from .job import Job


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """One step of a compiled plan."""
    kind: int                       # KERNEL, H2D or D2H
    stream: int                     # the plan's stream number (0: the default stream)
    almost_finished: bool           # the client's wake-up goes when this step is released
    launch: KernelLaunch | None     # kernels: the checked launch record
    io_start: int = 0               # copies: the io buffer's bytes [io_start, io_end)
    io_end: int = 0
    event: int = 0                  # record / wait: index into the request's events


class ReplayPlan:
    """A plan compiled for one dispatcher. ``refusal`` is set (and every request fails with
    it) when a kernel can never be launched here, e.g. more notifQ entries than the ring."""

    __slots__ = ("name", "io_bytes", "steps", "streams", "refusal", "n_events")

    def __init__(self, plan: "Plan", funcs: dict[str, Function],
                 kernel_launch: Callable[..., KernelLaunch]):
        self.name = plan.name
        self.io_bytes = plan.io_bytes
        self.streams = tuple(sorted({op.stream for op in plan.ops if op.stream}))
        self.refusal: str | None = None
        # The wake-up goes before the last D2H copy, or before the last kernel without one.
        kinds = [op.kind for op in plan.ops]
        almost = max((i for i, k in enumerate(kinds) if k == "d2h"), default=-1)
        if almost < 0:
            almost = max((i for i, k in enumerate(kinds) if k == "launch"), default=-1)
        steps = []
        events: dict[int, int] = {}          # plan event number -> dense index
        for i, op in enumerate(plan.ops):
            if op.kind in ("record", "wait"):
                steps.append(ReplayStep(RECORD if op.kind == "record" else WAIT, op.stream,
                                        False, None, event=events.setdefault(op.event, len(events))))
            elif op.kind == "launch":
                try:
                    launch = kernel_launch(funcs[op.kernel], op.grid, op.block, op.dyn_smem)
                except ValueError as e:          # too large for this dispatcher's notifQ
                    self.refusal = self.refusal or f"ValueError: {e}"
                    launch = None
                steps.append(ReplayStep(KERNEL, op.stream, i == almost, launch))
            else:
                steps.append(ReplayStep(H2D if op.kind == "h2d" else D2H, op.stream, i == almost,
                                        None, op.io_offset, op.io_offset + op.nbytes))
        self.steps = tuple(steps)
        self.n_events = len(events)

    def issue(self, job: "Job") -> None:
        """Issue the whole plan for ``job``; raises (failing the job) when the io buffer is
        too small, the job holds no buffer set, or the plan was refused here."""
        io = job.io
        if self.refusal is not None:
            raise ValueError(self.refusal)
        if io.size < self.io_bytes:
            raise ValueError(f"io buffer of {io.size} bytes is smaller than model "
                             f"{self.name!r} needs ({self.io_bytes})")
        if job.bindings is None:
            raise RuntimeError(f"model {self.name!r}: the job holds no buffer set (the adaptor "
                               f"has no buffer_pool after init; internal error, please report)")
        bound = job.bindings.bound
        wl = job.waitlist
        streams = {0: wl.default}
        for s in self.streams:
            streams[s] = wl.create_stream()
        if self.n_events:
            self._issue_with_events(job, streams, bound, io)
            return
        ops = []
        for i, step in enumerate(self.steps):
            vs = streams[step.stream]
            if step.kind == KERNEL:
                ops.append(Op(KERNEL, job, vs, step.launch, bound[i], None, 0,
                              step.almost_finished))
            else:
                ops.append(Op(step.kind, job, vs, None, (), io[step.io_start:step.io_end],
                              bound[i], step.almost_finished))
        job.issue_all(ops)

    def _issue_with_events(self, job: "Job", streams: dict, bound: list, io) -> None:
        """:meth:`issue` for a plan with record / wait steps: the runs of device ops
        between them go through ``issue_all`` as usual, each event step through the
        waitlist, in plan order (a wait captures the most recent record as of the call)."""
        wl = job.waitlist
        events = [Event() for _ in range(self.n_events)]
        ops: list = []
        for i, step in enumerate(self.steps):
            vs = streams[step.stream]
            kind = step.kind
            if kind == KERNEL:
                ops.append(Op(KERNEL, job, vs, step.launch, bound[i], None, 0,
                              step.almost_finished))
            elif kind >= 0:
                ops.append(Op(kind, job, vs, None, (), io[step.io_start:step.io_end],
                              bound[i], step.almost_finished))
            else:
                if ops:
                    job.issue_all(ops)
                    ops = []
                if kind == RECORD:
                    events[step.event].marker = wl.record(vs)
                else:
                    wl.wait_event(vs, events[step.event])
        if ops:
            job.issue_all(ops)
