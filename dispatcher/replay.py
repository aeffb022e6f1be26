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

**Compiled replay** (the default; ``compiled=False`` keeps the reference path above).
The dependencies of a plan are the same for every request: every step is issued at job
start, before anything can complete. So at registration the plan is issued once through
the reference :class:`~paella.dispatcher.waitlist.Waitlist` on placeholder nodes, and what
it leaves (per node: stream successor, dependents, unmet dependencies, MARKERs already
done, the ops active, in order) becomes a :class:`~paella.dispatcher._replay.PlanGraph`
(``dispatcher/_replay.c``). A request then gets a :class:`~paella.dispatcher._replay.PlanRun`
as its job's waitlist: a copy of the counters, walked in C at every completion (the
reference's sweep, same order, MARKERs and events included), with no waitlist node made
or linked in Python and no Python call per dependency met. The ops are still one
:class:`~paella.dispatcher.ops.Op` per device step (the policy, the tracker and the
instruments see the same records); ``tests/dispatcher/test_compiled_replay.py`` compares
the two paths op by op on single- and multi-stream plans.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from paella.dispatcher.devices.base import D2H, H2D, KERNEL, Function

#: Step kinds of a plan's event steps (no device op: waitlist MARKERs).
RECORD, WAIT = -1, -2

from .native import load
from .ops import KernelLaunch, Op
from .waitlist import Event, Node, VStream, Waitlist

_replay = load("_replay")

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

    __slots__ = ("name", "io_bytes", "steps", "streams", "refusal", "n_events", "compiled",
                 "graph", "graph_lists", "_nodes", "_preds")

    def __init__(self, plan: "Plan", funcs: dict[str, Function],
                 kernel_launch: Callable[..., KernelLaunch], *, compiled: bool = True):
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
                    launch = (kernel_launch(funcs[op.kernel], op.grid, op.block, op.dyn_smem, op.whole)
                              if op.whole else
                              kernel_launch(funcs[op.kernel], op.grid, op.block, op.dyn_smem))
                except ValueError as e:          # too large for this dispatcher's notifQ
                    self.refusal = self.refusal or str(e)
                    launch = None
                steps.append(ReplayStep(KERNEL, op.stream, i == almost, launch))
            else:
                steps.append(ReplayStep(H2D if op.kind == "h2d" else D2H, op.stream, i == almost,
                                        None, op.io_offset, op.io_offset + op.nbytes))
        self.steps = tuple(steps)
        self.n_events = len(events)
        self.compiled = compiled
        self.graph_lists: dict | None = None
        if compiled:
            self._compile()

    # -- the compiled path -------------------------------------------------------------------
    def _compile(self) -> None:
        """Issue the plan once through the reference waitlist, on placeholder nodes, and
        keep what it leaves as a PlanGraph (module docstring). ``_nodes``: per step, its
        node (-1 for a record / wait step, whose MARKER, if any, lives in the graph only);
        ``_preds``: (node, its stream predecessor's node) for ops whose predecessor is an
        op (the lookahead reads ``op.pred``)."""
        issued: list[Node] = []

        class Recording(Waitlist):
            def issue(self, op: Node, wait_on: Node | None = None) -> Node:
                issued.append(op)
                return super().issue(op, wait_on)

        active: list[Node] = []
        wl = Recording(active.append)
        streams = {0: wl.default}
        for s in self.streams:
            streams[s] = wl.create_stream()
        events = [Event() for _ in range(self.n_events)]
        nodes = []
        for step in self.steps:
            vs = streams[step.stream]
            if step.kind >= 0:
                nodes.append(len(issued))
                wl.issue(Node(step.kind, vs))
            else:
                nodes.append(-1)
                if step.kind == RECORD:
                    events[step.event].marker = wl.record(vs)
                else:
                    wl.wait_event(vs, events[step.event])
        index = {id(n): i for i, n in enumerate(issued)}
        succ = [index[id(n.succ)] if n.succ is not None else -1 for n in issued]
        #: The graph's lists, as the kernel core takes them (kernel_core.plan_spec).
        self.graph_lists = lists = dict(
            kinds=[n.kind for n in issued], succ=succ,
            dependents=[[index[id(d)] for d in n.dependents or ()] for n in issued],
            deps=[n.deps for n in issued], pp=[int(n.pred_pending) for n in issued],
            st=[n.state for n in issued], ready=[index[id(n)] for n in active])
        self.graph = _replay.PlanGraph(
            kinds=lists["kinds"], succ=succ, dependents=lists["dependents"],
            deps=lists["deps"], pred_pending=lists["pp"], states=lists["st"],
            ready=lists["ready"])
        self._nodes = tuple(nodes)
        device = {i for i in nodes if i >= 0}
        self._preds = tuple((s, i) for i, s in enumerate(succ) if i in device and s in device)

    def _issue_compiled(self, job: "Job", bound: list, io) -> None:
        """One Op per device step, a PlanRun as the job's waitlist, its active ops
        reported; no waitlist node made or linked in Python."""
        job._check_running()
        host = job.host
        now = host.now
        vstreams = {0: VStream(0, True)}
        for s in self.streams:
            vstreams[s] = VStream(len(vstreams), True)
        ops: list = [None] * self.graph.nodes()
        for i, step in enumerate(self.steps):
            node = self._nodes[i]
            if node < 0:
                continue
            if step.kind == KERNEL:
                op = Op(KERNEL, job, vstreams[step.stream], step.launch, bound[i], None, 0,
                        step.almost_finished, now)
            else:
                op = Op(step.kind, job, vstreams[step.stream], None, (),
                        io[step.io_start:step.io_end], bound[i], step.almost_finished, now)
            op.step = node
            ops[node] = op
        if host.lookahead > 1:                   # only the lookahead reads op.pred
            for node, pred in self._preds:
                ops[node].pred = ops[pred]
        run = _replay.PlanRun(self.graph, tuple(ops), host.op_active, job.waitlist.eager)
        job.waitlist = run
        run.start()
        if "op_issued" in host.instruments:     # as the reference: after the whole issue
            for op in ops:
                if op is not None:
                    host.instruments.call("op_issued", op)

    def check(self, job: "Job") -> None:
        """Can ``job`` run this plan? Raises (failing the job) when the io buffer is too
        small, the job holds no buffer set, or the plan was refused here."""
        io = job.io
        if self.refusal is not None:
            raise ValueError(self.refusal)
        if io.size < self.io_bytes:
            raise ValueError(f"io buffer of {io.size} bytes is smaller than model "
                             f"{self.name!r} needs ({self.io_bytes})")
        if job.bindings is None:
            raise RuntimeError(f"model {self.name!r}: the job holds no buffer set (the adaptor "
                               f"has no buffer_pool after init; internal error, please report)")

    def issue(self, job: "Job") -> None:
        """Issue the whole plan for ``job``; raises (failing the job) when the io buffer is
        too small, the job holds no buffer set, or the plan was refused here."""
        self.check(job)
        io = job.io
        bound = job.bindings.bound
        if self.compiled:
            self._issue_compiled(job, bound, io)
            return
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
