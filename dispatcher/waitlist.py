"""Per-job waitlists: CUDA stream semantics on the dispatcher's timeline (§4.2, Figure 7).

A job's CUDA calls become ops (:class:`paella.dispatcher.ops.Op`), each a :class:`Node`
of its waitlist: what the waitlist needs of an op, and nothing else (what to launch and
what the dispatcher records about the release live in the ``Op`` subclass). Each node
counts its unmet dependencies;
it is *active* (schedulable) when the count reaches zero. Dependencies are computed once,
when the op is issued, following the CUDA programming guide's stream semantics:

* **stream order:** an op depends on the previous op of its stream, so only the first
  incomplete op of a stream is active;
* **legacy default stream** (stream 0): an op on it depends on the last op of every
  *blocking* stream of the job, and an op on a blocking stream depends on the last op
  of the default stream. Non-blocking streams (``cudaStreamNonBlocking``) skip both;
* **events:** ``event_record`` issues a zero-cost MARKER op on the stream, so the event
  completes when everything before it in the stream (and, on stream 0, in the blocking
  streams) has completed; ``stream_wait_event`` issues a MARKER on the waiting stream
  that also depends on the event's marker as of the call (CUDA captures the most recent
  record; waiting on a never-recorded event is a no-op).

Because ops of one stream complete in order, depending on a stream's *last* op covers
everything issued to it before, so each issue costs O(#blocking streams) at most.

*Eager* release (``eager=True``, the job-granularity baselines): an op's dependency on
its stream predecessor is met once the predecessor is *released* to a real stream,
because the dispatcher then places the op on the same real stream, whose FIFO order
enforces the rest. Cross-stream dependencies and MARKERs always wait for completion.
"""
from __future__ import annotations

from typing import Callable

from paella.dispatcher.devices.base import KIND_NAMES, MARKER

# Node states.
WAITING, READY, RELEASED, DONE, DROPPED = range(5)
STATE_NAMES = ("waiting", "ready", "released", "done", "dropped")


class Node:
    """An operation as the waitlist sees it: its kind (MARKERs complete on the spot), its
    stream, and its dependency links. Event records and waits are plain nodes; the ops a
    job issues to the GPU are :class:`~paella.dispatcher.ops.Op` s."""
    __slots__ = ("kind", "vstream", "deps", "pred", "pred_pending", "succ", "dependents",
                 "state")

    def __init__(self, kind: int, vstream: "VStream"):
        self.kind = kind
        self.vstream = vstream
        self.deps = 0
        self.pred: Node | None = None
        self.pred_pending = False
        self.succ: Node | None = None
        self.dependents: list[Node] | None = None
        self.state = WAITING

    def forget(self) -> None:
        """Drop what a node that will never run still refers to (its predecessor)."""
        self.pred = None

    def __repr__(self) -> str:
        return f"<{KIND_NAMES[self.kind]} v{self.vstream.vid} {STATE_NAMES[self.state]}>"


class VStream:
    """A virtual stream of one job; mapped to a real stream only at release time."""
    __slots__ = ("vid", "blocking", "last", "real", "destroyed", "ahead", "tail")

    def __init__(self, vid: int, blocking: bool):
        self.vid = vid
        self.blocking = blocking
        self.last: Node | None = None   # last op issued (None or finished: the stream is idle)
        self.real = -1                   # sticky real stream (policies that bind streams)
        self.destroyed = False
        # Lookahead (the dispatcher's): kernels released and not completed, the last one.
        self.ahead = 0
        self.tail: Node | None = None

    def idle(self) -> bool:
        last = self.last
        return last is None or last.state >= DONE


class Event:
    """A CUDA event: the MARKER node of its most recent record, or None if never recorded."""
    __slots__ = ("marker",)

    def __init__(self) -> None:
        self.marker: Node | None = None

    def done(self) -> bool:
        m = self.marker
        return m is None or m.state >= DONE


class Waitlist:
    """The ops of one job, with their dependencies; reports ops that become active.

    ``on_active(op)`` is called for every op whose dependencies are all met, except
    MARKERs, which complete on the spot.
    """

    def __init__(self, on_active: Callable[[Node], None]):
        self.on_active = on_active
        self.default = VStream(0, blocking=True)
        self.streams: list[VStream] = [self.default]
        self.blocking: list[VStream] = []     # created blocking streams (not the default)
        self.pending = 0                       # issued and not finished
        self.eager = False

    # -- streams ------------------------------------------------------------------------
    def create_stream(self, non_blocking: bool = False) -> VStream:
        vs = VStream(len(self.streams), blocking=not non_blocking)
        self.streams.append(vs)
        if vs.blocking:
            self.blocking.append(vs)
        return vs

    def destroy_stream(self, vs: VStream) -> None:
        """cudaStreamDestroy: pending work still completes; the handle becomes invalid."""
        self.check_stream(vs)
        if vs is self.default:
            raise ValueError("the default stream (0) cannot be destroyed")
        vs.destroyed = True
        if vs.blocking and vs.idle():
            self.blocking.remove(vs)

    def check_stream(self, vs: VStream) -> None:
        if not isinstance(vs, VStream) or vs.vid >= len(self.streams) or self.streams[vs.vid] is not vs:
            raise ValueError(f"{vs!r} is not a stream of this job; create it with stream_create()")
        if vs.destroyed:
            raise ValueError(f"stream {vs.vid} was destroyed; create a new one with stream_create()")

    # -- issue ----------------------------------------------------------------------------
    def issue(self, op: Node, wait_on: Node | None = None) -> Node:
        """Add ``op`` behind its stream's work (and ``wait_on``, for stream-wait-event)."""
        vs = op.vstream
        last = vs.last
        if last is not None and last.state < DONE:
            op.pred = last
            op.pred_pending = not (self.eager and last.state == RELEASED and op.kind != MARKER)
            if op.pred_pending:
                op.deps += 1
            last.succ = op
        if vs is self.default:
            for b in self.blocking:
                self._depend(op, b.last)
        elif vs.blocking:
            self._depend(op, self.default.last)
        if wait_on is not None:
            self._depend(op, wait_on)
        vs.last = op
        self.pending += 1
        if op.deps == 0:
            self._activate(op)
        return op

    def issue_all(self, ops: list[Node]) -> None:
        """:meth:`issue` each of ``ops`` in order. Speed: a run of ops on one stream that
        has no cross-stream rule to apply (the default stream with no blocking stream, or
        a non-blocking stream) is linked op to op directly, which is what :meth:`issue`
        computes for it (each op depends on the one before it only), without a call per
        op; anything else goes through :meth:`issue`."""
        i, n = 0, len(ops)
        while i < n:
            op = self.issue(ops[i])
            vs = op.vstream
            i += 1
            if op.kind == MARKER or not (vs is self.default and not self.blocking
                                         or not vs.blocking):
                continue
            prev = op
            linked = 0
            while i < n:
                op = ops[i]
                if op.vstream is not vs or op.kind == MARKER:
                    break
                op.pred = prev
                op.pred_pending = True
                op.deps = 1
                prev.succ = op
                prev = op
                linked += 1
                i += 1
            vs.last = prev
            self.pending += linked

    def record(self, vs: VStream) -> Node:
        """cudaEventRecord's operation: a MARKER on ``vs``, complete once everything before
        it (on stream 0, in the blocking streams too) has completed."""
        return self.issue(Node(MARKER, vs))

    def wait_event(self, vs: VStream, event: Event) -> None:
        """cudaStreamWaitEvent: later work on ``vs`` waits for ``event``'s most recent
        record as of this call. Nothing to wait for (never recorded, or completed) adds no
        dependency, but on the legacy default stream the call still issues its MARKER: it
        is an operation of that stream, ordered after every blocking stream's work so far,
        and work issued to blocking streams afterwards waits for it."""
        m = event.marker
        pending = m is not None and m.state < DONE
        if pending or vs is self.default:
            self.issue(Node(MARKER, vs), wait_on=m if pending else None)

    @staticmethod
    def _depend(op: Node, on: Node | None) -> None:
        if on is None or on.state >= DONE or on is op.pred:
            return
        op.deps += 1
        if on.dependents is None:
            on.dependents = [op]
        else:
            on.dependents.append(op)

    def _activate(self, op: Node) -> None:
        if op.kind == MARKER:
            self.finish(op)
        else:
            op.state = READY
            self.on_active(op)

    # -- progress -------------------------------------------------------------------------
    def released(self, op: Node) -> None:
        """``op`` went to a real stream; in eager mode its stream successor may go too."""
        op.state = RELEASED
        succ = op.succ
        if self.eager and succ is not None and succ.pred_pending and succ.kind != MARKER:
            succ.pred_pending = False
            succ.deps -= 1
            if succ.deps == 0 and succ.state == WAITING:
                self._activate(succ)

    def release_ahead(self, op: Node) -> None:
        """Lookahead (the dispatcher's ``lookahead``): ``op``, a released kernel or copy,
        lets its stream successor go now if that is a kernel or a copy: the dispatcher
        puts it on ``op``'s real stream, behind ``op`` in the hardware FIFO, which keeps
        the stream's order; its other dependencies still wait for completion. A MARKER
        waits for ``op`` to complete, as always."""
        succ = op.succ
        if succ is not None and succ.pred_pending and succ.kind != MARKER:
            succ.pred_pending = False
            succ.deps -= 1
            if succ.deps == 0 and succ.state == WAITING:
                self._activate(succ)

    def _done(self, op: Node) -> None:
        """Mark ``op`` done. A finished op keeps no link back (``pred``, its stream's
        ``last``, both read only while unfinished: None and a finished op mean the same),
        so finished ops and jobs form no reference cycle and are freed at once, not by the
        cyclic gc (whose collections of every finished job cost ~1 us per kernel)."""
        op.state = DONE
        self.pending -= 1
        op.pred = None
        vs = op.vstream
        if vs.last is op:
            vs.last = None

    def finish(self, op: Node) -> None:
        """``op`` completed: meet the dependencies of the ops behind it."""
        vs = op.vstream
        succ = op.succ
        if op.dependents is None and not vs.destroyed and (
                succ is None or succ.kind != MARKER):
            # Speed: the common case (a straight-line stream: at most a non-MARKER
            # successor, no cross-stream dependents) without the sweep below, and
            # _done inlined.
            op.state = DONE
            self.pending -= 1
            op.pred = None
            if vs.last is op:
                vs.last = None
            if succ is not None and succ.pred_pending:
                succ.pred_pending = False
                succ.deps -= 1
                if succ.deps == 0 and succ.state == WAITING:
                    succ.state = READY
                    self.on_active(succ)
            return
        self._done(op)
        # An explicit stack, not recursion: chains of MARKERs finish in one sweep.
        stack = [op]
        while stack:
            done = stack.pop()
            succ = done.succ
            if succ is not None and succ.pred_pending:
                succ.pred_pending = False
                succ.deps -= 1
                if succ.deps == 0 and succ.state == WAITING:
                    self._activate_into(succ, stack)
            if done.dependents:
                for d in done.dependents:
                    d.deps -= 1
                    if d.deps == 0 and d.state == WAITING:
                        self._activate_into(d, stack)
            vs = done.vstream
            if vs.destroyed and vs.blocking and vs.idle() and vs in self.blocking:
                self.blocking.remove(vs)

    def _activate_into(self, op: Node, stack: list[Node]) -> None:
        if op.kind == MARKER:
            self._done(op)
            stack.append(op)
        else:
            op.state = READY
            self.on_active(op)

    def drop_unreleased(self) -> list[Node]:
        """Abort: every op not yet released is dropped (a failed or cancelled job).
        Returns the dropped ops that were READY, so the caller can unqueue them."""
        was_ready = []
        for op in self._unfinished():
            if op.state in (WAITING, READY):
                if op.state == READY:
                    was_ready.append(op)
                op.state = DROPPED
                self.pending -= 1
                # It will never run: let go of its operands (a copy's host view) and its
                # predecessor (which may be a finished copy, with its own), as a finished
                # op does. A job's ops may outlive it; a client's memory must not.
                op.forget()
        return was_ready

    def _unfinished(self) -> list[Node]:
        """Every op not finished, found by walking each stream back from its last op."""
        seen: list[Node] = []
        for vs in self.streams:
            op = vs.last
            while op is not None and op.state < DONE:
                seen.append(op)
                op = op.pred
        return seen
