"""The dynamic batcher: Triton's ``dynamic_batching``, field for field, under the same
names in a model's ``config.toml`` (``[batching]``; docs/batching.md has the reference
and where this project differs).

Forming a batch (Triton's *Preferred Batch Sizes* and *Delayed Batching*): the queue is
walked in scheduling order (priority levels highest first; within a level the requests
still within their timeout, then the delayed ones) while the rows fit ``max_batch_size``
and a compiled variant takes them. Then

* if one or more of ``preferred_batch_size`` can be formed, the **largest** of them
  leaves at once (the requests behind it stay queued);
* else if the rows reach ``max_batch_size``, or the next request does not fit (the batch
  cannot grow), the batch leaves at once;
* else it waits while no request of it has waited ``max_queue_delay_microseconds``;
  when that delay has passed it leaves as it is (with no delay, at once).

The queue policy (Triton's ``ModelQueuePolicy``: ``default_queue_policy``, and per
priority level ``priority_queue_policy``): ``max_queue_size`` requests at most per
queue (one more is refused at once); ``default_timeout_microseconds`` in the queue
(a request's own ``timeout_us``, if it carries one, replaces it when shorter and
``allow_timeout_override`` is set); past it, ``timeout_action`` ``REJECT`` answers the
request with an error, ``DELAY`` keeps it, scheduled after the requests of its level
still within their timeout. Refused requests are answered through :attr:`refuse`, set
by the stage that serves the batcher.

``preserve_ordering``: responses go back in the order the requests left the queue, which
(with one priority level and no DELAY, as Triton requires for it) is their arrival
order: a batch that ends first holds its answers until the earlier ones are out.

``max_inflight_batches`` > 0 holds new batches back while that many of this model's
batches run (Triton's model instances: it forms a batch when an instance is free).

Decisions: a request is never split across batches, and the queue keeps its order (a
request that does not fit the batch being formed waits for the next one, and so do the
requests behind it).
"""
from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from typing import Any, Callable

from .base import MAX_DELAY_US, Batch, Batcher, BatcherError, ModelVariants
from .registry import register_batcher

log = logging.getLogger(__name__)

#: Bounds of the options (the queues are scanned per batch; a delay past a day is none).
MAX_PRIORITY_LEVELS = 64
MAX_QUEUE_SIZE = 2 ** 32 - 1                  # Triton's uint32
#: Triton's ModelQueuePolicy, by its names; the values of ``timeout_action``.
POLICY_KEYS = ("allow_timeout_override", "default_timeout_microseconds", "max_queue_size",
               "timeout_action")
TIMEOUT_ACTIONS = ("REJECT", "DELAY")

# Entry states: in its level's queue, in its level's delayed queue, gone (taken, refused
# or removed; left in a deque until it reaches the front).
_QUEUED, _DELAYED, _GONE = 0, 1, 2


class QueuePolicy:
    """One ``ModelQueuePolicy``, checked (``where`` names it in messages)."""

    __slots__ = ("where", "reject", "timeout_us", "allow_override", "max_queue_size")

    def __init__(self, table: Any = None, where: str = "default_queue_policy"):
        self.where = where
        table = {} if table is None else table
        if not isinstance(table, dict):
            raise BatcherError(f"{where} must be a table of {', '.join(POLICY_KEYS)}, "
                               f"got {table!r:.80}")
        for key in table:
            if key not in POLICY_KEYS:
                raise BatcherError(f"{where} has no key {key!r:.60}; valid keys: "
                                   f"{', '.join(POLICY_KEYS)}")
        action = table.get("timeout_action", "REJECT")
        if not isinstance(action, str) or action.upper() not in TIMEOUT_ACTIONS:
            raise BatcherError(f"{where}.timeout_action must be one of "
                               f"{', '.join(TIMEOUT_ACTIONS)}, got {action!r:.60}")
        self.reject = action.upper() == "REJECT"
        timeout = table.get("default_timeout_microseconds", 0)
        if not _is_int(timeout) or not 0 <= timeout <= MAX_DELAY_US:
            raise BatcherError(f"{where}.default_timeout_microseconds must be an integer "
                               f"0..{MAX_DELAY_US:.0f} (microseconds in the queue; 0: no "
                               f"timeout), got {timeout!r:.60}")
        self.timeout_us = timeout
        override = table.get("allow_timeout_override", False)
        if not isinstance(override, bool):
            raise BatcherError(f"{where}.allow_timeout_override must be true or false, "
                               f"got {override!r:.60}")
        self.allow_override = override
        size = table.get("max_queue_size", 0)
        if not _is_int(size) or not 0 <= size <= MAX_QUEUE_SIZE:
            raise BatcherError(f"{where}.max_queue_size must be an integer 0..{MAX_QUEUE_SIZE} "
                               f"(requests; 0: unbounded), got {size!r:.60}")
        self.max_queue_size = size

    @property
    def action(self) -> str:
        return "REJECT" if self.reject else "DELAY"

    def timeout_of(self, req: Any) -> float:
        """The request's timeout in the queue (microseconds; 0: none). Triton's rule: a
        request's own timeout replaces the default only if the override is allowed and
        it is shorter (it may not lengthen it; with no default timeout it has none)."""
        t = self.timeout_us
        if self.allow_override:
            own = getattr(req, "timeout_us", 0)
            if _is_number(own) and 0 < own < t:
                t = own
        return t


class _Entry:
    __slots__ = ("req", "t", "deadline", "state", "level")

    def __init__(self, req: Any, t: float, level: "_Level"):
        self.req, self.t, self.level = req, t, level
        self.deadline = 0.0             # its queue timeout (device seconds; 0: none)
        self.state = _QUEUED


class _Level:
    """One priority level's queue: requests within their timeout, then the delayed."""

    __slots__ = ("number", "policy", "queue", "delayed", "size")

    def __init__(self, number: int, policy: QueuePolicy):
        self.number, self.policy = number, policy
        self.queue: deque[_Entry] = deque()
        self.delayed: deque[_Entry] = deque()
        self.size = 0                   # live entries (both deques): max_queue_size's count

    def tidy(self) -> None:
        q, d = self.queue, self.delayed
        while q and q[0].state != _QUEUED:
            q.popleft()
        while d and d[0].state != _DELAYED:
            d.popleft()


@register_batcher("dynamic")
class DynamicBatcher(Batcher):
    #: How the batcher answers a request it refuses (queue full; queue timeout with
    #: REJECT): ``refuse(req, reason)``, set by the stage serving it, which answers the
    #: request with the reason and forgets it. Without it (a stage that cannot), such a
    #: request is kept instead (DELAY, an unbounded queue) and that is logged once.
    refuse: Callable[[Any, str], None] | None = None

    def __init__(self, model: ModelVariants, max_batch_size: int = 0,
                 preferred_batch_size: list | None = None,
                 max_queue_delay_microseconds: float | None = None,
                 preserve_ordering: bool = False,
                 priority_levels: int = 0, default_priority_level: int = 0,
                 default_queue_policy: dict | None = None,
                 priority_queue_policy: dict | None = None,
                 max_inflight_batches: int = 0,
                 preferred_batch_sizes: list | None = None,
                 max_queue_delay_us: float | None = None):
        super().__init__(model)
        self.max_batch_size = self.max_batch_size_option(max_batch_size)
        # Triton's names, and this project's earlier ones (kept working): one of each pair.
        prefs_key, prefs = _one_of("preferred_batch_size", preferred_batch_size,
                                   "preferred_batch_sizes", preferred_batch_sizes, [])
        if not isinstance(prefs, list):
            raise BatcherError(f"{prefs_key} must be a list of batch sizes, got {prefs!r:.60}")
        for p in prefs:
            if not _is_int(p) or not 1 <= p <= self.max_batch_size:
                raise BatcherError(f"{prefs_key} must be integers in 1..{self.max_batch_size} "
                                   f"(max_batch_size), got {p!r:.60}")
        self.preferred = frozenset(prefs)
        delay_key, delay = _one_of("max_queue_delay_microseconds", max_queue_delay_microseconds,
                                   "max_queue_delay_us", max_queue_delay_us, 0)
        if not _is_number(delay) or not 0 <= delay <= MAX_DELAY_US:     # (nan and inf too)
            raise BatcherError(f"{delay_key} must be 0..{MAX_DELAY_US:.0f} (a day), "
                               f"got {delay!r:.60}")
        self.delay = delay * 1e-6
        if not _is_int(priority_levels) or not 0 <= priority_levels <= MAX_PRIORITY_LEVELS:
            raise BatcherError(f"priority_levels must be 0..{MAX_PRIORITY_LEVELS} (one queue "
                               f"each, all looked at per batch), got {priority_levels}")
        self.levels = priority_levels
        default = default_priority_level or (priority_levels + 1) // 2
        if priority_levels and not 1 <= default <= priority_levels:
            raise BatcherError(f"default_priority_level must be 1..{priority_levels} "
                               f"(priority_levels), got {default_priority_level}")
        self.default_level = default if priority_levels else 0
        base = QueuePolicy(default_queue_policy, "default_queue_policy")
        per_level = self._level_policies(priority_queue_policy)
        if not _is_int(max_inflight_batches) or max_inflight_batches < 0:
            raise BatcherError(f"max_inflight_batches must be >= 0, got {max_inflight_batches}")
        self.max_inflight = max_inflight_batches
        self.inflight = 0
        # One queue per level (one level, 0, without priorities), highest first.
        numbers = range(1, priority_levels + 1) if priority_levels else (0,)
        self._levels = [_Level(n, per_level.get(n, base)) for n in numbers]
        self._by_number = {lvl.number: lvl for lvl in self._levels}
        if not isinstance(preserve_ordering, bool):
            raise BatcherError(f"preserve_ordering must be true or false, "
                               f"got {preserve_ordering!r:.60}")
        if preserve_ordering:
            # Triton's own checks: responses in arrival order need one order of service.
            if priority_levels > 1:
                raise BatcherError(f"preserve_ordering needs at most one priority level "
                                   f"(priority_levels 0 or 1), got priority_levels "
                                   f"{priority_levels}")
            for lvl in self._levels:
                p = lvl.policy
                if p.timeout_us and not p.reject:
                    raise BatcherError(f"preserve_ordering cannot go with {p.where}."
                                       f"timeout_action DELAY (a delayed request would be "
                                       f"answered out of order); use REJECT")
        self.preserve_ordering = preserve_ordering
        self._next_slot = 0             # preserve_ordering: slots given, next to answer
        self._next_out = 0
        self._held: dict[int, tuple] = {}
        self._pending = 0
        self._timeouts: list[tuple[float, int, _Entry]] = []   # (deadline, seq, entry)
        self._seq = 0
        #: When the batch being formed leaves if nothing else happens (None: no wait).
        self._wait_until: float | None = None
        self._warned = False

    def _level_policies(self, table: Any) -> dict[int, QueuePolicy]:
        if table is None:
            return {}
        if not isinstance(table, dict):
            raise BatcherError(f"priority_queue_policy must be a table of priority levels "
                               f"(1..{self.levels or 'priority_levels'}), each a queue "
                               f"policy, got {table!r:.60}")
        out = {}
        for key, policy in table.items():
            level = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
            if not _is_int(level) or not 1 <= level <= self.levels:
                valid = f"1..{self.levels}" if self.levels else "none: priority_levels is 0"
                raise BatcherError(f"priority_queue_policy keys are priority levels "
                                   f"({valid}), got {key!r:.60}")
            out[level] = QueuePolicy(policy, f"priority_queue_policy.{level}")
        return out

    # -- hooks ---------------------------------------------------------------------------
    def add(self, req: Any, now: float) -> list[Batch]:
        if self._timeouts:
            self._expire(now)
        lvl = self._level(req)
        limit = lvl.policy.max_queue_size
        if limit and lvl.size >= limit:
            if self.refuse is not None:
                where = f" at priority level {lvl.number}" if self.levels else ""
                self.refuse(req, f"queue full: {self.model.name} holds max_queue_size={limit} "
                                 f"request(s){where}; retry later")
                return self._form(now)
            self._cannot_refuse("max_queue_size")
        e = _Entry(req, now, lvl)
        timeout = lvl.policy.timeout_of(req)
        if timeout:
            e.deadline = now + timeout * 1e-6
            self._seq += 1
            heapq.heappush(self._timeouts, (e.deadline, self._seq, e))
        lvl.queue.append(e)
        lvl.size += 1
        self._pending += 1
        return self._form(now)

    def poll(self, now: float) -> list[Batch]:
        return self._form(now) if self._pending else []

    def deadline(self) -> float | None:
        if not self._pending:
            return None
        d = None
        if not (self.max_inflight and self.inflight >= self.max_inflight):
            d = self._wait_until
        heap = self._timeouts
        while heap and heap[0][2].state != _QUEUED:
            heapq.heappop(heap)
        if heap and (d is None or heap[0][0] < d):
            d = heap[0][0]
        return d

    def batch_done(self, batch: Batch, now: float) -> None:
        self.inflight -= 1

    def remove_client(self, client_id: int) -> list[Any]:
        gone = []
        for lvl in self._levels:
            for q, live in ((lvl.queue, _QUEUED), (lvl.delayed, _DELAYED)):
                keep = deque()
                for e in q:
                    if e.state != live:
                        continue                # (dead here: dropped)
                    if e.req.client_id == client_id:
                        e.state = _GONE
                        lvl.size -= 1
                        gone.append(e.req)
                    else:
                        keep.append(e)
                q.clear()
                q.extend(keep)
        self._pending -= len(gone)
        if gone and self._pending:
            self._wait_until = 0.0      # look again at once (what is left may go now)
        return gone

    def flush(self, now: float) -> list[Batch]:
        out = []
        while self._pending:
            entries, _, _ = self._walk()
            out.append(self._take(entries, now))
        self._wait_until = None
        return out

    @property
    def pending(self) -> int:
        return self._pending

    # -- the queue policy ----------------------------------------------------------------
    def _level(self, req: Any) -> _Level:
        if not self.levels:
            return self._levels[0]
        # Triton's rule: no priority (0), or one past the levels, is the default level.
        lvl = getattr(req, "priority", 0) or 0
        if not _is_int(lvl) or not 1 <= lvl <= self.levels:
            lvl = self.default_level
        return self._by_number[lvl]

    def _expire(self, now: float) -> None:
        """Requests past their queue timeout: REJECT answers them, DELAY moves them
        behind the requests of their level still within their timeout."""
        heap, refused = self._timeouts, []
        while heap and heap[0][0] <= now:
            _, _, e = heapq.heappop(heap)
            if e.state != _QUEUED:
                continue
            lvl = e.level
            if lvl.policy.reject and self.refuse is not None:
                e.state = _GONE
                lvl.size -= 1
                self._pending -= 1
                refused.append(e)
            else:
                if lvl.policy.reject:
                    self._cannot_refuse("timeout_action REJECT")
                e.state = _DELAYED
                lvl.delayed.append(e)
            lvl.tidy()
        if len(heap) > 64 and len(heap) > 4 * self._pending:    # drop the taken ones
            self._timeouts = heap = [x for x in heap if x[2].state == _QUEUED]
            heapq.heapify(heap)
        for e in refused:
            waited = (now - e.t) * 1e6
            self.refuse(e.req, f"request timeout expired: {waited:.0f} us in the queue of "
                               f"{self.model.name} ({e.level.policy.where}, timeout_action "
                               f"REJECT)")

    def _cannot_refuse(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("dynamic batcher of %s: %s needs a stage that answers refused "
                        "requests, which this one does not: such requests are kept queued "
                        "instead", self.model.name, what)

    # -- forming -------------------------------------------------------------------------
    def _walk(self) -> tuple[list[_Entry], list[int], bool]:
        """The requests the next batch could hold: in scheduling order while their rows fit
        max_batch_size and a variant takes them. Returns them, their cumulative rows, and
        whether a further request is queued that did not fit (the batch cannot grow)."""
        entries: list[_Entry] = []
        rows_at: list[int] = []
        rows = seq = 0
        fit, limit = self.model.fit, self.max_batch_size
        for lvl in self._levels:
            for q, live in ((lvl.queue, _QUEUED), (lvl.delayed, _DELAYED)):
                for e in q:
                    if e.state != live:
                        continue
                    r = e.req
                    n, s = rows + r.rows, max(seq, r.seq_len)
                    # (a lone request always fits: the stage checked its shape)
                    if entries and (n > limit or fit(n, s) is None):
                        return entries, rows_at, True
                    entries.append(e)
                    rows_at.append(n)
                    rows, seq = n, s
        return entries, rows_at, False

    def _form(self, now: float) -> list[Batch]:
        if self._timeouts:
            self._expire(now)
        out = []
        self._wait_until = None
        while self._pending and not (self.max_inflight and self.inflight >= self.max_inflight):
            entries, rows_at, blocked = self._walk()
            best = 0
            if self.preferred:
                for i, rows in enumerate(rows_at):
                    if rows in self.preferred:
                        best = i + 1
            if best:                                    # the largest preferred size: now
                out.append(self._take(entries[:best], now))
                continue
            if rows_at[-1] >= self.max_batch_size or blocked or not self.delay:
                out.append(self._take(entries, now))    # as large as it can be
                continue
            until = min(e.t for e in entries) + self.delay
            if now >= until:                            # the delay is over: as it is
                out.append(self._take(entries, now))
                continue
            self._wait_until = until
            break
        return out

    def _take(self, entries: list[_Entry], now: float) -> Batch:
        touched = set()
        for e in entries:
            e.state = _GONE
            e.level.size -= 1
            touched.add(e.level)
        for lvl in touched:
            lvl.tidy()
        self._pending -= len(entries)
        self.inflight += 1
        reqs = [e.req for e in entries]
        if self.preserve_ordering:
            for req in reqs:
                self._hold_answer(req)
        return Batch(reqs, self.fit(reqs), t_formed=now)

    # -- preserve_ordering ---------------------------------------------------------------
    def _hold_answer(self, req: Any) -> None:
        """Give ``req`` the next answer slot: its completion (however it ends) is passed
        on only once every request that left the queue before it has been answered."""
        slot = self._next_slot
        self._next_slot += 1
        answer = getattr(req, "on_complete", None)

        def complete(r: Any, status: int, error: str | None) -> None:
            r.on_complete = answer
            if slot in self._held or slot < self._next_out:
                return                                  # (answered already)
            self._held[slot] = (answer, r, status, error)
            while self._next_out in self._held:
                cb, rr, st, err = self._held.pop(self._next_out)
                self._next_out += 1
                if cb is not None:
                    cb(rr, st, err)

        req.on_complete = complete


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _one_of(name: str, value: Any, old: str, old_value: Any, default: Any) -> tuple[str, Any]:
    """Triton's option ``name`` or this project's earlier ``old`` for it (not both)."""
    if value is not None and old_value is not None:
        raise BatcherError(f"{name} and {old} are one option (Triton's name and the "
                           f"earlier one): give only {name}")
    if value is not None:
        return name, value
    if old_value is not None:
        return old, old_value
    return name, default
