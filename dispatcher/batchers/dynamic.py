"""The dynamic batcher, with Triton's semantics (``dynamic_batching`` in a Triton model
config): requests queue, and a batch leaves the queue when

* it reaches ``max_batch_size`` rows, or
* its rows are one of ``preferred_batch_sizes``, or
* the oldest request has waited ``max_queue_delay_us`` (then every queued request that
  fits goes, up to ``max_batch_size``);

with no preferred sizes and no delay, whatever is queued goes at once. A batch runs on
the smallest compiled variant that takes its rows (and its longest request's length):
the rows left over are padding, which the stage counts.

``priority_levels`` > 0 keeps one queue per level (1 is the highest, as in Triton);
batches are filled from the highest level first and a request without a level gets
``default_priority_level``. ``max_inflight_batches`` > 0 holds new batches back while
that many of this model's batches run (Triton's model instances): under load requests
then wait in the batcher and leave in full batches instead of queueing as single jobs.

Decisions: a request is never split across batches; the queue is served in arrival
order within a level (a request that does not fit the batch being formed waits for
the next one, the requests behind it do too, so order holds).
"""
from __future__ import annotations

from collections import deque
from typing import Any

from .base import Batch, Batcher, BatcherError, ModelVariants
from .registry import register_batcher


#: Bounds of the options (the queues are scanned per batch; a delay past a day is none).
MAX_PRIORITY_LEVELS = 64
MAX_DELAY_US = 86400e6


@register_batcher("dynamic")
class DynamicBatcher(Batcher):
    def __init__(self, model: ModelVariants, max_batch_size: int = 0,
                 preferred_batch_sizes: list | None = None, max_queue_delay_us: float = 0,
                 priority_levels: int = 0, default_priority_level: int = 0,
                 max_inflight_batches: int = 0):
        super().__init__(model)
        self.max_batch_size = self.max_batch_size_option(max_batch_size)
        prefs = sorted(set(preferred_batch_sizes or ()))
        for p in prefs:
            if not isinstance(p, int) or isinstance(p, bool) or not 1 <= p <= self.max_batch_size:
                raise BatcherError(f"preferred_batch_sizes must be integers in "
                                   f"1..{self.max_batch_size} (max_batch_size), got {p!r}")
        self.preferred = frozenset(prefs)
        if not 0 <= max_queue_delay_us <= MAX_DELAY_US:     # (nan and inf too)
            raise BatcherError(f"max_queue_delay_us must be 0..{MAX_DELAY_US:.0f} (a day), "
                               f"got {max_queue_delay_us}")
        self.delay = max_queue_delay_us * 1e-6
        if not 0 <= priority_levels <= MAX_PRIORITY_LEVELS:
            raise BatcherError(f"priority_levels must be 0..{MAX_PRIORITY_LEVELS} (one queue "
                               f"each, all looked at per batch), got {priority_levels}")
        self.levels = priority_levels
        default = default_priority_level or (priority_levels + 1) // 2
        if priority_levels and not 1 <= default <= priority_levels:
            raise BatcherError(f"default_priority_level must be 1..{priority_levels}, "
                               f"got {default_priority_level}")
        self.default_level = default if priority_levels else 0
        if max_inflight_batches < 0:
            raise BatcherError(f"max_inflight_batches must be >= 0, got {max_inflight_batches}")
        self.max_inflight = max_inflight_batches
        self.inflight = 0
        # One FIFO per level: (arrival time, request).
        self.queues: dict[int, deque[tuple[float, Any]]] = {
            lvl: deque() for lvl in (range(1, priority_levels + 1) if priority_levels else (0,))}
        self._pending = 0

    # -- hooks ---------------------------------------------------------------------------
    def add(self, req: Any, now: float) -> list[Batch]:
        level = self._level(req)
        self.queues[level].append((now, req))
        self._pending += 1
        return self._form(now, expired_only=False)

    def poll(self, now: float) -> list[Batch]:
        return self._form(now, expired_only=False) if self._pending else []

    def deadline(self) -> float | None:
        if not self._pending or (self.max_inflight and self.inflight >= self.max_inflight):
            return None
        return min(q[0][0] for q in self.queues.values() if q) + self.delay

    def batch_done(self, batch: Batch, now: float) -> None:
        self.inflight -= 1

    def remove_client(self, client_id: int) -> list[Any]:
        gone = []
        for lvl, q in self.queues.items():
            keep = deque(e for e in q if e[1].client_id != client_id)
            gone += [e[1] for e in q if e[1].client_id == client_id]
            self.queues[lvl] = keep
        self._pending -= len(gone)
        return gone

    def flush(self, now: float) -> list[Batch]:
        out = []
        while self._pending:
            reqs = self._candidate()
            out.append(self._take(reqs, now))
        return out

    @property
    def pending(self) -> int:
        return self._pending

    # -- forming -------------------------------------------------------------------------
    def _level(self, req: Any) -> int:
        if not self.levels:
            return 0
        lvl = getattr(req, "priority", 0) or self.default_level
        return min(max(int(lvl), 1), self.levels)

    def _candidate(self) -> list[Any]:
        """The requests the next batch would hold: highest level first, arrival order,
        while rows fit max_batch_size and some variant takes them (stopping at the
        first that does not fit, so order holds)."""
        reqs: list[Any] = []
        rows = 0
        seq = 0
        for q in self.queues.values():
            for _, r in q:
                if rows + r.rows > self.max_batch_size or \
                        self.model.fit(rows + r.rows, max(seq, r.seq_len)) is None:
                    return reqs or [r]      # (a lone request always fits: admission checked)
                reqs.append(r)
                rows += r.rows
                seq = max(seq, r.seq_len)
        return reqs

    def _oldest(self) -> float:
        return min(q[0][0] for q in self.queues.values() if q)

    def _form(self, now: float, expired_only: bool) -> list[Batch]:
        out = []
        while self._pending and not (self.max_inflight and self.inflight >= self.max_inflight):
            reqs = self._candidate()
            rows = sum(r.rows for r in reqs)
            full = rows >= self.max_batch_size or len(reqs) < self._pending_count()
            ready = (full or rows in self.preferred
                     or (not self.preferred and self.delay == 0)
                     or now >= self._oldest() + self.delay)
            if not ready:
                break
            out.append(self._take(reqs, now))
        return out

    def _pending_count(self) -> int:
        return self._pending

    def _take(self, reqs: list[Any], now: float) -> Batch:
        ids = {id(r) for r in reqs}
        for lvl, q in self.queues.items():
            while q and id(q[0][1]) in ids:
                q.popleft()
        self._pending -= len(reqs)
        self.inflight += 1
        return Batch(reqs, self.fit(reqs), t_formed=now)
