"""The baseline BatchMaker compares against: graph batching with padding buckets.

A request of length L waits in the bucket of padded length ``ceil(L / width) * width``
(MXNet's and TensorFlow's bucketing; the paper uses width 10). When the worker is idle it
takes the bucket of the oldest waiting request, up to ``max_bs`` of its oldest requests,
and runs the whole padded graph as one task: every member leaves when the longest
(padded) one ends. ``width=None`` pads to the longest member instead (one fused graph,
TensorFlow Fold / DyNet, and the graph batching of Figure 5).

Decision the paper leaves open (docs/step-scheduler.md): the batch is sent as soon as the
worker is idle, with no timeout waiting for it to fill (a timeout would only add latency
at the loads where batches would not fill anyway).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(eq=False)
class GraphTask:
    """One padded graph: ``steps`` cells at batch size ``batch_size``."""
    task_id: int
    members: list[tuple[object, int]]     # (request, its real length)
    steps: int
    batch_size: int
    worker: int
    kind: str = "graph"
    t_start: float = float("nan")
    t_end: float = float("nan")

    @property
    def requests(self) -> list[object]:
        return [r for r, _ in self.members]

    @property
    def padded_cells(self) -> int:
        """Cells computed for padding (wasted work)."""
        return sum(self.steps - n for _, n in self.members)


class _RunToCompletion:
    """What both baselines share: a FIFO of (request, length) run whole, one task per
    batch, every member leaving when the task ends."""

    def __init__(self, max_bs: int):
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        self.max_bs = max_bs
        self.waiting: list[tuple[object, int]] = []      # arrival order
        self._ids = itertools.count()

    def remove(self, req: object) -> None:
        self.waiting = [w for w in self.waiting if w[0] is not req]

    @property
    def pending(self) -> bool:
        return bool(self.waiting)

    def task_done(self, task: GraphTask, now: float = 0.0) -> list[object]:
        return task.requests


class PaddingBatcher(_RunToCompletion):
    """``add((request, length))``; the same worker protocol as the cellular scheduler."""

    def __init__(self, max_bs: int, width: int | None = 10, bsizes: tuple[int, ...] | None = None):
        super().__init__(max_bs)
        if width is not None and width < 1:
            raise ValueError(f"bucket width must be >= 1 or None, got {width}")
        self.width = width
        self.bsizes = tuple(sorted(bsizes)) if bsizes else None

    def bucket(self, length: int) -> int:
        if self.width is None:
            return 0
        return -(-length // self.width) * self.width

    def add(self, item: tuple[object, int], now: float = 0.0) -> None:
        req, length = item
        if length < 1:
            raise ValueError(f"request {req!r}: length must be >= 1, got {length}")
        self.waiting.append((req, length))

    def schedule(self, worker: int, now: float = 0.0) -> list[GraphTask]:
        if not self.waiting:
            return []
        b = self.bucket(self.waiting[0][1])
        chosen = [w for w in self.waiting if self.bucket(w[1]) == b][:self.max_bs]
        for w in chosen:
            self.waiting.remove(w)
        steps = b if self.width is not None else max(n for _, n in chosen)
        size = len(chosen)
        if self.bsizes:
            size = next((s for s in self.bsizes if s >= size), self.bsizes[-1])
        return [GraphTask(next(self._ids), list(chosen), steps, size, worker)]


class RequestBatcher(_RunToCompletion):
    """Request-level batching of generations, the baseline Orca measures against
    (FasterTransformer behind a Triton-like server, §4.5.2): when the engine is idle,
    take up to ``max_bs`` of the oldest requests and run them to completion as one task,
    prompts padded to the longest, as many iterations as the longest output needs; all
    return together. ``add`` takes :class:`~.iteration_scheduler.GenRequest` records."""

    def add(self, req, now: float = 0.0) -> None:
        self.waiting.append((req, req.limit))

    def schedule(self, worker: int, now: float = 0.0) -> list[GraphTask]:
        if not self.waiting:
            return []
        chosen, self.waiting = self.waiting[:self.max_bs], self.waiting[self.max_bs:]
        steps = max(n for _, n in chosen)
        return [GraphTask(next(self._ids), chosen, steps, len(chosen), worker, kind="generation")]

    def task_done(self, task: GraphTask, now: float = 0.0) -> list[object]:
        for r, n in task.members:
            r.generated = n
        return task.requests
