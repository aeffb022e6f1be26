"""BatchMaker's cellular batching: Algorithm 1 of the paper, line by line.

For every cell type the scheduler keeps a queue of request graphs (oldest first). When a
worker is idle, :meth:`CellularScheduler.schedule` picks one cell type in three tiers
(lines 5-9):

1. a type with at least ``max(Bsizes)`` ready nodes (a full batch);
2. else a type with ready nodes and no task running (nobody is already working on it);
3. else any type with ready nodes;

breaking ties by the type's priority (later cell types first: decoder before encoder,
internal before leaf). :meth:`_batch` then forms up to ``max_tasks_to_submit`` tasks of
that type for the worker; after the first, a task smaller than ``min(Bsizes)`` is not
worth sending and ends the round (line 16). Submitting a node readies its successor in
the same subgraph at once (line 18), so consecutive tasks of one chain go to one worker,
where they run in order: subgraphs are pinned to that worker while they have a task
running there (lines 20-21, 27).

Decisions the paper leaves open (docs/step-scheduler.md): Bsizes may differ per cell type
(the paper's BatchMaker-512,256); a task runs at the smallest supported size that holds it
(padded rows); pins are per subgraph, as in §4.3; graphs of equal arrival keep their
submission order.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .graph import StepGraph, Step


@dataclass(frozen=True)
class CellType:
    """A kind of step with its compiled batch sizes and its priority (higher first)."""
    name: str
    bsizes: tuple[int, ...]
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.bsizes or any(type(b) is not int or b < 1 for b in self.bsizes):
            raise ValueError(f"cell type {self.name!r}: bsizes must be positive ints, got {self.bsizes!r}")
        object.__setattr__(self, "bsizes", tuple(sorted(set(self.bsizes))))

    @property
    def max_bs(self) -> int:
        return self.bsizes[-1]

    @property
    def min_bs(self) -> int:
        return self.bsizes[0]

    def padded(self, n: int) -> int:
        """The compiled batch size a task of ``n`` nodes runs at."""
        return next(b for b in self.bsizes if b >= n)


@dataclass(eq=False)
class Task:
    """A batched step: nodes of one cell type from several requests, run by one worker."""
    task_id: int
    kind: str
    nodes: list[tuple[StepGraph, Step]]
    worker: int
    batch_size: int            # the compiled size it runs at (>= len(nodes))
    t_submit: float = 0.0
    t_start: float = float("nan")
    t_end: float = float("nan")

    @property
    def requests(self) -> list[object]:
        return [g.request for g, _ in self.nodes]


@dataclass
class CellularScheduler:
    cell_types: list[CellType]
    max_tasks_to_submit: int = 5
    queues: dict[str, list[StepGraph]] = field(init=False)
    running: dict[str, int] = field(init=False)
    _pins: dict[tuple[int, int], list[int]] = field(init=False)   # (graph id, subgraph) -> [worker, tasks]
    _ids: itertools.count = field(init=False)

    def __post_init__(self) -> None:
        if self.max_tasks_to_submit < 1:
            raise ValueError(f"max_tasks_to_submit must be >= 1, got {self.max_tasks_to_submit}")
        names = [c.name for c in self.cell_types]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate cell type names: {names}")
        self.types = {c.name: c for c in self.cell_types}
        self.queues = {n: [] for n in names}
        self.running = {n: 0 for n in names}
        self._pins = {}
        self._ids = itertools.count()

    # ---- requests --------------------------------------------------------------------
    def add(self, graph: StepGraph, now: float = 0.0) -> None:
        unknown = graph.kinds() - set(self.types)
        if unknown:
            raise ValueError(f"request {graph.request!r}: unknown cell types {sorted(unknown)}; "
                             f"known: {sorted(self.types)}")
        for kind in sorted(graph.kinds()):
            self.queues[kind].append(graph)

    def remove(self, graph: StepGraph) -> None:
        """Drop a request (its client went away); its running tasks finish without it."""
        for q in self.queues.values():
            if graph in q:
                q.remove(graph)

    def num_ready(self, kind: str) -> int:
        return sum(g.num_ready(kind) for g in self.queues[kind])

    @property
    def pending(self) -> bool:
        return any(self.queues.values())

    # ---- Algorithm 1 -----------------------------------------------------------------
    def schedule(self, worker: int, now: float = 0.0) -> list[Task]:
        """Lines 4-11: the tasks to hand to idle ``worker`` (empty: nothing ready)."""
        ready = {k: self.num_ready(k) for k in self.types}
        s = [k for k in self.types if ready[k] >= self.types[k].max_bs]
        if not s:
            s = [k for k in self.types if self.running[k] == 0 and ready[k] > 0]
        if not s:
            s = [k for k in self.types if ready[k] > 0]
        if not s:
            return []
        ct = max(s, key=lambda k: (self.types[k].priority, -list(self.types).index(k)))
        return self._batch(ct, worker, now)

    def _batch(self, kind: str, worker: int, now: float) -> list[Task]:
        """Lines 12-23."""
        ct = self.types[kind]
        tasks: list[Task] = []
        while len(tasks) < self.max_tasks_to_submit:
            nodes = self._form_batched_task(kind, worker)
            if not nodes or (len(nodes) < ct.min_bs and tasks):
                break
            task = Task(next(self._ids), kind, nodes, worker, ct.padded(len(nodes)), now)
            for g, s in nodes:
                g.submitted(s)                       # UpdateNodesDependency
                pin = self._pins.setdefault((id(g), s.subgraph), [worker, 0])
                pin[1] += 1
                if g.unsubmitted(kind) == 0:         # nothing of this kind left to batch
                    self.queues[kind].remove(g)
            self.running[kind] += 1
            tasks.append(task)
        return tasks

    def _form_batched_task(self, kind: str, worker: int) -> list[tuple[StepGraph, Step]]:
        """Lines 24-31: ready nodes of unpinned (or ours) subgraphs, oldest graph first."""
        batch: list[tuple[StepGraph, Step]] = []
        cap = self.types[kind].max_bs
        for g in self.queues[kind]:
            for s in g.ready(kind):
                pin = self._pins.get((id(g), s.subgraph))
                if pin is not None and pin[0] != worker:
                    continue
                batch.append((g, s))
                if len(batch) == cap:
                    return batch
        return batch

    def task_done(self, task: Task, now: float = 0.0) -> list[object]:
        """The worker finished ``task``: complete its nodes, unpin subgraphs with no task
        left, and return the requests that just finished (they leave at once)."""
        self.running[task.kind] -= 1
        finished = []
        for g, s in task.nodes:
            g.completed(s)
            key = (id(g), s.subgraph)
            pin = self._pins[key]
            pin[1] -= 1
            if pin[1] == 0:
                del self._pins[key]
            if g.finished and g not in finished:
                finished.append(g)
        for g in finished:
            self.remove(g)
        return [g.request for g in finished]
