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
        clients' ``model_id``; a model added again takes new requests, queued ones go
        on with the old batcher until flushed (:meth:`replace`)."""
        old = self.models.get(model_id)
        self.models[model_id] = model
        if old is not None and old.batcher.pending:
            self._start(old, old.batcher.flush(self.disp.now))

    # -- requests ----------------------------------------------------------------------------
    def submit(self, req: Any) -> None:
        m = self.models.get(req.model_id)
        if m is None:
            raise ValueError(f"request {req.req_id}: model id {req.model_id} is not batched here")
        if m.variants.fit(req.rows, req.seq_len) is None:
            # The front end checks shapes against the model table; this guards the rest.
            return self._complete(req, rings.E_OPTIONS,
                                  f"no variant of {m.name} takes {req.rows} rows of length "
                                  f"{req.seq_len} (largest: {m.variants.max_rows} rows"
                                  f"{f', length {m.variants.max_seq_len}' if m.variants.has_length else ''})")
        self._queued += 1
        try:
            batches = m.batcher.add(req, self.disp.now)
        except Exception as e:  # noqa: BLE001 - a plug-in's bug fails that request only
            self._queued -= 1
            log.exception("batcher %r of %s failed on a request", m.batcher.name, m.name)
            return self._complete(req, rings.E_INTERNAL,
                                  f"batcher {m.batcher.name!r} failed: {type(e).__name__}: {e}")
        self._start(m, batches)

    def step(self) -> bool:
        """The timer hook: poll every batcher whose deadline has come."""
        now = self.disp.now
        for m in self.models.values():
            b = m.batcher
            if b.pending:
                d = b.deadline()
                if d is not None and d <= now:
                    self._start(m, b.poll(now))
        return self._queued > 0

    def deadline(self) -> float | None:
        """The earliest device time a batcher wants :meth:`step` called (None: none)."""
        ds = [d for m in self.models.values() if m.batcher.pending
              for d in (m.batcher.deadline(),) if d is not None]
        return min(ds) if ds else None

    def cancel_client(self, client_id: int) -> None:
        """The client went away: its queued requests complete as cancelled now, its
        running ones through the dispatcher (a batch goes on for the other clients)."""
        for m in self.models.values():
            for req in m.batcher.remove_client(client_id):
                self._queued -= 1
                self._complete(req, rings.E_CANCELLED, f"cancelled: client {client_id} "
                                                       f"disconnected")
        self.disp.cancel_client(client_id)

    def flush(self) -> None:
        """Start every queued request now (the daemon drains)."""
        for m in self.models.values():
            if m.batcher.pending:
                self._start(m, m.batcher.flush(self.disp.now))

    @property
    def queued(self) -> int:
        return self._queued

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
    def _start(self, m: ServedModel, batches: list[Batch]) -> None:
        for batch in batches:
            self._queued -= len(batch.requests)
            self._run(m, batch, retry=len(batch.requests) > 1)

    def _run(self, m: ServedModel, batch: Batch, retry: bool, own: bool = True) -> None:
        reqs = batch.requests
        v = batch.variant
        sv = m.served.get(v.index) if v is not None else None
        bad = None
        if sv is None or sv.spec != v:
            bad = f"batcher {m.batcher.name!r} chose variant {v!r}, which {m.name} does not have"
        elif batch.rows > v.rows or (v.seq_len and batch.seq_len > v.seq_len) or \
                (not v.seq_len and batch.seq_len):
            bad = (f"batcher {m.batcher.name!r} put {batch.rows} rows of length {batch.seq_len} "
                   f"on variant {v.index} ({v.rows} rows, length {v.seq_len})")
        if bad is not None:
            log.error("%s", bad)
            for req in reqs:
                self._complete(req, rings.E_INTERNAL, bad)
            return
        st = self.stats
        st.batches += 1
        st.requests += len(reqs)
        st.rows += batch.rows
        st.padded_rows += batch.padding
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
            try:
                run.model.batcher.batch_done(run.batch, self.disp.now)
            except Exception:  # noqa: BLE001 - a plug-in's bug must not stop completions
                log.exception("batcher %r batch_done failed", run.model.batcher.name)
            for b in (run.model.batcher.poll(self.disp.now) if run.model.batcher.pending else ()):
                self._start(run.model, [b])

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
