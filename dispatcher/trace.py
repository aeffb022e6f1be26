"""Kernel-level traces in the Trace Event format, for Perfetto and ``chrome://tracing``.

:class:`TraceRecorder` is an :class:`~paella.dispatcher.instruments.Instrument`. While it is
installed, every hook it listens to appends one small tuple to a list, on the
dispatcher's loop; nothing else happens there. :meth:`TraceRecorder.events` (or
:func:`write_trace`) turns the tuples into Trace Event records afterwards, in the
caller's thread: the daemon does it on a thread of its own, off the loop. Not installed,
it costs what any instrument costs when nobody listens: nothing (one dict lookup per
hook site).

What a trace shows (docs/service.md, "Traces"):

* process "requests": a slice per request, from its admission to its answer, named by
  model and request id, with its client, priority class and batch (the job that ran it:
  its sequence number and how many requests it held). Requests overlap, so each goes on
  the first "lane" free at its admission;
* process "GPU": a track per stream with a slice per kernel, from its first block seen
  placed to its last block seen completed; a track per stream of copies (a copy's start
  on the kernel core is its release: the core sees no copy start); a counter of the
  blocks and warps resident on the SMs;
* flow arrows from each request to the kernels of its job;
* process "policy": an instant per decision the dispatcher makes visible: ``pick``
  (a kernel released, with the job the policy chose), ``slice`` (the kernel released is
  a slice of a longer one: its blocks and the kernel's, paella.dispatcher.slicing) and
  ``hold`` (the policy released nothing although jobs had a ready kernel: how many; at
  the first such pick after a release) and ``fallback`` (a failing plug-in policy
  replaced by fifo, with the reason).

Bounded: at ``max_events`` records the recorder stops recording and the trace ends with
an instant saying so (``otherData.truncated`` in the file).
"""
from __future__ import annotations

import heapq
import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterator

from .devices.base import KERNEL, KIND_NAMES
from .instruments import Instrument

#: Records kept by default (about 150 bytes of JSON each).
DEFAULT_MAX_EVENTS = 400_000
#: Bytes of JSON per record, roughly: how a byte budget becomes a record budget.
BYTES_PER_EVENT = 160

_REQ, _REL, _START, _END, _FALLBACK, _STOPPED, _SLICE, _HOLD = range(8)
_PID_REQUESTS, _PID_GPU, _PID_POLICY = 1, 2, 3
_COPY_TRACKS = 1000                 # tid of stream s's copies: _COPY_TRACKS + s


@dataclass
class TraceSummary:
    """What a written trace holds."""
    events: int
    requests: int
    kernels: int
    truncated: bool


class TraceRecorder(Instrument):
    """Records what a :class:`~paella.dispatcher.core.Dispatcher` does, for a trace.

    ``dispatcher``: the one it is installed on (read for model names, the tracker's
    occupancy and the policy's fallbacks). Install with ``dispatcher.instruments.add``;
    :meth:`stop` removes it. Hooks run on the loop: each appends one tuple."""

    def __init__(self, dispatcher: Any, max_events: int = DEFAULT_MAX_EVENTS,
                 request_model: Callable[[int], str | None] | None = None):
        if type(max_events) is not int or max_events < 16:
            raise ValueError(f"max_events must be an int >= 16, got {max_events!r}")
        self.dispatcher = dispatcher
        self.max_events = max_events
        self.records: list[tuple] = []
        self.truncated = False
        self.stopped = False
        self._fallbacks = dispatcher.policy_fallbacks
        self._names: dict[int, str] = {}
        #: A request's model id -> its name, where the request's ids are not the
        #: dispatcher's (the daemon's front end numbers its models itself): names a
        #: request whose job's ops the trace never saw (released before it started).
        self._request_model = request_model
        #: (client, request id) -> its job's model name, from its ops (a request's own
        #: model id may be the front end's, not the dispatcher's).
        self._model_of: dict[tuple[int, int], str] = {}
        #: job seq -> (model, requests, class): taken at its first op.
        self._jobs: dict[int, tuple[str, tuple, int]] = {}

    # -- control ------------------------------------------------------------------------
    def start(self) -> "TraceRecorder":
        """Install on the dispatcher."""
        self.dispatcher.instruments.add(self)
        return self

    def stop(self) -> None:
        """Remove from the dispatcher (idempotent)."""
        if not self.stopped:
            self.stopped = True
            try:
                self.dispatcher.instruments.remove(self)
            except KeyError:
                pass

    def _full(self) -> bool:
        """At the limit (the caller checked the length): stop, noting it once."""
        if not self.truncated:
            self.truncated = True
            self.records.append((_STOPPED, self.dispatcher.now, len(self.records)))
            self.stop()
        return True

    def _model(self, model_id: int) -> str:
        name = self._names.get(model_id)
        if name is None:
            if self._request_model is not None:
                name = self._request_model(model_id)
            else:
                m = self.dispatcher.models.get(model_id)
                name = m.name if m is not None else None
            name = self._names[model_id] = name if name is not None else f"model {model_id}"
        return name

    # -- hooks (on the loop: one tuple each) ---------------------------------------------
    # Speed (labelled): what a job's ops share (its model, requests, class) is taken once
    # per job, at its first op; each op adds one tuple of scalars.
    def request_finished(self, req: Any) -> None:
        if len(self.records) >= self.max_events and self._full():
            return
        model = self._model_of.pop((req.client_id, req.req_id), None)
        self.records.append((_REQ, req.req_id, req.client_id,
                             model if model is not None else self._model(req.model_id),
                             req.priority, req.t_submit, req.t_done, req.status))

    def op_released(self, op: Any, t: float) -> None:
        if len(self.records) >= self.max_events and self._full():
            return
        job = op.job
        seq = job.seq
        if seq not in self._jobs:
            reqs = tuple((r.client_id, r.req_id) for r in job.requests)
            name = job.model.name
            for q in reqs:
                self._model_of[q] = name
            self._jobs[seq] = (name, reqs, min(r.priority for r in job.requests))
        self.records.append((_REL, id(op), seq, op.kind, op.key, op.stream, t))
        launch = op.launch
        if launch is not None and launch.whole:
            self.records.append((_SLICE, t, seq, op.key, launch.blocks, launch.whole, op.stream))
        d = self.dispatcher
        if d.policy_fallbacks != self._fallbacks:
            self._fallbacks = d.policy_fallbacks
            self.records.append((_FALLBACK, t, str(getattr(d, "policy_failure", "") or "")))

    def policy_held(self, queued: int, t: float) -> None:
        if len(self.records) < self.max_events or not self._full():
            self.records.append((_HOLD, t, queued))

    def op_started(self, op: Any, t: float) -> None:
        if len(self.records) < self.max_events or not self._full():
            self.records.append((_START, id(op), t))

    def op_ended(self, op: Any, t: float) -> None:
        if len(self.records) >= self.max_events and self._full():
            return
        tr = self.dispatcher.tracker
        self.records.append((_END, id(op), t, tr.blocks, tr.warps))

    # -- the trace (off the loop) --------------------------------------------------------
    def events(self) -> list[dict]:
        """The Trace Event records (``traceEvents``) of what was recorded."""
        return _to_events(list(self.records), dict(self._jobs))

    def summary(self, events: list[dict] | None = None) -> TraceSummary:
        events = self.events() if events is None else events
        return TraceSummary(len(events), sum(1 for e in events if e.get("cat") == "request"),
                            sum(1 for e in events if e.get("cat") == "kernel"), self.truncated)


def _kind_name(kind: int) -> str:
    return KIND_NAMES[kind] if 0 <= kind < len(KIND_NAMES) else f"op kind {kind}"


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def _to_events(records: list[tuple], jobs: dict[int, tuple[str, tuple, int]]) -> list[dict]:
    out: list[dict] = _metadata()
    ops: dict[int, dict] = {}
    jobs_of_request: dict[tuple[int, int], int] = {}    # (client, request id) -> job
    kernels_of_job: dict[int, list[tuple[float, int]]] = {}    # seq -> (start, stream)
    for r in records:
        kind = r[0]
        if kind == _REL:
            _, key, seq, okind, name, stream, t = r
            model, reqs, prio = jobs[seq]
            ops[key] = {"seq": seq, "model": model, "reqs": reqs, "prio": prio,
                        "kind": okind, "name": name, "stream": stream, "rel": t}
            for q in reqs:
                jobs_of_request.setdefault(q, seq)
            out.append({"ph": "i", "s": "t", "name": "pick", "cat": "policy",
                        "pid": _PID_POLICY, "tid": 0, "ts": _us(t),
                        "args": {"model": model, "job": seq, "requests": [list(q) for q in reqs],
                                 "class": prio, "op": name or _kind_name(okind),
                                 "stream": stream}})
        elif kind == _START:
            op = ops.get(r[1])
            if op is not None:
                op.setdefault("start", r[2])
        elif kind == _END:
            op = ops.pop(r[1], None)
            if op is None:
                continue
            start = op.get("start", op["rel"])
            start = min(max(start, op["rel"]), r[2])
            is_kernel = op["kind"] == KERNEL
            out.append({"ph": "X", "cat": "kernel" if is_kernel else "copy",
                        "name": op["name"] if is_kernel else _kind_name(op["kind"]),
                        "pid": _PID_GPU,
                        "tid": op["stream"] if is_kernel else _COPY_TRACKS + op["stream"],
                        "ts": _us(start), "dur": _us(r[2]) - _us(start),
                        "args": {"model": op["model"], "job": op["seq"],
                                 "requests": [list(q) for q in op["reqs"]],
                                 "class": op["prio"],
                                 "batch": len(op["reqs"]), "released_us": _us(op["rel"])}})
            if is_kernel:
                kernels_of_job.setdefault(op["seq"], []).append((start, op["stream"]))
            out.append({"ph": "C", "name": "SM residency", "pid": _PID_GPU, "tid": 0,
                        "ts": _us(r[2]), "args": {"blocks": r[3], "warps": r[4]}})
        elif kind == _SLICE:
            _, t, seq, name, blocks, whole, stream = r
            out.append({"ph": "i", "s": "t", "name": "slice", "cat": "policy",
                        "pid": _PID_POLICY, "tid": 0, "ts": _us(t),
                        "args": {"model": jobs[seq][0], "job": seq, "kernel": name,
                                 "blocks": blocks, "of": whole, "stream": stream}})
        elif kind == _HOLD:
            out.append({"ph": "i", "s": "t", "name": "hold", "cat": "policy",
                        "pid": _PID_POLICY, "tid": 0, "ts": _us(r[1]),
                        "args": {"queued": r[2]}})
        elif kind == _FALLBACK:
            out.append({"ph": "i", "s": "p", "name": "fallback", "cat": "policy",
                        "pid": _PID_POLICY, "tid": 0, "ts": _us(r[1]),
                        "args": {"reason": r[2]}})
        elif kind == _STOPPED:
            out.append({"ph": "i", "s": "g", "name": f"trace stopped: its limit of {r[2]} "
                        f"records was reached (raise trace_max_bytes)", "pid": _PID_POLICY,
                        "tid": 0, "ts": _us(r[1])})
    out.extend(_request_slices([r for r in records if r[0] == _REQ], jobs_of_request,
                               kernels_of_job))
    return out


def _request_slices(reqs: list[tuple], job_of: dict[tuple[int, int], int],
                    kernels_of_job: dict[int, list[tuple[float, int]]]) -> list[dict]:
    """A slice per request on the first lane free at its admission, and a flow arrow
    from it to each kernel of its job (both ends at the kernel's start)."""
    out: list[dict] = []
    flow = 0
    lanes: list[tuple[float, int]] = []      # (free from, lane): a heap
    n_lanes = 0
    for _, rid, client, model, prio, t0, t1, status in sorted(reqs, key=lambda r: (r[5], r[1])):
        if not (t0 == t0 and t1 == t1):      # NaN: never submitted or never answered
            continue
        if lanes and lanes[0][0] <= t0:
            _, lane = heapq.heappop(lanes)
        else:
            lane, n_lanes = n_lanes, n_lanes + 1
        heapq.heappush(lanes, (t1, lane))
        seq = job_of.get((client, rid))
        out.append({"ph": "X", "cat": "request", "name": f"{model} #{rid}",
                    "pid": _PID_REQUESTS, "tid": lane, "ts": _us(t0), "dur": _us(t1) - _us(t0),
                    "args": {"request": rid, "model": model, "client": client,
                             "class": prio, "job": seq, "status": status}})
        for start, stream in kernels_of_job.get(seq, ()) if seq is not None else ():
            if not t0 <= start <= t1:
                continue
            flow += 1
            out.append({"ph": "s", "cat": "flow", "name": "kernel", "id": flow,
                        "pid": _PID_REQUESTS, "tid": lane, "ts": _us(start)})
            out.append({"ph": "f", "bp": "e", "cat": "flow", "name": "kernel", "id": flow,
                        "pid": _PID_GPU, "tid": stream, "ts": _us(start)})
    for lane in range(n_lanes):
        out.append({"ph": "M", "name": "thread_name", "pid": _PID_REQUESTS, "tid": lane,
                    "args": {"name": f"lane {lane}"}})
    return out


def _metadata() -> list[dict]:
    return [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
            for pid, name in ((_PID_REQUESTS, "requests"), (_PID_GPU, "GPU"),
                              (_PID_POLICY, "policy"))]


def _named_tracks(events: list[dict]) -> list[dict]:
    """``events`` with the GPU's tracks named (stream N, stream N copies)."""
    names = {}
    for e in events:
        if e.get("pid") == _PID_GPU and e["ph"] == "X":
            tid = e["tid"]
            names[tid] = (f"stream {tid}" if tid < _COPY_TRACKS
                          else f"stream {tid - _COPY_TRACKS} copies")
    return events + [{"ph": "M", "name": "thread_name", "pid": _PID_GPU, "tid": tid,
                      "args": {"name": name}} for tid, name in sorted(names.items())]


def write_trace(f: IO[str], recorder: TraceRecorder, **other: Any) -> TraceSummary:
    """Write ``recorder``'s trace as a Trace Event JSON object to ``f`` (text); ``other``
    goes into ``otherData``. Off the loop: it reads only the recorder's records."""
    return write_traces(f, [("", recorder)], **other)


def write_traces(f: IO[str], runs: list[tuple[str, TraceRecorder]],
                 **other: Any) -> TraceSummary:
    """Several dispatchers' traces in one file (an experiment's runs): run k's processes
    get pids 10k+1..10k+3, named after its label (``label``: requests, ...)."""
    events: list[dict] = []
    total = TraceSummary(0, 0, 0, False)
    for k, (label, rec) in enumerate(runs):
        evs = _named_tracks(rec.events())
        s = rec.summary(evs)
        total = TraceSummary(total.events + s.events, total.requests + s.requests,
                             total.kernels + s.kernels, total.truncated or s.truncated)
        for e in evs:
            e["pid"] += 10 * k
            if label and e["ph"] == "M" and e["name"] == "process_name":
                e["args"] = {"name": f"{label}: {e['args']['name']}"}
        events += evs
    json.dump({"traceEvents": events, "displayTimeUnit": "ns",
               "otherData": {"truncated": total.truncated, "requests": total.requests,
                             "kernels": total.kernels, "runs": len(runs), **other}}, f,
              default=_plain)
    return total


@contextmanager
def trace_every_dispatcher(path: str, runs: int = 2, source: str = "",
                           max_events: int = DEFAULT_MAX_EVENTS) -> Iterator[list]:
    """Trace the first ``runs`` dispatchers made in this process while the ``with`` block
    runs (an experiment, a benchmark) and write their traces into ``path`` at its end,
    whatever way it ends. Yields the list of (label, recorder) it fills."""
    from .instruments import instrument_every_dispatcher
    traced: list[tuple[str, TraceRecorder]] = []

    def make(d: Any) -> TraceRecorder | None:
        if len(traced) >= runs:
            return None
        rec = TraceRecorder(d, max_events)
        traced.append((f"run {len(traced) + 1} ({getattr(d.policy, 'name', '?')} on "
                       f"{d.device.props.name})", rec))
        return rec
    try:
        with instrument_every_dispatcher(make):
            yield traced
    finally:
        for _, rec in traced:
            rec.stop()
        with open(path, "w") as f:
            write_traces(f, traced, source=source)


def _plain(o: Any) -> Any:
    """JSON for what a caller's requests may carry: numpy scalars (a harness's client
    ids), anything else as its text."""
    item = getattr(o, "item", None)
    return item() if callable(item) else str(o)


__all__ = ["TraceRecorder", "TraceSummary", "write_trace", "write_traces",
           "trace_every_dispatcher", "DEFAULT_MAX_EVENTS",
           "BYTES_PER_EVENT"]
