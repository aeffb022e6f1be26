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
from dataclasses import dataclass, field


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
    #: What the graph runs, in order, when it has several cell types or batch sizes:
    #: ``(cell type, batch size, repeats)`` (empty: ``steps`` cells of ``kind``).
    parts: list[tuple[str, int, int]] = field(default_factory=list)

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


def _fit(n: int, bsizes: tuple[int, ...]) -> list[int]:
    """``n`` cells as compiled batch sizes: chunks of the largest, the rest padded up."""
    out, top = [], bsizes[-1]
    while n > top:
        out.append(top)
        n -= top
    if n:
        out.append(next(b for b in bsizes if b >= n))
    return out


class Seq2SeqPadding(_RunToCompletion):
    """Graph batching with padding for Seq2Seq (MXNet's and TensorFlow's bucketing, §7.4):
    a request of ``src`` source and ``tgt`` target tokens waits in the bucket
    ``(ceil(src / width) * width, ceil(tgt / width) * width)``; when the worker is idle,
    up to ``max_bs`` of the oldest requests of the oldest one's bucket run as one graph:
    the padded encoder steps, then the padded decoder steps, every cell at the batch's
    compiled size (one ``max_bs`` for both: graph batching has one batch size per
    graph). All leave when it ends. ``add((request, src, tgt))``."""

    def __init__(self, max_bs: int, width: int = 10, bsizes: tuple[int, ...] | None = None):
        super().__init__(max_bs)
        self.width = width
        self.bsizes = tuple(sorted(bsizes)) if bsizes else (max_bs,)

    def bucket(self, src: int, tgt: int) -> tuple[int, int]:
        w = self.width
        return -(-src // w) * w, -(-tgt // w) * w

    def add(self, item: tuple[object, int, int], now: float = 0.0) -> None:
        req, src, tgt = item
        if src < 1 or tgt < 1:
            raise ValueError(f"request {req!r}: lengths must be >= 1, got {src}, {tgt}")
        self.waiting.append((req, (src, tgt)))

    def schedule(self, worker: int, now: float = 0.0) -> list[GraphTask]:
        if not self.waiting:
            return []
        b = self.bucket(*self.waiting[0][1])
        chosen = [w for w in self.waiting if self.bucket(*w[1]) == b][:self.max_bs]
        for w in chosen:
            self.waiting.remove(w)
        size = next((s for s in self.bsizes if s >= len(chosen)), self.bsizes[-1])
        members = [(r, s + t) for r, (s, t) in chosen]
        return [GraphTask(next(self._ids), members, b[0] + b[1], size, worker, kind="seq2seq",
                          parts=[("encoder", size, b[0]), ("decoder", size, b[1])])]


class TreeGraphBatcher(_RunToCompletion):
    """Graph batching of trees (TensorFlow Fold's dynamic batching, DyNet's on-the-fly
    batching, §7.5): when the worker is idle, up to ``max_trees`` of the oldest trees are
    merged into one graph run level by level (a node's level: 0 at a leaf, one above its
    highest child otherwise); each level's cells of one type run batched, in chunks of the
    largest compiled size, the last chunk padded up. All leave when the graph ends.
    ``add((request, parents))`` (a parent-index array, -1 at the root)."""

    def __init__(self, max_trees: int, bsizes: dict[str, tuple[int, ...]]):
        super().__init__(max_trees)
        self.bsizes = {k: tuple(sorted(v)) for k, v in bsizes.items()}

    def add(self, item: tuple[object, list[int]], now: float = 0.0) -> None:
        self.waiting.append(item)

    @staticmethod
    def levels(parents: list[int]) -> list[int]:
        """Each node's level (leaves 0)."""
        from .graph import tree_order
        level = [0] * len(parents)
        for i in tree_order(parents):        # children first
            p = parents[i]
            if p >= 0:
                level[p] = max(level[p], level[i] + 1)
        return level

    def schedule(self, worker: int, now: float = 0.0) -> list[GraphTask]:
        if not self.waiting:
            return []
        chosen, self.waiting = self.waiting[:self.max_bs], self.waiting[self.max_bs:]
        count: dict[int, int] = {}
        for _, parents in chosen:
            for lv in self.levels(parents):
                count[lv] = count.get(lv, 0) + 1
        parts = []
        for lv in sorted(count):
            kind = "leaf" if lv == 0 else "internal"
            parts += [(kind, b, 1) for b in _fit(count[lv], self.bsizes[kind])]
        members = [(r, len(p)) for r, p in chosen]
        return [GraphTask(next(self._ids), members, len(parts), len(chosen), worker,
                          kind="treegraph", parts=parts)]
