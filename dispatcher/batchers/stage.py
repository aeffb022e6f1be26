"""The batching stage: per model, a batcher between admitted requests and jobs.

The stage owns what batchers must not have to get right: each batch's io buffer
(gather, scatter: :mod:`.gather`), per-request completion, cancellation of queued
requests, failure isolation, the batcher's timer and its statistics. A batch becomes
one job of the dispatcher (:meth:`~paella.dispatcher.core.Dispatcher.submit_group`) on
the variant the batcher chose, registered as a model of its own: its own launch plan,
and its own SRPT profile, so the policy's estimate is per variant.

Per request: a request's outputs are scattered into its own io region just before its
completion is reported; a request cancelled while queued is completed as cancelled at
once; a cancelled request inside a running batch is completed as cancelled with the
batch, without its outputs. A batch whose job *fails* is retried request by request
(each alone on its smallest variant, once), so one bad request fails alone and the
others of its batch still get their answers.

Schedulers (:class:`~.base.SchedulerBatcher`: Orca, DVABatch) drive their own jobs
through a :class:`StageContext`; the stage keeps the ledger of the requests it handed
them (``ServedModel.waiting``), answers each exactly once (a second answer is refused
and logged), answers what a failed or closed scheduler still held, and cancels a
vanished client's requests and its parts of running jobs.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paella import rings
from paella.plugins import PLUGIN_ERRORS

from paella.dispatcher.core import Request
from paella.dispatcher.instruments import Instruments
from paella.dispatcher.virtual_time import VirtualDriver

from .base import (Batch, Batcher, BatcherError, ModelVariants, RequestRefused, SchedulerBatcher,
                   VariantSpec)
from .gather import IoLayout, gather, in_place, scatter_one

#: Hooks of a plain batcher that return the batches it forms (a list of Batch).
BATCH_HOOKS = frozenset({"add", "poll", "flush"})

log = logging.getLogger(__name__)


@dataclass
class ServedVariant:
    """A compiled variant registered with the dispatcher."""
    spec: VariantSpec
    model_id: int                   # the dispatcher's id of this variant's model
    layout: IoLayout
    free: list[np.ndarray] = field(default_factory=list)   # staging buffers to reuse

    def staging(self) -> np.ndarray:
        return self.free.pop() if self.free else np.zeros(self.layout.io_bytes, np.uint8)


@dataclass(eq=False)
class ServedModel:
    name: str
    variants: ModelVariants
    served: dict[int, ServedVariant]   # by variant index
    batcher: Batcher
    #: Requests handed to the batcher and not yet back in a batch (by id()): the stage's
    #: own record, so a batcher that fails or misbehaves cannot lose or repeat one.
    waiting: dict[int, Any] = field(default_factory=dict)
    #: A scheduler's context (None: a plain batcher, the stage forms the jobs).
    ctx: "StageContext | None" = None
    #: Its batches in flight (retries included): a replaced model's variants are freed
    #: once none is left, since a failed batch's requests retry on its smallest variant.
    running: int = 0
    #: Replaced or removed (a plain batcher; a scheduler's context says it itself).
    retired: bool = False


@dataclass(eq=False)
class _Running:
    """A batch's job in flight: who is left to complete, and its staging buffer."""
    batch: Batch
    served: ServedVariant
    model: ServedModel
    staging: np.ndarray | None
    rows0: list[int]
    left: int
    retry: bool                     # its failure re-runs its requests one by one
    own: bool = True                # formed by the batcher (False: a retry of the stage's)


@dataclass
class BatchStats:
    """Counters of the stage (the daemon logs them; experiments read them)."""
    batches: int = 0
    requests: int = 0
    rows: int = 0
    padded_rows: int = 0            # rows of variants no request filled (waste)
    zero_copy: int = 0              # batches run on their request's own io region
    gathered_bytes: int = 0
    scattered_bytes: int = 0
    retried: int = 0                # requests re-run alone after their batch failed
    scheduler_jobs: int = 0         # jobs schedulers submitted (iterations, stages)
    scheduler_failures: int = 0     # schedulers taken out of service (a hook raised)

    @property
    def padding_waste(self) -> float:
        total = self.rows + self.padded_rows
        return self.padded_rows / total if total else 0.0

    def to_dict(self) -> dict:
        return {"batches": self.batches, "requests": self.requests, "rows": self.rows,
                "padded_rows": self.padded_rows, "padding_waste": round(self.padding_waste, 4),
                "zero_copy": self.zero_copy, "gathered_bytes": self.gathered_bytes,
                "scattered_bytes": self.scattered_bytes, "retried": self.retried,
                "scheduler_jobs": self.scheduler_jobs,
                "scheduler_failures": self.scheduler_failures}


class BatchingStage:
    """Batchers of the models served through ``disp`` (a Dispatcher)."""

    def __init__(self, disp: Any, instruments: Any = ()):
        self.disp = disp
        #: Hooks on the requests this stage answers itself, without a job of the
        #: dispatcher (a scheduler plug-in's completions, refusals): ``request_finished``;
        #: and ``request_retried`` when it runs a failed batch's request again. A request
        #: answered by a job goes through the dispatcher's own hooks.
        self.instruments = (instruments if isinstance(instruments, Instruments)
                            else Instruments(instruments or ()))
        self.models: dict[int, ServedModel] = {}   # by the clients' model id
        self.stats = BatchStats()
        self._queued = 0
        #: Dispatcher model ids for schedulers' internal models (the daemon hands out
        #: ids clear of the clients'); default: the next free one.
        self.new_model_id = disp.new_model_id
        #: Replaced models whose scheduler still holds requests, or whose batches still
        #: run: served to the end.
        self._retired: list[ServedModel] = []
        #: abandon() was called: the daemon stops, a failed batch's requests keep its answer.
        self.abandoned = False

    # -- models ----------------------------------------------------------------------------
    def add_model(self, model_id: int, model: ServedModel) -> None:
        """Serve ``model`` (its variants registered with the dispatcher already) as the
        clients' ``model_id``; a model added again takes new requests, and the old
        batcher's queued requests start at once (flushed)."""
        old = self.models.get(model_id)
        if model.batcher.drives_jobs and model.ctx is None:
            model.ctx = StageContext(self, model)
            try:
                model.batcher.start(model.ctx)  # raises: the model is not served
            except BaseException:
                model.ctx.shut("", rings.E_INTERNAL)   # (frees what it allocated)
                own, model.ctx._own_models = model.ctx._own_models, set()
                self.retire_variants(own)      # and what it registered
                raise
        elif not model.batcher.drives_jobs and hasattr(model.batcher, "refuse"):
            # A plain batcher that refuses requests (the dynamic batcher's queue policy:
            # a full queue, a queue timeout with REJECT) answers them through the stage.
            model.batcher.refuse = lambda req, reason, m=model: self._refused(m, req, reason)
        self.models[model_id] = model
        if old is not None:
            self._retire(old)

    def remove_model(self, model_id: int) -> None:
        """Serve ``model_id`` no more (its folder left the repository): what its batcher
        holds starts now, and the model goes once its last job has finished."""
        old = self.models.pop(model_id, None)
        if old is not None:
            self._retire(old)

    def _retire(self, old: ServedModel) -> None:
        """A model replaced or removed: its requests finish on it, then the dispatcher
        frees its variants (``retire_model``)."""
        if old.ctx is not None:
            old.ctx.retire()                     # its requests finish on it, then it closes
            return
        old.retired = True
        if old.waiting:
            self._start(old, self._guarded(old, "flush", old.batcher.flush, self.disp.now))
            self._run_alone(old)                 # anything the batcher kept back
        if old.running:
            self._retired.append(old)            # (its batches' retries may need any variant)
        else:
            self._release(old)

    def _release(self, old: ServedModel) -> None:
        """A replaced plain model has no batch left: its variants can go."""
        self.retire_variants({sv.model_id for sv in old.served.values()})

    def retire_variants(self, model_ids: set[int]) -> None:
        """Have the dispatcher free these models of a replaced one once their jobs end,
        all but those a model still served or still finishing runs (a replacement may
        reuse them)."""
        live = set()
        for m in self._served_models():
            live.update(sv.model_id for sv in m.served.values())
            if m.ctx is not None:
                live.update(m.ctx._own_models)
        for mid in model_ids - live:
            if mid in self.disp.models:
                self.disp.retire_model(mid)

    # -- requests ----------------------------------------------------------------------------
    def submit(self, req: Any) -> None:
        m = self.models.get(req.model_id)
        if m is None:
            raise ValueError(f"request {req.req_id}: model id {req.model_id} is not batched here")
        if m.ctx is not None:
            return m.ctx.add(req)
        own = m.variants.fit(req.rows, req.seq_len)
        if own is not None and req.layout is None:
            # A whole-variant request: its io region is laid out as that variant's.
            req.layout = m.served[own.index].layout.slots
        if own is None:
            # The front end checks shapes against the model table; this guards the rest.
            return self._complete(req, rings.E_OPTIONS,
                                  f"no variant of {m.name} takes {req.rows} rows of length "
                                  f"{req.seq_len} (largest: {m.variants.max_rows} rows"
                                  f"{f', length {m.variants.max_seq_len}' if m.variants.has_length else ''})")
        m.waiting[id(req)] = req
        self._queued += 1
        self._start(m, self._guarded(m, "add", m.batcher.add, req, self.disp.now))

    def step(self) -> bool:
        """The timer hook: poll every batcher whose deadline has come."""
        if not self._queued:         # no batcher holds a request (the loop's every pass)
            return False
        now = self.disp.now
        for m in self._served_models():
            if m.waiting:
                d = self._guarded(m, "deadline", m.batcher.deadline)
                if d is not None and d <= now:
                    polled = self._guarded(m, "poll", m.batcher.poll, now)
                    if m.ctx is None:
                        self._start(m, polled)
                        if not polled and m.waiting and not m.running:
                            d = self._guarded(m, "deadline", m.batcher.deadline)
                            if d is not None and d <= now:   # it would be polled forever
                                self._batcher_failed(m, "poll", BatcherError(
                                    f"poll() at its deadline released none of the "
                                    f"{len(m.waiting)} request(s) it holds, with no batch "
                                    f"in flight, and its deadline has passed"))
        return self._queued > 0

    def _served_models(self) -> list[ServedModel]:
        return [*self.models.values(), *self._retired] if self._retired else list(self.models.values())

    def deadline(self) -> float | None:
        """The earliest device time a batcher wants :meth:`step` called (None: none)."""
        best = None
        for m in self._served_models():
            if m.waiting:
                d = self._guarded(m, "deadline", m.batcher.deadline)
                if d is None and m.waiting and not (m.ctx.jobs if m.ctx is not None else m.running):
                    # Nothing would ever call it again for them: a stall, not a wait.
                    self._batcher_failed(m, "deadline", BatcherError(
                        f"it holds {len(m.waiting)} request(s) with no "
                        f"{'job' if m.ctx is not None else 'batch'} in flight and no deadline"))
                    d = None
                if d is not None and (best is None or d < best):
                    best = d
        return best

    def cancel_client(self, client_id: int) -> None:
        """The client went away: its queued requests complete as cancelled now, its
        running ones through the dispatcher (a batch goes on for the other clients)."""
        for m in self._served_models():
            if any(r.client_id == client_id for r in m.waiting.values()):
                self._guarded(m, "remove_client", m.batcher.remove_client, client_id)
                for key, req in list(m.waiting.items()):
                    if req.client_id == client_id:   # (whatever the plug-in returned)
                        del m.waiting[key]
                        self._queued -= 1
                        self._complete(req, rings.E_CANCELLED, f"cancelled: client "
                                                               f"{client_id} disconnected")
                if m.ctx is not None and m.ctx.retired:
                    m.ctx._close_if_done()       # (a replaced scheduler left with nothing)
        self.disp.cancel_client(client_id)

    def flush(self) -> None:
        """Start every queued request now (the daemon drains). Schedulers keep theirs:
        they run them to the end, or :meth:`abandon` closes them."""
        for m in list(self.models.values()):
            if m.waiting and m.ctx is None:
                self._start(m, self._guarded(m, "flush", m.batcher.flush, self.disp.now))
                self._run_alone(m)           # anything the batcher kept back

    def abandon(self, reason: str, status: int = rings.E_CANCELLED) -> None:
        """The daemon stops now: every scheduler is closed and what it still holds is
        answered with ``status`` and ``reason`` (their jobs are the dispatcher's to
        abandon)."""
        self.abandoned = True                    # (failed batches are not retried now)
        for m in self._served_models():
            if m.ctx is not None:
                m.ctx.shut(reason, status)

    @property
    def queued(self) -> int:
        return self._queued

    def _refused(self, m: ServedModel, req: Any, reason: str) -> None:
        """A plain batcher refused a request it holds: answered now with the reason
        (E_FAILED, as an overloaded daemon answers), and forgotten."""
        if m.waiting.pop(id(req), None) is None:
            log.error("batcher %r of %s refused request %s, which it does not hold; ignored",
                      m.batcher.name, m.name, getattr(req, "req_id", req))
            return
        self._queued -= 1
        self._complete(req, rings.E_FAILED, reason)

    # -- plug-in failures ----------------------------------------------------------------------
    def _guarded(self, m: ServedModel, hook: str, fn: Any, *args: Any) -> Any:
        """Call a batcher hook. One that raises is logged, the model falls back to the
        identity batcher, and every request its batcher held runs alone: none is lost."""
        try:
            result = fn(*args)
            if hook == "deadline":
                if result is not None and (isinstance(result, bool) or not isinstance(
                        result, (int, float)) or math.isnan(result)):
                    raise BatcherError(f"deadline() must return a device time (a number) "
                                       f"or None, got {result!r:.80}")
            elif m.ctx is None and hook in BATCH_HOOKS and not (
                    type(result) is list and all(isinstance(b, Batch) for b in result)):
                raise BatcherError(f"{hook}() must return a list of Batch, got {result!r:.80}")
            return result
        except PLUGIN_ERRORS as e:  # a plug-in may raise anything, sys.exit() included
            self._batcher_failed(m, hook, e)
            return None if hook == "deadline" else []

    def _batcher_failed(self, m: ServedModel, hook: str, e: Exception) -> None:
        """A batcher hook raised or broke its contract: a scheduler's context fails (it
        answers what it holds); a plain batcher is logged, the model falls back to the
        identity batcher, and every request its batcher held runs alone: none is lost."""
        if m.ctx is not None:
            m.ctx.fail(hook, e)
            return
        failed = m.batcher
        log.error("batcher %r of model %s failed in %s(); the model falls back to the "
                  "identity batcher, its %d queued request(s) run alone", failed.name,
                  m.name, hook, len(m.waiting), exc_info=e)
        from .identity import IdentityBatcher
        m.batcher = IdentityBatcher(m.variants)
        self._run_alone(m)

    def _run_alone(self, m: ServedModel) -> None:
        for req in list(m.waiting.values()):
            self._start(m, [Batch([req], m.variants.fit(req.rows, req.seq_len),
                                  t_formed=self.disp.now)])

    def run_until_idle(self) -> None:
        """Virtual time only (tests, experiments): step the dispatcher and the batchers
        until nothing is queued or in flight, the clock jumping to the next device event
        or batcher deadline whenever an iteration changes nothing (the one driver,
        stepping at every device event as the daemon's loop would)."""
        VirtualDriver(self.disp, self, skip_unobserved=False, on_stall=self.unstall,
                      name="batching stage").run()

    @property
    def busy(self) -> bool:
        """Requests held by the batchers (the virtual-time driver's front stage)."""
        return self._queued > 0

    def unstall(self) -> bool:
        """Nothing can happen any more (no device event, no batcher deadline) while the
        batchers hold requests, held back by ``max_inflight`` with nothing running:
        start them now. True if there were any (the driver's ``on_stall``)."""
        if not self._queued:
            return False
        self.flush()
        return True

    # -- batches -----------------------------------------------------------------------------
    def _start(self, m: ServedModel, batches: Any) -> None:
        """Run the batches a batcher returned, each request once: one the stage is not
        holding for it (never given, or already run) is dropped from its batch, logged."""
        for batch in batches or ():
            reqs = []
            for req in getattr(batch, "requests", ()):
                if m.waiting.pop(id(req), None) is None:
                    log.error("batcher %r of %s returned request %s, which it does not hold; "
                              "ignored", m.batcher.name, m.name, getattr(req, "req_id", req))
                    continue
                reqs.append(req)
            if not reqs:
                continue
            self._queued -= len(reqs)
            if len(reqs) != len(batch.requests):
                batch = Batch(reqs, batch.variant, batch.t_formed, batch.meta)
            self._run(m, batch, retry=len(reqs) > 1)

    def _run(self, m: ServedModel, batch: Batch, retry: bool, own: bool = True) -> None:
        reqs = batch.requests
        v = batch.variant
        sv = m.served.get(v.index) if isinstance(v, VariantSpec) else None
        if len(reqs) == 1:                   # Speed: the identity path, once per request
            rows, seq = reqs[0].rows, reqs[0].seq_len
        else:
            rows, seq = batch.rows, batch.seq_len
        bad = None
        if not isinstance(v, VariantSpec):
            bad = f"batcher {m.batcher.name!r} gave a batch no variant ({v!r})"
        elif sv is None or sv.spec != v:
            bad = f"batcher {m.batcher.name!r} chose variant {v!r}, which {m.name} does not have"
        elif rows > v.rows or (v.seq_len and seq > v.seq_len) or (not v.seq_len and seq):
            bad = (f"batcher {m.batcher.name!r} put {rows} rows of length {seq} "
                   f"on variant {v.index} ({v.rows} rows, length {v.seq_len})")
        if bad is not None:
            log.error("%s", bad)
            for req in reqs:
                self._complete(req, rings.E_INTERNAL, bad)
            return
        st = self.stats
        st.batches += 1
        st.requests += len(reqs)
        st.rows += rows
        st.padded_rows += v.rows - rows
        if in_place(reqs, sv.layout):
            st.zero_copy += 1
            staging, io = None, reqs[0].io
        else:
            staging = io = sv.staging()
            st.gathered_bytes += gather(reqs, sv.layout, staging)
        rows0, r = [], 0
        for req in reqs:
            rows0.append(r)
            r += req.rows
        run = _Running(batch, sv, m, staging, rows0, len(reqs), retry, own)
        for i, req in enumerate(reqs):
            orig = req.on_complete
            req.on_complete = (lambda q, status, err, i=i, orig=orig:
                               self._done(run, i, q, status, err, orig))
        self.disp.submit_group(reqs, io, model_id=sv.model_id)
        m.running += 1

    def _done(self, run: _Running, i: int, req: Any, status: int, err: str | None,
              orig: Any) -> None:
        req.on_complete = orig
        run.left -= 1
        if status == rings.OK and run.staging is not None and req.io is not None:
            self.stats.scattered_bytes += scatter_one(req, run.rows0[i], run.served.layout,
                                                      run.staging)
        if status == rings.E_FAILED and run.retry and not req.cancelled and not self.abandoned:
            try:
                self._retry(run.model, req)
            except Exception as e:  # noqa: BLE001 - the request gets its batch's answer
                log.error("request %s of %s not retried alone: %s: %s", req.req_id,
                          run.model.name, type(e).__name__, e)
                self._complete(req, status, err)
        elif orig is not None:
            orig(req, status, err)
        if run.left == 0 and run.staging is not None:
            run.served.free.append(run.staging)
            run.staging = None
        if run.left == 0 and run.own:
            m = run.model
            if self.models.get(req.model_id) is m:   # (not a model replaced since)
                self._guarded(m, "batch_done", m.batcher.batch_done, run.batch, self.disp.now)
                if m.waiting:
                    self._start(m, self._guarded(m, "poll", m.batcher.poll, self.disp.now))
        if run.left == 0:
            m = run.model
            m.running -= 1                       # (after any retry it started)
            if m.retired and m.running == 0:     # (then it waits in _retired)
                self._retired.remove(m)
                self._release(m)

    def _retry(self, m: ServedModel, req: Any) -> None:
        """Re-run one request of a failed batch alone (isolating the failure)."""
        self.stats.retried += 1
        if "request_retried" in self.instruments:
            self.instruments.call("request_retried", req)
        req.status, req.error = -1, None
        v = m.variants.fit(req.rows, req.seq_len)
        self._run(m, Batch([req], v, t_formed=self.disp.now), retry=False, own=False)

    def _complete(self, req: Any, status: int, err: str) -> None:
        req.status, req.error = status, err
        if req.on_complete is not None:
            req.on_complete(req, status, err)
        if "request_finished" in self.instruments:
            self.instruments.call("request_finished", req)


def submit_job(disp: Any, model_id: int, io: np.ndarray, clients: list[int], done: Any,
               last_id: int, *args: Any, stream: str | None = None, priority: int = 0,
               bindings: Any = None, ready: Any = None) -> int:
    """One job of ``model_id`` on ``io`` with one part (an internal request) per client;
    ``done(*args, status, error)`` once every part ended: OK if any part ran OK, else the
    first part's status. Returns the last part id used (parts are numbered from
    ``last_id + 1``). ``stream``: the named stream its ops go to (``submit_group``);
    ``priority``: its parts' class (``Request.priority``; 0 the default); ``bindings``:
    a buffer set the caller bound; ``ready``: what its work waits for (both
    ``submit_group``'s)."""
    if not clients:
        raise ValueError("a job needs at least one client to run for")
    state = [len(clients), False, None]          # parts left, any OK, first failure

    def part_done(q: Request, status: int, err: str | None) -> None:
        state[0] -= 1
        if status == rings.OK:
            state[1] = True
        elif state[2] is None:
            state[2] = (status, err)
        if state[0] == 0:
            done(*args, *((rings.OK, None) if state[1] or state[2] is None else state[2]))

    parts = []
    for cid in clients:
        last_id += 1
        parts.append(Request(last_id, int(cid), model_id, io, on_complete=part_done,
                             priority=priority))
    disp.submit_group(parts, io, model_id=model_id, stream=stream, bindings=bindings, ready=ready)
    return last_id


class StageContext:
    """The :class:`~.base.SchedulerContext` of one model's scheduler: the scheduler's
    only way to the dispatcher, the device and the clients, and the stage's ledger of
    what it holds (``model.waiting``, by ``id(req)``)."""

    def __init__(self, stage: BatchingStage, model: ServedModel):
        self.stage = stage
        self.model = model
        self.name = model.name
        self.variants = model.served
        self.failed: str | None = None       # why it is out of service
        self.closed = False
        self.retired = False                 # replaced by a reload: no new requests
        self.jobs = 0                        # its jobs in flight
        #: Let what its hooks and jobs' ``on_done`` raise reach the caller instead of
        #: taking it out of service (a context its caller drives: :func:`scheduler_context`).
        self.reraise = False
        #: Where :meth:`now` reads: None, the dispatcher's time of its last step (the
        #: daemon's loop calls the scheduler right after it); else a clock of its own.
        self.clock: Any = None
        self._own_models: set[int] = {sv.model_id for sv in model.served.values()}
        self._ptrs: dict[int, int] = {}      # its scheduler's allocations: ptr -> bytes
        self._part_ids = 0

    @property
    def own_models(self) -> frozenset[int]:
        """The dispatcher models this context holds: its variants and those its scheduler
        registered (one C-level copy: safe from the metrics thread)."""
        return frozenset(self._own_models)

    @property
    def held_bytes(self) -> int:
        """Device bytes its scheduler allocated itself (``alloc``), e.g. orca's KV cache."""
        return sum(list(self._ptrs.values()))

    # -- the scheduler's side -------------------------------------------------------------
    def now(self) -> float:
        return self.stage.disp.now if self.clock is None else self.clock()

    def register_model(self, name: str, adaptor: Any, *, profile_runs: int | None = 0) -> int:
        disp = self.stage.disp
        mid = self.stage.new_model_id()
        # Named with its id: a reloaded model's scheduler registers its models again
        # while the old one's still run.
        # (No buffer sets made ahead: a scheduler registers its models as it serves.)
        disp.register_model(f"{self.name}/{name}@{mid}", adaptor, profile_runs=profile_runs,
                            model_id=mid, sets_ahead=0)
        self._own_models.add(mid)
        return mid

    def submit(self, model_id: int, io: np.ndarray, clients: list[int],
               on_done: Any, stream: str | None = None, priority: int = 0,
               bindings: Any = None, ready: Any = None) -> None:
        if self.closed or self.failed:
            raise RuntimeError(f"scheduler of {self.name} submitted a job after it was "
                               f"{'closed' if self.closed else 'taken out of service'}")
        if model_id not in self._own_models:
            raise ValueError(f"model id {model_id} is not one this scheduler registered "
                             f"(or one of its bundle's variants)")
        self._part_ids = submit_job(self.stage.disp, model_id, io, clients, self._job_done,
                                    self._part_ids, on_done,
                                    stream=None if stream is None else f"{self.name}/{stream}",
                                    priority=priority, bindings=bindings, ready=ready)
        self.jobs += 1
        self.stage.stats.scheduler_jobs += 1

    def _job_done(self, on_done: Any, status: int, err: str | None) -> None:
        self.jobs -= 1
        if self.closed or self.failed:
            self._release_if_idle()
            return
        self._call("on_done", on_done, status, err)
        if self.retired:
            self._close_if_done()

    def adaptor(self, model_id: int) -> Any:
        """The job adaptor of one of its models (a variant's plan, to derive another)."""
        if model_id not in self._own_models:
            raise ValueError(f"model id {model_id} is not one of {self.name}'s")
        return self.stage.disp.models[model_id].adaptor

    def alloc(self, nbytes: int) -> int:
        ptr = self.stage.disp.alloc(nbytes)      # (reclaims idle buffers when full)
        self._ptrs[ptr] = nbytes
        return ptr

    def free(self, ptr: int) -> None:
        if self._ptrs.pop(ptr, None) is not None:
            self.stage.disp.device.free(ptr)

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        mem = getattr(self.stage.disp.device, "memory", None)
        if mem is None:
            raise RuntimeError(f"the {self.stage.disp.device.backend} device has no host view "
                               f"of its memory (the simulated GPU has); copy through a job")
        return mem.view(ptr, nbytes)

    @property
    def device_props(self) -> Any:
        return self.stage.disp.device.props

    @property
    def effects(self) -> Any:
        """The device's answer workers, with this model as the owner of what its
        scheduler submits (``OwnedEffects``: its share of their queue is its own, apart
        from the tenants' new inputs)."""
        effects = getattr(self.stage.disp.device, "effects", None)
        if effects is None or getattr(effects, "max_queue", None) is None:
            return effects                   # (computed in this thread: no queue to share)
        from paella.dispatcher.devices.sim.effect_workers import OwnedEffects
        return OwnedEffects(effects, ("model", self.name))

    def progress(self, req: Any, n: int) -> bool:
        if id(req) not in self.model.waiting:
            return False
        cb = req.on_progress
        if cb is not None:
            cb(req, int(n))
        return True

    def complete(self, req: Any, status: int = rings.OK, error: str | None = None) -> bool:
        if self.model.waiting.pop(id(req), None) is None:
            log.error("scheduler %r of %s answered request %s, which it does not hold (answered "
                      "already, or cancelled); ignored", self.model.batcher.name, self.name,
                      getattr(req, "req_id", req))
            return False
        self.stage._queued -= 1
        self.stage._complete(req, status, error if status else None)
        if self.retired:
            self._close_if_done()
        return True

    def held(self) -> list[Any]:
        return list(self.model.waiting.values())

    def run_virtual(self, front: Any = None, arrivals: Any = (), submit: Any = None,
                    until: Any = None, *, name: str = "scheduler") -> bool:
        """Virtual time only: the one driver (:class:`VirtualDriver`) steps the
        dispatcher and ``front`` (the scheduler's own work in front of it); see
        :meth:`VirtualDriver.run`. On a device in real time (the daemon) it raises."""
        return VirtualDriver(self.stage.disp, front, name=name).run(arrivals, submit, until)

    # -- the stage's side -----------------------------------------------------------------
    def add(self, req: Any) -> None:
        """A request for this scheduler: into the ledger, then the plug-in's ``add``."""
        if self.failed or self.closed:
            why = self.failed or f"model {self.name} is shutting down"
            return self.stage._complete(req, rings.E_INTERNAL if self.failed else
                                        rings.E_CANCELLED, why)
        self.model.waiting[id(req)] = req
        self.stage._queued += 1
        try:
            self.model.batcher.add(req, self.stage.disp.now)
        except RequestRefused as e:
            if id(req) in self.model.waiting:
                self.complete(req, rings.E_OPTIONS, f"{self.name}: {e}")
        except PLUGIN_ERRORS as e:  # a plug-in may raise anything, sys.exit() included
            self.fail("add", e)

    def _call(self, hook: str, fn: Any, *args: Any) -> Any:
        if self.reraise:
            return fn(*args)
        try:
            return fn(*args)
        except PLUGIN_ERRORS as e:  # a plug-in may raise anything, sys.exit() included
            self.fail(hook, e)
            return None

    def fail(self, hook: str, exc: BaseException) -> None:
        """A hook raised: out of service, everything it holds answered E_INTERNAL."""
        if self.failed:
            return
        name = self.model.batcher.name
        # (Most telling first: a client's completion text keeps 120 bytes of it.)
        self.failed = (f"{self.name} out of service: scheduler {name!r} raised in {hook}(): "
                       f"{type(exc).__name__}: {exc}; fix it and reload (SIGHUP)")
        self.stage.stats.scheduler_failures += 1
        log.error("%s (%d request(s) it held answered with the reason)", self.failed,
                  len(self.model.waiting), exc_info=exc)
        self.shut(self.failed, rings.E_INTERNAL)

    def shut(self, reason: str, status: int) -> None:
        """Close the scheduler and answer what it still holds with ``status``."""
        if not self.closed:
            self.closed = True
            try:
                self.model.batcher.close()
            except PLUGIN_ERRORS as e:  # it is going anyway
                log.error("scheduler %r of %s raised in close(): %s: %s",
                          self.model.batcher.name, self.name, type(e).__name__, e)
        for req in list(self.model.waiting.values()):
            self.complete(req, status, reason)
        self._release_if_idle()

    def retire(self) -> None:
        """A reload replaced the model: finish what it holds, then close."""
        self.retired = True
        if self.model.waiting or self.jobs:
            self.stage._retired.append(self.model)
        else:
            self._close_if_done()

    def _close_if_done(self) -> None:
        if not self.model.waiting and not self.jobs and not self.closed:
            self.shut("", rings.E_CANCELLED)
        if self.closed and not self.jobs:
            if self.model in self.stage._retired:
                self.stage._retired.remove(self.model)
            own, self._own_models = self._own_models, set()
            self.stage.retire_variants(own)      # its variants and what it registered

    def _release_if_idle(self) -> None:
        """Device memory goes back once no job of the scheduler can touch it."""
        if self.jobs == 0 and self._ptrs:
            for ptr in list(self._ptrs):
                self.free(ptr)
        if self.retired:
            self._close_if_done()


class _CallerDriven(SchedulerBatcher):
    """The scheduler of a :func:`scheduler_context`: its caller hands requests to its
    engine itself, none comes through the stage."""

    name = "caller-driven"

    def add(self, req: Any, now: float) -> None:
        raise BatcherError(f"{self.model.name}: its requests go to its caller's engine, "
                           f"not through the batching stage")


def scheduler_context(disp: Any, name: str = "steps") -> StageContext:
    """A scheduler context on ``disp`` for a scheduler its caller drives itself: the
    experiments, benchmarks and tests that run an engine (a step runtime, a DVABatch
    pipeline) in virtual time, each request handed to it directly. The same
    :class:`StageContext` a served scheduler gets, of a model ``name`` without a bundle
    on a batching stage of its own, so a scheduler reaches the dispatcher one way
    everywhere. What its jobs' ``on_done`` raises reaches the caller, and its clock is
    the device's (its caller acts between the dispatcher's steps, at the driver's
    instant, when the time of the dispatcher's last step is behind). Drive it with
    :meth:`StageContext.run_virtual`."""
    variants = ModelVariants(name, (VariantSpec(0, 1),))
    model = ServedModel(name, variants, {}, _CallerDriven(variants))
    BatchingStage(disp).add_model(0, model)
    assert model.ctx is not None
    model.ctx.reraise = True
    model.ctx.clock = disp.device.now
    return model.ctx


def layout_of(inputs: list, outputs: list, io_bytes: int) -> IoLayout:
    """An :class:`IoLayout` from a bundle variant's TensorSpecs."""
    from paella.shapes import Slot
    conv = lambda ts: tuple(Slot(t.name, tuple(t.shape), t.dtype, t.offset) for t in ts)  # noqa: E731
    return IoLayout(conv(inputs), conv(outputs), io_bytes)


__all__ = ["BatchStats", "BatchingStage", "BatcherError", "ServedModel", "ServedVariant",
           "StageContext", "layout_of", "scheduler_context", "submit_job"]
