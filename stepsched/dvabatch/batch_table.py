"""DVABatch's batch table and batch queues (paper section 5.2, Figure 8), and the three
meta-operations *new*, *stretch* and *split* on them.

A row of the table is one ongoing batch: its id, its batch size ``bs``, the time it was
made, and its ``status_map`` -- per stage, how many of its queries that stage has
completed. A batch queue sits in front of each stage; an item names a batch and a row
range of it (``id``, ``start``, ``num``). Stage ``s`` pulls an item, runs those rows,
and reports them with :meth:`BatchTable.complete`:

* the last stage: the rows leave (multi-exit); the batch ends when all ``bs`` have;
* another stage, while ``status_map[s] < bs``: the batch was stretched and its late
  rows have not caught up to stage ``s`` yet -- hold (push nothing);
* otherwise the batch is ready for stage ``s + 1``: :meth:`BatchTable.forward` pushes
  the rows stage ``s + 1`` has not been given yet -- all of them merged into one item
  after a catch-up, the paper's ``(id, start=0, num=4)``.

*new* pushes ``(id, 0, bs)`` to the first queue; *stretch* adds queries to the newest
batch and pushes only them, ``(id, old_bs, k)``, to the first queue so they catch up;
*split* cuts a batch that is ready for the next stage into children (the first keeps
the id) that go on as batches of their own, on row ranges of the same buffers. A batch
split or made by a split is never stretched (the paper disables stretch on a batch
with a perceived split).

Rows are numbered within a batch; ``row0`` is where a batch's row 0 sits in its buffer
pair (children of a split sit at offsets of their parent's rows).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class QueueItem:
    """``num`` queries of batch ``id`` from its query ``start`` on (Figure 8's rows)."""
    id: int
    start: int
    num: int


@dataclass(eq=False)
class BatchRow:
    id: int
    bs: int
    time: float                      # when the batch was made (new; a split child: its parent's)
    status_map: list[int]            # per stage: queries completed
    sent: list[int]                  # per stage: queries pushed to that stage's queue
    pair: int
    row0: int = 0                    # its row 0 in the pair's buffers
    queries: list[Any] = field(default_factory=list)
    no_stretch: bool = False
    exited: int = 0
    seq_len: int = 0                 # the length its queries are padded to (0: none)

    def snapshot(self) -> tuple:
        """``(id, bs, status_map)`` as Figure 8 draws a row."""
        return (self.id, self.bs, tuple(self.status_map))


class BatchTable:
    """The batch table and the ``n_stages`` batch queues of one model."""

    def __init__(self, n_stages: int, bs_max: int = 64):
        if n_stages < 1:
            raise ValueError(f"need at least one stage, got {n_stages}")
        self.n_stages, self.bs_max = n_stages, bs_max
        self.rows: dict[int, BatchRow] = {}
        self.queues: list[deque[QueueItem]] = [deque() for _ in range(n_stages)]
        self._next_id = 0
        self._newest: int | None = None          # the batch stretch may join

    # -- meta-operations ------------------------------------------------------------------
    def new(self, queries: list[Any], now: float, pair: int = 0, row0: int = 0,
            seq_len: int = 0) -> BatchRow:
        """A new batch of ``queries``; its first item goes to the first stage's queue."""
        n = len(queries)
        if not 1 <= n <= self.bs_max:
            raise ValueError(f"a batch takes 1..{self.bs_max} queries, got {n}")
        row = BatchRow(self._take_id(), n, now, [0] * self.n_stages, [0] * self.n_stages,
                       pair, row0, list(queries), seq_len=seq_len)
        row.sent[0] = n
        self.rows[row.id] = row
        self._newest = row.id
        self.queues[0].append(QueueItem(row.id, 0, n))
        return row

    @property
    def newest(self) -> int | None:
        """The id of the batch made last by *new* (None once it has left)."""
        return self._newest

    def stretchable(self) -> BatchRow | None:
        """The batch a stretch would join: the newest one, unless it was split (or
        made by a split), has left or is full."""
        row = self.rows.get(self._newest) if self._newest is not None else None
        if row is None or row.no_stretch or row.bs >= self.bs_max:
            return None
        return row

    def stretch(self, batch_id: int, queries: list[Any], seq_len: int = 0,
                busy: QueueItem | None = None) -> QueueItem:
        """Add ``queries`` to batch ``batch_id`` (must be :meth:`stretchable`); they start
        at the first stage and catch up with the batch's own rows. Queries stretched
        one by one join the first queue's last item of the same batch when it directly
        precedes them and the first stage has not started it (``busy``): they catch up
        together."""
        row = self.rows[batch_id]
        if row is not self.stretchable():
            raise ValueError(f"batch {batch_id} cannot be stretched (only the newest "
                             f"unsplit batch below {self.bs_max} queries can)")
        k = len(queries)
        if k < 1 or row.bs + k > self.bs_max:
            raise ValueError(f"stretch of batch {batch_id} by {k} exceeds {self.bs_max} queries")
        q0 = self.queues[0]
        last = q0[-1] if q0 else None
        if last is not None and last is not busy and last.id == row.id \
                and last.start + last.num == row.bs:
            item = QueueItem(row.id, last.start, last.num + k)
            q0[-1] = item
        else:
            item = QueueItem(row.id, row.bs, k)
            q0.append(item)
        row.bs += k
        row.sent[0] += k
        row.queries.extend(queries)
        row.seq_len = max(row.seq_len, seq_len)
        return item

    def split(self, batch_id: int, stage: int, sizes: list[int]) -> list[BatchRow]:
        """Cut batch ``batch_id``, ready for ``stage`` (all its rows done with the stages
        before), into children of ``sizes`` rows; the first keeps the id. Items are not
        pushed here: :meth:`forward` each child."""
        row = self.rows[batch_id]
        if sum(sizes) != row.bs or any(s < 1 for s in sizes):
            raise ValueError(f"split sizes {sizes} do not add up to batch {batch_id}'s {row.bs}")
        if stage < 1 or any(row.status_map[s] != row.bs for s in range(stage)) \
                or any(row.sent[s] for s in range(stage, self.n_stages)):
            raise ValueError(f"batch {batch_id} is not between stages at stage {stage}")
        children, off = [], 0
        for i, size in enumerate(sizes):
            done = [size if s < stage else 0 for s in range(self.n_stages)]
            child = BatchRow(row.id if i == 0 else self._take_id(), size, row.time, done,
                             list(done), row.pair, row.row0 + off,
                             row.queries[off:off + size], no_stretch=True, seq_len=row.seq_len)
            self.rows[child.id] = child
            children.append(child)
            off += size
        return children

    # -- stages -----------------------------------------------------------------------------
    def pull(self, stage: int) -> QueueItem | None:
        q = self.queues[stage]
        return q[0] if q else None

    def complete(self, stage: int, item: QueueItem) -> str:
        """Stage ``stage`` finished ``item`` (taken off its queue here). Returns
        ``"exit"`` (last stage: the rows left), ``"hold"`` (late rows of a stretch have
        not caught up) or ``"ready"`` (call :meth:`forward`, or :meth:`split` first)."""
        q = self.queues[stage]
        if not q or q[0] != item:
            raise ValueError(f"stage {stage} completed {item}, which is not its queue's head")
        q.popleft()
        row = self.rows[item.id]
        row.status_map[stage] += item.num
        if stage == self.n_stages - 1:
            row.exited += item.num
            return "exit"
        return "ready" if row.status_map[stage] == row.bs else "hold"

    def forward(self, batch_id: int, stage: int) -> QueueItem:
        """Push the rows of a ready batch that ``stage`` has not been given yet."""
        row = self.rows[batch_id]
        item = QueueItem(row.id, row.sent[stage], row.bs - row.sent[stage])
        row.sent[stage] = row.bs
        self.queues[stage].append(item)
        return item

    def finished(self, batch_id: int) -> bool:
        row = self.rows[batch_id]
        return row.exited == row.bs

    def leave(self, batch_id: int) -> BatchRow:
        """All of a batch's queries leave before the last stage (they need no more
        stages: multi-exit); the row goes."""
        row = self.rows[batch_id]
        row.exited = row.bs
        return self.remove(batch_id)

    def remove(self, batch_id: int) -> BatchRow:
        row = self.rows.pop(batch_id)
        if self._newest == batch_id:
            self._newest = None
        return row

    def snapshot(self) -> list[tuple]:
        return [r.snapshot() for r in sorted(self.rows.values(), key=lambda r: r.id)]

    def queue_items(self, stage: int) -> list[tuple[int, int, int]]:
        return [(i.id, i.start, i.num) for i in self.queues[stage]]

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1


__all__ = ["BatchRow", "BatchTable", "QueueItem"]
