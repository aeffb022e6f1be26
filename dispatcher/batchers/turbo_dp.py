"""TurboTransformers' batch scheduler for variable-length requests (Fang et al., PPoPP'21,
§4.4, Algorithm 2), as a batcher.

Why: padding every request of a batch to its longest one wastes work that grows with the
spread of lengths, while running requests one by one wastes the GPU's parallelism. With
the queued requests sorted by length, the best split into batches of *neighbours* is a
dynamic program over prefixes (``partition``)::

    state[i] = min over j <= i, i - j + 1 <= max_batch_size of
               state[j - 1] + batch_cost(len[i], i - j + 1)

where ``batch_cost(L, b)`` is the time of one batch of ``b`` requests padded to length
``L`` (the paper's ``cached_cost[L][b] * b``). The paper's table comes from a warm-up
that runs every (length, batch size); here it is each compiled variant's isolated time
on the simulated GPU (``VariantSpec.cost_s``, the time ``paella profile`` reports), the
variant being the smallest length bucket and batch size that take the batch.

Fixed against the paper's listing:

* its backtracking steps to ``start_idx - 1`` after packing ``[start_idx, end_idx)``,
  which skips one request per batch; it must continue at ``start_idx``;
* the recurrence has no bound on a batch's size; ``max_batch_size`` caps it (and the
  largest compiled variant caps that).

When the scheduler runs (§4.4): *hungry* (``trigger="hungry"``) runs it whenever no batch
of this model is running, so the GPU is never idle while requests wait; *lazy*
(``trigger="lazy"``) waits until ``max_batch_size`` requests are queued or the oldest has
waited ``timeout_us``. Either way the *half-SLO rule* (``slo_ms`` > 0) runs it at once
when the oldest request's wait plus the estimated time of the queued work exceeds half
the latency target, since the reordering would otherwise serve early requests late.

Priority classes (issue 38; beyond the paper): the queue is partitioned class by class,
the most urgent class's batches first, and a batch never mixes classes: an urgent request
is neither padded to a less urgent one's length nor made to carry its rows, and the
dispatcher's policy, which orders jobs by class, sees each batch at its own class (a
request naming none counts as 128, ``Job.level``).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from paella.wire import DEFAULT_PRIORITY as DEFAULT_CLASS

from .base import Batch, Batcher, BatcherError, ModelVariants, VariantSpec
from .registry import register_batcher

TRIGGERS = ("hungry", "lazy")


def partition(lengths: Sequence[int], batch_cost: Callable[[int, int], float],
              max_batch_size: int) -> tuple[float, list[tuple[int, int]]]:
    """Algorithm 2 on ``lengths`` sorted ascending: the least total time and the batches
    as half-open index ranges ``[start, end)`` in ascending order. ``batch_cost(L, b)``
    is the time of ``b`` requests padded to ``L`` (``inf`` where no variant takes them).
    O(n * max_batch_size) calls of ``batch_cost``."""
    n = len(lengths)
    if any(lengths[i] > lengths[i + 1] for i in range(n - 1)):
        raise ValueError("partition: lengths must be sorted ascending")
    if max_batch_size < 1:
        raise ValueError(f"partition: max_batch_size must be >= 1, got {max_batch_size}")
    inf = float("inf")
    state = [0.0] + [inf] * n
    start = [0] * (n + 1)
    for i in range(1, n + 1):
        cur = lengths[i - 1]                         # the longest of any batch ending at i
        # j: 1-based first request of the batch ending at i (the paper's loop, capped)
        for j in range(i, max(0, i - max_batch_size), -1):
            c = state[j - 1] + batch_cost(cur, i - j + 1)
            if c < state[i]:
                state[i], start[i] = c, j - 1
    batches: list[tuple[int, int]] = []
    i = n
    while i > 0:                                     # the paper: i = start_idx - 1 (a bug)
        batches.append((start[i], i))
        i = start[i]
    batches.reverse()
    return state[n], batches


@register_batcher("turbo-dp")
class TurboDPBatcher(Batcher):
    """Algorithm 2 with the hungry or lazy trigger and the half-SLO rule (see the module
    docstring). Needs each variant's profiled time (``VariantSpec.cost_s``)."""

    needs_costs = True

    def __init__(self, model: ModelVariants, max_batch_size: int = 0, trigger: str = "hungry",
                 timeout_us: float = 0, slo_ms: float = 0):
        super().__init__(model)
        self.max_batch_size = self.max_batch_size_option(max_batch_size)
        if trigger not in TRIGGERS:
            raise BatcherError(f"trigger must be one of {', '.join(TRIGGERS)}, got {trigger!r}")
        if not timeout_us >= 0 or not slo_ms >= 0:
            raise BatcherError(f"timeout_us and slo_ms must be >= 0 (got {timeout_us}, {slo_ms})")
        missing = [v for v in model.variants if not v.cost_s > 0]
        if missing:
            raise BatcherError(
                f"batcher 'turbo-dp' plans with each variant's profiled time, and "
                f"{len(missing)} variant(s) of {model.name} have none (e.g. rows={missing[0].rows} "
                f"seq_len={missing[0].seq_len}); the daemon profiles each variant at load "
                f"([policy] profile_runs in config.toml must be at least 1)")
        self.trigger, self.timeout = trigger, timeout_us * 1e-6
        self.half_slo = slo_ms * 1e-3 / 2
        self.inflight = 0                            # this model's batches running
        self.queue: list[tuple[float, Any]] = []     # (arrival, request), arrival order
        self._costs: dict[tuple[int, int], float] = {}
        #: Scheduler runs and the batches they formed (the experiment reports them).
        self.runs = 0

    # -- the cost table --------------------------------------------------------------------
    def batch_cost(self, seq_len: int, rows: int) -> float:
        """The paper's ``cached_cost[seq_len][rows] * rows``: the isolated time of the
        smallest variant taking ``rows`` rows of length ``seq_len`` (inf if none)."""
        key = (seq_len, rows)
        c = self._costs.get(key)
        if c is None:
            v: VariantSpec | None = self.model.fit(rows, seq_len)
            c = self._costs[key] = v.cost_s if v is not None else float("inf")
        return c

    # -- hooks -----------------------------------------------------------------------------
    def add(self, req: Any, now: float) -> list[Batch]:
        self.queue.append((now, req))
        return self.poll(now)

    def poll(self, now: float) -> list[Batch]:
        return self._schedule(now) if self.queue and self._due(now) else []

    def deadline(self) -> float | None:
        if not self.queue:
            return None
        oldest = self.queue[0][0]
        times = []
        if self.trigger == "lazy":
            times.append(oldest + self.timeout)
        if self.half_slo:
            times.append(oldest + self.half_slo - self._queued_cost())
        return min(times) if times else None

    def batch_done(self, batch: Batch, now: float) -> None:
        self.inflight -= 1

    def remove_client(self, client_id: int) -> list[Any]:
        gone = [r for _, r in self.queue if r.client_id == client_id]
        self.queue = [e for e in self.queue if e[1].client_id != client_id]
        return gone

    def flush(self, now: float) -> list[Batch]:
        return self._schedule(now) if self.queue else []

    @property
    def pending(self) -> int:
        return len(self.queue)

    # -- when and what -----------------------------------------------------------------------
    def _due(self, now: float) -> bool:
        oldest = self.queue[0][0]
        if self.half_slo and now - oldest + self._queued_cost() >= self.half_slo:
            return True
        if self.trigger == "hungry":
            return self.inflight == 0        # the runtime is idle
        return len(self.queue) >= self.max_batch_size or now - oldest >= self.timeout

    def _queued_cost(self) -> float:
        """The estimated time of the queued requests, each alone (an upper bound the
        half-SLO rule compares; cheap, unlike running the DP)."""
        return sum(self.batch_cost(r.seq_len, r.rows) for _, r in self.queue)

    def _schedule(self, now: float) -> list[Batch]:
        """Run Algorithm 2 over the whole queue, class by class (most urgent first);
        every request leaves in some batch."""
        self.runs += 1
        classes: dict[int, list[Any]] = {}
        for _, r in self.queue:
            classes.setdefault(getattr(r, "priority", 0) or DEFAULT_CLASS, []).append(r)
        self.queue = []
        out = []
        for level in sorted(classes):
            out += self._partition(classes[level], now)
        self.inflight += len(out)
        return out

    def _partition(self, queued: list[Any], now: float) -> list[Batch]:
        """Algorithm 2 over ``queued`` (one class): batches of neighbours in length."""
        reqs = sorted(queued, key=lambda r: r.seq_len)
        lengths = [r.seq_len for r in reqs]
        if all(r.rows == 1 for r in reqs):
            _, ranges = partition(lengths, self.batch_cost, self.max_batch_size)
        else:                                 # multi-row requests: one batch each
            ranges = [(i, i + 1) for i in range(len(reqs))]
        out = []
        for a, b in ranges:
            group = reqs[a:b]
            variant = self.fit(group)
            if variant is None:               # only a lone request too big: admission refuses those
                raise BatcherError(f"no variant of {self.model.name} takes {len(group)} requests "
                                   f"of length {group[-1].seq_len}")
            out.append(Batch(group, variant, t_formed=now))
        return out
