"""The dispatcher: requests in, kernels out, one short loop (§4.2, §5, §6).

:meth:`Dispatcher.step` is one iteration of the loop; the daemon calls it forever,
the virtual-time harness between clock advances. Everything else here is bookkeeping
called from that loop: jobs (greenlets running adaptors), their waitlists, the
occupancy tracker, the policy, and the virtual-to-real stream map.

Contract with the daemon:

* ``register_model(name, adaptor) -> model_id`` (runs ``adaptor.init`` and profiling
  jobs that seed the SRPT estimate);
* ``submit(Request)``; the request's ``on_almost_finished(req)`` fires when the op
  its adaptor marked (before the last D2H copy, for plans) is released, or at the
  latest just before completion; ``on_complete(req, status, error)`` once, with
  ``STATUS_OK``, ``STATUS_ERROR`` (the adaptor raised: ``error`` says why) or
  ``STATUS_CANCELLED``;
* ``step() -> bool`` (True while anything is in flight), ``cancel_client(id)``,
  ``in_flight``. Completion is per request;
* ``abandon_all(reason)`` completes every request still in flight as cancelled at
  once, without waiting for the device: the daemon's last act before it exits.

A policy is plug-in code and may be wrong. A hook that raises, a ``pick()`` that
returns something other than a queued job of this dispatcher, or a ``pick()`` that
keeps returning None while jobs are ready and the device has nothing to do (for
``POLICY_STALL_SECONDS``) is logged, and the dispatcher goes on with ``fifo``.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import greenlet
import numpy as np

from paella import protocol
from paella.dispatcher.devices.base import Device, DeviceError, DeviceLost

from .adaptor import JobAdaptor, PlanAdaptor
from .job import FINISHED, Job, PlanTemplate
from .occupancy import Tracker
from .policies.base import Policy, PolicyError, get_policy
from .profile import ModelProfile
from .streams import StreamMap
from .waitlist import DONE, DROPPED, H2D, KERNEL, READY, RELEASED, Op

log = logging.getLogger(__name__)

STATUS_OK, STATUS_ERROR, STATUS_CANCELLED = 0, 1, 2
FALLBACK_POLICY = "fifo"
#: A policy whose pick() holds every ready job back this long while the device has
#: nothing in flight is stalled (real time; a virtual clock cannot advance meanwhile,
#: so there it counts as stalled at once). No useful policy idles the GPU for a second.
POLICY_STALL_SECONDS = 1.0


@dataclass(eq=False)
class Request:
    """One inference request. ``io`` is a uint8 view of the client's io region."""
    req_id: int
    client_id: int
    model_id: int
    io: np.ndarray
    options: Any = None
    on_almost_finished: Callable[["Request"], None] | None = None
    on_complete: Callable[["Request", int, "str | None"], None] | None = None
    # Filled in by the dispatcher (device clock, seconds).
    t_submit: float = float("nan")
    t_done: float = float("nan")
    status: int = -1
    error: str | None = None


@dataclass(eq=False)
class Model:
    model_id: int
    name: str
    adaptor: JobAdaptor
    profile: ModelProfile = field(default_factory=ModelProfile)
    # The built-in PlanAdaptor's plan, compiled once: its requests skip the greenlet.
    template: PlanTemplate | None = None
    # The adaptor's per-request buffer sets (adaptor.BufferPool), if it has any.
    pool: Any = None


class Dispatcher:
    def __init__(self, device: Device, policy: str | type[Policy] = "paella", *,
                 extra_blocks: int | None = None, fairness_threshold: float | None = None,
                 group: int = protocol.DEFAULT_GROUP,
                 counter_pairs: int = protocol.DEFAULT_COUNTER_PAIRS,
                 policy_options: dict[str, Any] | None = None, profile_runs: int = 2):
        self.device = device
        self.group = group
        self.profile_runs = profile_runs
        self.extra_blocks = device.props.sm_count if extra_blocks is None else extra_blocks
        self.tracker = Tracker(device.props, device.notifq, extra_blocks=self.extra_blocks,
                               group=group, counter_pairs=counter_pairs)
        opts = dict(policy_options or {})
        if fairness_threshold is not None:
            opts["fairness_threshold"] = fairness_threshold
        cls = get_policy(policy) if isinstance(policy, str) else policy
        self.policy: Policy = cls(self, **opts)
        self._bind_policy()
        self.streams = StreamMap(len(device.streams), self.policy.stream_mode)
        self.models: list[Model] = []
        self.jobs: set[Job] = set()
        self.in_flight = 0
        self.now = device.now()
        self.iterations = 0
        self.idle = True                     # the last step() changed nothing
        self._arrivals: deque[Job] = deque()
        self._resume: list[Job] = []
        self._copies: deque[Op] = deque()    # active copies, released ahead of kernels
        self._copy_events: dict[int, deque] = {}
        self._seq = 0
        self._progress = 0
        self._queued = 0                     # jobs announced to the policy (job.in_policy)
        self._held_since = 0.0               # when pick() began holding an idle device back
        self._held_iter = -2                 # ... the iteration that last saw it do so

    # ======================================================================================
    # The loop. One iteration: poll the device, learn what the GPU did, run the jobs that
    # can run, and release what the policy picks while the GPU can take it.
    # ======================================================================================
    def step(self) -> bool:
        dev = self.device
        dev.poll()
        self.now = now = dev.now()
        before = self._progress
        self._progress += self.tracker.drain(now, self._op_done)         # notifQ
        if self._copy_events:
            self._poll_copies()                                          # device events
        if self._arrivals:
            self._start_arrivals()                                       # new greenlets
        if self._resume:
            self._resume_jobs()                                          # synchronize() done
        if self._queued or self._copies:
            self._release()                                              # policy, +B
            if self._queued and not self._copy_events and not self.tracker.in_flight():
                self._held_back()            # rare: ready jobs, an idle device, pick() None
        self.idle = self._progress == before
        self.iterations += 1
        return self.in_flight > 0

    def _flush_copies(self) -> None:
        copies = self._copies
        streams = self.streams
        while copies and streams.available():
            op = copies.popleft()
            if op.state != DROPPED:
                self._launch_copy(op)

    def _release(self) -> None:
        if self._copies:
            self._flush_copies()
        if not self._queued:                 # nothing announced: pick() has nothing to give
            return
        policy = self.policy
        tracker = self.tracker
        admits = tracker.admits if policy.gated else tracker.flow_ok
        streams = self.streams
        pool = streams.mode == "pool"
        free, busy = streams.free, streams.busy
        launch, group, now = self.device.launch, self.group, self.now
        while self._queued:
            try:
                job = policy.pick()
            except Exception as e:
                self._policy_failed("pick", e)
                policy = self.policy
                admits = tracker.admits if policy.gated else tracker.flow_ok
                pool = streams.mode == "pool"
                continue
            if job is None:
                return
            if job.__class__ is not Job or job.d is not self or not job.in_policy:
                self._policy_failed("pick", PolicyError(
                    f"pick() returned {job!r}, which is not a job of this dispatcher with a "
                    f"ready kernel"))
                policy = self.policy
                admits = tracker.admits if policy.gated else tracker.flow_ok
                pool = streams.mode == "pool"
                continue
            ready = job.ready
            op = ready[0]
            if not admits(op) or (pool and not free):
                return
            ready.popleft()
            job.in_policy = False
            self._queued -= 1
            key = op.key
            kcount = job.kcount
            c = kcount.get(key, 0)
            job.remaining -= job.model.profile.charge(key, c)
            kcount[key] = c + 1
            try:
                policy.released(job, op)
            except Exception as e:
                self._policy_failed("released", e)
                policy = self.policy
                admits = tracker.admits if policy.gated else tracker.flow_ok
                pool = streams.mode == "pool"
            # Launch it (inlined: once per kernel).
            if pool:                         # inlined StreamMap.assign, the common case
                s = op.stream = free.popleft()
                busy[s] += 1
            else:
                s = streams.assign(op)
            lid = tracker.release(op)
            op.t_release = now
            self._progress += 1
            try:
                launch(op.func, op.grid, op.block, s, lid, dyn_smem=op.dyn_smem, args=op.args,
                       instrumented=True, group=group)
            except DeviceError as e:
                tracker.unrelease(op)
                self._device_refused(op, e)
            else:
                if op.almost_finished:
                    self._almost_finished(job)
                op.state = RELEASED
                if op.succ is not None and job.waitlist.eager:
                    job.waitlist.released(op)
            if self._copies:                 # copies it activated keep their stream order
                self._flush_copies()
            if ready and not job.in_policy:
                self._queue(job)

    # -- releasing ---------------------------------------------------------------------------
    def _launch_copy(self, op: Op) -> None:
        s = self.streams.assign(op)
        op.t_release = self.now
        self._progress += 1
        if op.almost_finished:
            self._almost_finished(op.job)
        dev = self.device
        try:
            if op.kind == H2D:
                dev.memcpy_htod(op.dptr, op.host, s)
            else:
                dev.memcpy_dtoh(op.host, op.dptr, s)
        except DeviceError as e:
            self._device_refused(op, e)
            return
        # Copies post no notifications: an event behind each, polled oldest first.
        q = self._copy_events.get(s)
        if q is None:
            q = self._copy_events[s] = deque()
        q.append((dev.record_event(s), op))
        op.job.waitlist.released(op)

    # -- completions -------------------------------------------------------------------------
    def _poll_copies(self) -> None:
        query = self.device.event_query
        for s in list(self._copy_events):
            q = self._copy_events[s]
            while q and query(q[0][0]):
                self._op_done(q.popleft()[1])
                self._progress += 1
            if not q:
                del self._copy_events[s]

    def _op_done(self, op: Op) -> None:
        """``op`` completed: its last notification (kernels) or its event (copies)."""
        job = op.job
        if op.kind == KERNEL:
            job.model.profile.record_kernel(op.key, self.now - op.t_first)
            if self._kernel_completed is not None:
                try:
                    self._kernel_completed(job, op)
                except Exception as e:
                    self._policy_failed("kernel_completed", e)
        streams = self.streams
        s = op.stream                        # inlined StreamMap.done
        busy = streams.busy
        busy[s] -= 1
        if not busy[s] and streams.mode == "pool":
            streams.free.append(s)
        plan = job.plan
        if plan is not None:                 # a lazily started straight line: make the next
            op.state = DONE                  # step, now that it is the active one
            i = job.cursor + 1
            if i < plan.n:
                job.cursor = i
                vs = job.waitlist.default
                nxt = vs.last = plan.make(job, i, vs, job.bindings.bound, job.req.io)
                nxt.state = READY
                self._on_active(nxt)
            else:
                job.plan = None
                job.waitlist.pending = 0
                job.waitlist.default.last = None     # (idle either way; no job -> op -> job cycle)
                self._finish(job)
            return
        wl = job.waitlist
        wl.finish(op)
        if job.blocked and job.wake_if_satisfied():
            job.blocked = False
            self._resume.append(job)
        elif job.returned and wl.pending == 0:
            self._finish(job)

    def _on_active(self, op: Op) -> None:
        """Waitlist callback: ``op`` has no unmet dependency left."""
        if op.kind == KERNEL:
            job = op.job
            job.ready.append(op)
            if not job.in_policy:
                job.in_policy = True         # inlined _queue
                self._queued += 1
                try:
                    self.policy.kernel_ready(job)
                except Exception as e:
                    self._policy_failed("kernel_ready", e)
        else:
            self._copies.append(op)

    def _queue(self, job: Job) -> None:
        job.in_policy = True
        self._queued += 1
        try:
            self.policy.kernel_ready(job)
        except Exception as e:
            self._policy_failed("kernel_ready", e)   # the fallback re-queues every job

    # -- jobs -----------------------------------------------------------------------------------
    def _start_arrivals(self) -> None:
        arrivals = self._arrivals
        while arrivals:
            job = arrivals.popleft()
            pool = job.model.pool
            if pool is not None and job.bindings is None:
                bindings = pool.acquire()
                if bindings is None:         # every buffer set in use: wait for one
                    pool.waiting.append(job)
                    continue
                job.bindings = bindings
            try:
                self.policy.job_arrived(job)
            except Exception as e:
                self._policy_failed("job_arrived", e)
            self._progress += 1
            template = job.model.template
            if template is None:
                job.start()                  # the adaptor's run(io) in a greenlet
            else:
                try:
                    if template.straight and not self.policy.eager:
                        first = template.start(job, job.req.io)
                        if first is not None:
                            self._on_active(first)
                    else:
                        template.instantiate(job, job.req.io)
                except Exception as e:       # as Job._main: fail this request only
                    job.error = f"{type(e).__name__}: {e}"
                    self._job_failed(job)
                job.returned = True
            self._after_run(job)

    def _resume_jobs(self) -> None:
        # A snapshot (Trio's rule): jobs woken while these run wait for the next pass.
        jobs, self._resume = self._resume, []
        for job in jobs:
            if job.state == FINISHED:
                continue
            self._progress += 1
            job.resume()
            self._after_run(job)

    def _after_run(self, job: Job) -> None:
        if job.returned and job.waitlist.pending == 0 and job.state != FINISHED:
            self._finish(job)

    def _job_failed(self, job: Job) -> None:
        """The adaptor raised (called inside the job's greenlet): drop what it has not
        released; the request fails once its released ops have drained."""
        log.info("request %s (model %s) failed: %s", job.req.req_id, job.model.name, job.error)
        self._withdraw(job)

    def _withdraw(self, job: Job) -> None:
        job.plan = None                      # a lazy plan makes no further step
        if job.waitlist.pending:             # (none issued and unfinished: none to drop)
            job.waitlist.drop_unreleased()
        job.ready.clear()
        if not job.left_policy:
            job.left_policy = True
            if job.in_policy:
                self._queued -= 1
            job.in_policy = False
            try:
                self.policy.job_finished(job)
            except Exception as e:
                self._policy_failed("job_finished", e)

    def _finish(self, job: Job) -> None:
        job.state = FINISHED
        self.jobs.discard(job)
        self.in_flight -= 1
        for ptr in job.allocations:
            self.device.free(ptr)
        bindings = job.bindings
        if bindings is not None:             # its released ops have all completed
            job.bindings = None
            pool = job.model.pool
            if pool.waiting:                 # straight to the oldest job waiting for one
                nxt = pool.waiting.popleft()
                nxt.bindings = bindings
                self._arrivals.append(nxt)
            else:
                pool.release(bindings)
        req = job.req
        if job.error is None:
            job.model.profile.record_job(job.kcount)
            req.status = STATUS_OK
            self._almost_finished(job)       # at the latest now
        else:
            req.status = STATUS_CANCELLED if job.cancelled else STATUS_ERROR
            req.error = job.error
        self._withdraw(job)
        req.t_done = self.now
        job.wait_op = None                   # (a cancelled synchronize leaves its op, and io view)
        if req.on_complete is not None:
            req.on_complete(req, req.status, req.error)

    def _almost_finished(self, job: Job) -> None:
        if not job.almost_sent:
            job.almost_sent = True
            cb = job.req.on_almost_finished
            if cb is not None:
                cb(job.req)

    def _device_refused(self, op: Op, exc: DeviceError) -> None:
        """The device rejected a released op (a bad pointer, say): fail its request.
        A lost device is not one request's failure: it goes up to the daemon."""
        if isinstance(exc, DeviceLost):
            raise exc
        self.streams.done(op)
        job = op.job
        op.state = RELEASED
        self._abort(job, f"{type(exc).__name__}: {exc}", cancelled=False)
        job.waitlist.finish(op)
        if job.waitlist.pending == 0 and job.state != FINISHED:
            self._finish(job)

    def _abort(self, job: Job, error: str, cancelled: bool) -> None:
        """Stop a job from the loop: kill its greenlet, drop its unreleased ops."""
        job.cancelled = cancelled
        job.error = job.error or error
        if job.glet is not None and not job.glet.dead:
            job.glet.throw(greenlet.GreenletExit)
        job.returned = True
        self._withdraw(job)

    def _check_launch_size(self, func: Any, blocks: int) -> None:
        need = self.tracker.entries_for(blocks)
        if need > self.tracker.slots:
            raise ValueError(f"kernel {func.name!r} with {blocks} blocks posts {need} notifQ "
                             f"entries at group {self.group}, more than the ring's "
                             f"{self.tracker.slots} slots; use a larger notifq_slots or group")

    # -- policy fallback -------------------------------------------------------------------------
    def _held_back(self) -> None:
        """After a release pass, jobs are ready and the device runs nothing (no kernel, no
        copy): pick() held them all back. Past POLICY_STALL_SECONDS of that the policy is
        stalled, and fifo takes over."""
        if self._policy_stalled():
            self._policy_failed("pick", PolicyError(
                f"pick() returned None for {POLICY_STALL_SECONDS:g} s while {self._queued} "
                f"job(s) had a ready kernel and the device had nothing to run"))

    def _policy_stalled(self, now: float | None = None) -> bool:
        """True once the policy has held every ready job back, with the device idle, in
        every iteration for POLICY_STALL_SECONDS (``now``: judge at that time instead).
        An iteration in which the device ran something breaks the chain (a release keeps
        it busy for one iteration at least); new arrivals do not."""
        t = time.monotonic()
        if self._held_iter < self.iterations - 1:
            self._held_since = t
        self._held_iter = self.iterations
        return (t if now is None else now) - self._held_since >= POLICY_STALL_SECONDS

    def _bind_policy(self) -> None:
        # Speed: kernel_completed runs per kernel and most policies leave it empty.
        kc = self.policy.kernel_completed
        self._kernel_completed = None if type(self.policy).kernel_completed is Policy.kernel_completed else kc

    def _policy_failed(self, hook: str, exc: Exception) -> None:
        """A policy hook raised: log it, switch to fifo, re-queue every job, go on."""
        failed = self.policy
        if failed.name == FALLBACK_POLICY and type(failed) is get_policy(FALLBACK_POLICY):
            raise RuntimeError(f"the fallback policy {FALLBACK_POLICY!r} raised in {hook}() "
                               f"(internal error, please report)") from exc
        log.error("scheduling policy %r raised in %s(); falling back to %r and serving on",
                  failed.name, hook, FALLBACK_POLICY, exc_info=exc)
        self.policy = policy = get_policy(FALLBACK_POLICY)(self)
        self._bind_policy()
        self.policy_failure = f"{failed.name}.{hook}: {type(exc).__name__}: {exc}"
        self.streams.set_mode(policy.stream_mode)
        self._queued = 0
        for job in sorted(self.jobs, key=lambda j: j.seq):
            job.waitlist.eager = policy.eager
            job.queued = False
            job.in_policy = False
            if job.left_policy or job.state == FINISHED:
                continue
            policy.job_arrived(job)
            if job.plan is not None and policy.eager:
                job.plan.materialize(job)    # eager release needs the successors issued
            if job.ready and not job.in_policy:
                self._queue(job)

    # ======================================================================================
    # The public contract.
    # ======================================================================================
    def register_model(self, name: str, adaptor: JobAdaptor, *, profile_runs: int | None = None) -> int:
        """Initialize ``adaptor`` and run ``profile_runs`` jobs (default: the
        dispatcher's ``profile_runs``) to seed the model's kernel statistics. Profiling
        drives the loop itself: call it before serving."""
        if not isinstance(adaptor, JobAdaptor):
            raise TypeError(f"model {name!r}: adaptor must be a JobAdaptor, got {type(adaptor).__name__}")
        if any(m.name == name for m in self.models):
            raise ValueError(f"model {name!r} is already registered")
        adaptor.init(self.device)
        model = Model(len(self.models), name, adaptor, pool=adaptor.buffer_pool)
        if type(adaptor).run is PlanAdaptor.run:
            # Only the unmodified built-in run(): a subclass that overrides it keeps its
            # greenlet. A kernel too large for the notifQ is refused by cuda.launch.
            template = PlanTemplate(adaptor, self)
            if all(self.tracker.entries_for(spec[9]) <= self.tracker.slots
                   for spec in template.specs if spec[0] == KERNEL):
                model.template = template
        self.models.append(model)
        runs = self.profile_runs if profile_runs is None else profile_runs
        for i in range(runs):
            failed = []
            req = Request(-1 - i, -1, model.model_id, np.zeros(adaptor.io_bytes, np.uint8),
                          on_complete=lambda r, st, err: failed.append(err) if st else None)
            self.submit(req)
            self.run_until_idle()
            if failed:
                raise RuntimeError(f"profiling run of model {name!r} failed: {failed[0]}")
        return model.model_id

    def submit(self, req: Request) -> None:
        """Accept a request; its job starts in the next :meth:`step`."""
        if not 0 <= req.model_id < len(self.models):
            raise ValueError(f"request {req.req_id}: unknown model id {req.model_id}; "
                             f"register the model first ({len(self.models)} registered)")
        io = req.io
        if not isinstance(io, np.ndarray) or io.dtype != np.uint8 or io.ndim != 1:
            raise ValueError(f"request {req.req_id}: io must be a 1-D numpy uint8 view of the "
                             f"client's io region")
        req.t_submit = self.device.now()
        self._seq += 1
        job = Job(self, req, self.models[req.model_id], self._seq)
        self.jobs.add(job)
        self.in_flight += 1
        self._arrivals.append(job)

    def cancel_client(self, client_id: int) -> int:
        """Cancel every request of ``client_id`` (it went away); returns how many.
        Released work drains first; ``on_complete`` then reports STATUS_CANCELLED."""
        victims = [j for j in self.jobs if j.client_id == client_id]
        for job in victims:
            parked = job.model.pool.waiting if job.model.pool is not None else ()
            if job in self._arrivals:
                self._arrivals.remove(job)
                job.left_policy = True       # never announced to the policy
            elif job in parked:              # waiting for a buffer set
                parked.remove(job)
                job.left_policy = True
            self._abort(job, f"cancelled: client {client_id} disconnected", cancelled=True)
            if job.waitlist.pending == 0:
                self._finish(job)
        return len(victims)

    def abandon_all(self, reason: str) -> int:
        """Complete every request in flight now, as cancelled with ``reason``, without
        waiting for the work already on the device; returns how many.

        Only for a daemon about to close the device (the drain deadline passed): the
        device may still finish the abandoned kernels and copies, so the dispatcher's
        bookkeeping (occupancy, streams, device buffers) is not valid afterwards and it
        must not be stepped again. The clients' io regions may still be written by a
        copy in flight; a cancelled request's outputs are undefined."""
        jobs = sorted(self.jobs, key=lambda j: j.seq)
        for job in jobs:
            if job.glet is not None and not job.glet.dead:
                job.glet.throw(greenlet.GreenletExit)
            job.state = FINISHED
            self.jobs.discard(job)
            self.in_flight -= 1
            req = job.req
            req.status, req.error, req.t_done = STATUS_CANCELLED, reason, self.now
            if req.on_complete is not None:
                req.on_complete(req, STATUS_CANCELLED, reason)
        self._arrivals.clear()
        self._resume.clear()
        return len(jobs)

    def run_until_idle(self, timeout: float = 60.0) -> None:
        """Step until nothing is in flight. On a virtual-time device the clock jumps to
        the next device event whenever an iteration changes nothing."""
        virtual = hasattr(self.device, "next_event_time") and not getattr(self.device, "realtime", False)
        deadline = time.monotonic() + timeout
        while self.step() or self._arrivals:
            if self.idle:
                if virtual:
                    t = self.device.next_event_time()
                    if t == float("inf") and self._queued and self._policy_stalled(now=float("inf")):
                        self._policy_failed("pick", PolicyError(
                            f"pick() returned None while {self._queued} job(s) had a ready "
                            f"kernel and the device had nothing to run"))
                        continue
                    if t == float("inf"):
                        raise RuntimeError("dispatcher stalled: jobs are in flight but the device "
                                           "has no pending event (internal error, please report)")
                    self.device.run_until(t)
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"run_until_idle: {self.in_flight} requests still in "
                                       f"flight after {timeout} s")
