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
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paella import rings

from .base import Batch, Batcher, BatcherError, ModelVariants, VariantSpec
from .gather import IoLayout, gather, in_place, scatter_one

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


@dataclass
class ServedModel:
    name: str
    variants: ModelVariants
    served: dict[int, ServedVariant]   # by variant index
    batcher: Batcher
    #: Requests handed to the batcher and not yet back in a batch (by id()): the stage's
    #: own record, so a batcher that fails or misbehaves cannot lose or repeat one.
    waiting: dict[int, Any] = field(default_factory=dict)


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

    @property
    def padding_waste(self) -> float:
        total = self.rows + self.padded_rows
        return self.padded_rows / total if total else 0.0

    def to_dict(self) -> dict:
        return {"batches": self.batches, "requests": self.requests, "rows": self.rows,
                "padded_rows": self.padded_rows, "padding_waste": round(self.padding_waste, 4),
                "zero_copy": self.zero_copy, "gathered_bytes": self.gathered_bytes,
                "scattered_bytes": self.scattered_bytes, "retried": self.retried}


class BatchingStage:
    """Batchers of the models served through ``disp`` (a Dispatcher)."""

    def __init__(self, disp: Any):
        self.disp = disp
        self.models: dict[int, ServedModel] = {}   # by the clients' model id
        self.stats = BatchStats()
        self._queued = 0

    # -- models ----------------------------------------------------------------------------
    def add_model(self, model_id: int, model: ServedModel) -> None:
        """Serve ``model`` (its variants registered with the dispatcher already) as the
        clients' ``model_id``; a model added again takes new requests, and the old
        batcher's queued requests start at once (flushed)."""
        old = self.models.get(model_id)
        self.models[model_id] = model
        if old is not None and old.waiting:
            self._start(old, self._guarded(old, "flush", old.batcher.flush, self.disp.now))

    # -- requests ----------------------------------------------------------------------------
    def submit(self, req: Any) -> None:
        m = self.models.get(req.model_id)
        if m is None:
            raise ValueError(f"request {req.req_id}: model id {req.model_id} is not batched here")
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
        now = self.disp.now
        for m in list(self.models.values()):
            if m.waiting:
                d = self._guarded(m, "deadline", m.batcher.deadline)
                if d is not None and d <= now:
                    self._start(m, self._guarded(m, "poll", m.batcher.poll, now))
        return self._queued > 0

    def deadline(self) -> float | None:
        """The earliest device time a batcher wants :meth:`step` called (None: none)."""
        best = None
        for m in list(self.models.values()):
            if m.waiting:
                d = self._guarded(m, "deadline", m.batcher.deadline)
                if d is not None and (best is None or d < best):
                    best = d
        return best

    def cancel_client(self, client_id: int) -> None:
        """The client went away: its queued requests complete as cancelled now, its
        running ones through the dispatcher (a batch goes on for the other clients)."""
        for m in list(self.models.values()):
            if any(r.client_id == client_id for r in m.waiting.values()):
                self._guarded(m, "remove_client", m.batcher.remove_client, client_id)
                for key, req in list(m.waiting.items()):
                    if req.client_id == client_id:   # (whatever the plug-in returned)
                        del m.waiting[key]
                        self._queued -= 1
                        self._complete(req, rings.E_CANCELLED, f"cancelled: client "
                                                               f"{client_id} disconnected")
        self.disp.cancel_client(client_id)

    def flush(self) -> None:
        """Start every queued request now (the daemon drains)."""
        for m in list(self.models.values()):
            if m.waiting:
                self._start(m, self._guarded(m, "flush", m.batcher.flush, self.disp.now))
                self._run_alone(m)           # anything the batcher kept back

    @property
    def queued(self) -> int:
        return self._queued

    # -- plug-in failures ----------------------------------------------------------------------
    def _guarded(self, m: ServedModel, hook: str, fn: Any, *args: Any) -> Any:
        """Call a batcher hook. One that raises is logged, the model falls back to the
        identity batcher, and every request its batcher held runs alone: none is lost."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a plug-in may raise anything
            failed = m.batcher
            log.error("batcher %r of model %s raised in %s(); the model falls back to the "
                      "identity batcher, its %d queued request(s) run alone", failed.name,
                      m.name, hook, len(m.waiting), exc_info=e)
            from .identity import IdentityBatcher
            m.batcher = IdentityBatcher(m.variants)
            self._run_alone(m)
            return None if hook == "deadline" else []

    def _run_alone(self, m: ServedModel) -> None:
        for req in list(m.waiting.values()):
            self._start(m, [Batch([req], m.variants.fit(req.rows, req.seq_len),
                                  t_formed=self.disp.now)])

    def run_until_idle(self) -> None:
        """Virtual time only (tests, experiments): step the dispatcher and the batchers
        until nothing is queued or in flight, the clock jumping to the next device event
        or batcher deadline whenever an iteration changes nothing."""
        disp, dev = self.disp, self.disp.device
        while True:
            busy = disp.step()
            self.step()
            if not busy and not self._queued and not disp._arrivals:
                return
            if disp.idle and not disp._arrivals:
                d = self.deadline()
                t = min(dev.next_event_time(), float("inf") if d is None else d)
                if t == float("inf"):
                    if self._queued:          # held back (max_inflight) with nothing running
                        self.flush()
                        continue
                    raise RuntimeError("batching stage stalled: requests in flight but no "
                                       "device event or batcher deadline")
                dev.run_until(max(t, dev.now()))

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

    def _done(self, run: _Running, i: int, req: Any, status: int, err: str | None,
              orig: Any) -> None:
        req.on_complete = orig
        run.left -= 1
        if status == rings.OK and run.staging is not None and req.io is not None:
            self.stats.scattered_bytes += scatter_one(req, run.rows0[i], run.served.layout,
                                                      run.staging)
        if status == rings.E_FAILED and run.retry and not req.cancelled:
            self._retry(run.model, req)
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

    def _retry(self, m: ServedModel, req: Any) -> None:
        """Re-run one request of a failed batch alone (isolating the failure)."""
        self.stats.retried += 1
        req.status, req.error = -1, None
        v = m.variants.fit(req.rows, req.seq_len)
        self._run(m, Batch([req], v, t_formed=self.disp.now), retry=False, own=False)

    def _complete(self, req: Any, status: int, err: str) -> None:
        req.status, req.error = status, err
        if req.on_complete is not None:
            req.on_complete(req, status, err)


def layout_of(inputs: list, outputs: list, io_bytes: int) -> IoLayout:
    """An :class:`IoLayout` from a bundle variant's TensorSpecs."""
    from paella.shapes import Slot
    conv = lambda ts: tuple(Slot(t.name, tuple(t.shape), t.dtype, t.offset) for t in ts)  # noqa: E731
    return IoLayout(conv(inputs), conv(outputs), io_bytes)


__all__ = ["BatchStats", "BatchingStage", "BatcherError", "ServedModel", "ServedVariant",
           "layout_of"]
