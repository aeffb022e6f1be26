"""DVABatch's stage executors over one model's stages (paper sections 5-7, Figure 12).

One executor per stage pulls the head of its batch queue, checks that its buffer pair
is legitimate for those rows (:mod:`.buffer_pairs`), runs the stage on them through a
:class:`StageRunner` (its own stream: the runner's business), and on completion updates
the batch table (:mod:`.batch_table`) and applies the policies (:mod:`.diversity`):
split before pushing to the next stage, stretch when a query arrives, new when a
batching window closes and a buffer pair is free.

The pipeline is driven from outside, in whatever clock the runner keeps: ``add(q, now)``
for each query arriving at ``now`` and then ``poll(now)`` (queries that arrive together
batch together), ``poll(now)`` again at ``deadline()`` (a window closing), and the
runner's ``done`` callback when a stage's work ends. Nothing here sleeps or spins, so
the same code runs against a toy timing model (the paper's Figure 3), the simulated GPU
behind the kernel scheduler, or a real device.

A query is any object with ``seq_len`` (0 without a length axis); ``on_exit(q, now)``
is called when it leaves the last stage.

Executor states: ``idle`` (nothing queued), ``checking`` (its queue's head is not
legitimate yet: its rows are not written, its output rows not read, or its batch waits
behind an earlier batch on the same pair -- the paper's serial manner), ``working``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from .batch_table import BatchRow, BatchTable, QueueItem
from .buffer_pairs import BufferPool
from .diversity import group_by_length, length_bucket, may_stretch, split_sizes


class StageRunner(Protocol):
    """Runs ``rows`` rows (padded to ``seq_len``) through stage ``stage``; calls
    ``done()`` once they are finished, or ``done(error)`` if the run failed (its rows
    go on, their queries are reported to ``on_error``).

    A runner that moves real data also defines ``run_at(stage, pair, row, rows,
    seq_len, done)``: the same, told where the rows are -- rows ``row .. row+rows-1``
    of pair ``pair``'s boundary buffers ``stage`` (read) and ``stage + 1`` (written).
    The pipeline calls ``run_at`` when the runner has it."""

    def run(self, stage: int, rows: int, seq_len: int, done: Callable[..., None]) -> None: ...


@dataclass
class DvaConfig:
    """How one model is batched. ``stage_time(stage, bs, seq_len)`` is the profiled
    isolated time of a stage (policy II reads it; so does the default window)."""
    n_stages: int
    stage_time: Callable[[int, int, int], float]
    pairs: int = 2
    bs_max: int = 64
    window: float = 0.0                       # batching window (s) before a *new*
    stretch: bool = True                      # policy III
    t_comp_wait: float = float("inf")         # policy III's bound (s)
    #: stretch only when the late rows can start their catch-up at once (the first
    #: stage is idle or about to run the same batch's catch-up): a catch-up queued
    #: behind other batches holds the stretched batch back as well.
    stretch_idle_only: bool = False
    split: bool = True                        # policy II
    #: policy II's test: split while T_remain(bs) >= split_factor x T_remain(bs/2)
    split_factor: float = 2.0
    length_buckets: tuple[int, ...] = ()      # the compiled lengths (empty: no length axis)
    group_lengths: bool = True                # policy I (False: pad a batch to its longest)
    #: stages a query needs (None: all): a query done after fewer stages leaves there
    #: (multi-exit for input diversity, Figure 3 Case-I's short queries).
    stages_of: Callable[[Any], int] | None = None
    #: a query's priority class (1 the most urgent; None: one class): a new batch takes
    #: the most urgent class waiting, a batch never mixes classes (as turbo-dp's).
    class_of: Callable[[Any], int] | None = None

    def t_remain(self, stage: int, bs: int, seq_len: int) -> float:
        return sum(self.stage_time(s, bs, seq_len) for s in range(stage, self.n_stages))


@dataclass
class Access:
    """One stage execution, for checking hazards from outside: rows ``[row, row+num)``
    of pair ``pair``'s buffer ``stage`` read and of buffer ``stage + 1`` written
    between ``t0`` and ``t1``."""
    stage: int
    pair: int
    row: int
    num: int
    t0: float
    t1: float = float("nan")
    batch: int = -1


@dataclass
class Executor:
    stage: int
    state: str = "idle"
    current: QueueItem | None = None


@dataclass
class PipelineStats:
    new: int = 0
    stretch: int = 0
    split: int = 0
    stage_runs: int = 0
    rows_run: int = 0
    padded_tokens: int = 0          # tokens of padding run (input diversity's waste)
    failed_runs: int = 0            # stage runs whose runner reported an error
    stage_rows: list[int] = field(default_factory=list)   # batch sizes run, per stage run


class DvaPipeline:
    def __init__(self, cfg: DvaConfig, runner: StageRunner,
                 on_exit: Callable[[Any, float], None], clock: Callable[[], float],
                 on_error: Callable[[Any, str], None] | None = None,
                 on_join: Callable[[Any, int, int, int], None] | None = None):
        """``on_exit(q, now)``: ``q`` left (its rows are in its pair's last boundary
        buffer, or the boundary it left at). ``on_error(q, why)``: a stage run holding
        ``q`` failed (its rows still flow; ``on_exit`` still comes). ``on_join(q, pair,
        row, seq_len)``: ``q`` was given row ``row`` of pair ``pair`` in a batch padded to
        ``seq_len`` (new or stretch) -- where a runner moving real data gathers its
        inputs."""
        self.cfg, self.runner, self.on_exit, self.clock = cfg, runner, on_exit, clock
        self.on_error, self.on_join = on_error, on_join
        self._run_at = getattr(runner, "run_at", None)
        self.table = BatchTable(cfg.n_stages, cfg.bs_max)
        # One batch uses rows 0..bs_max-1 of its pair (children at offsets inside).
        self.pool = BufferPool(cfg.n_stages, cfg.pairs, cfg.bs_max)
        self.executors = [Executor(s) for s in range(cfg.n_stages)]
        self.waiting: list[Any] = []
        self._window_start: float | None = None
        self.accesses: list[Access] = []
        self.stats = PipelineStats()
        self.in_flight = 0

    # -- the driver's hooks -------------------------------------------------------------
    def add(self, q: Any, now: float) -> None:
        self.in_flight += 1
        if self.cfg.stretch and not self.waiting and self._try_stretch(q, now):
            return                          # its stage runs start at poll()
        if not self.waiting:
            self._window_start = now
        self.waiting.append(q)

    def poll(self, now: float) -> None:
        self._form(now)
        self._kick(now)

    def flush(self, now: float) -> None:
        """Every waiting query into a batch as soon as a pair is free, without waiting
        for the window (the daemon drains)."""
        self._window_start = -float("inf")
        self.poll(now)

    def withdraw(self, keep: Callable[[Any], bool]) -> list[Any]:
        """Take the waiting queries (not in a batch yet) for which ``keep`` is False
        out of the pipeline and return them (their client went away)."""
        gone = [q for q in self.waiting if not keep(q)]
        if gone:
            self.waiting = [q for q in self.waiting if keep(q)]
            self.in_flight -= len(gone)
            if not self.waiting:
                self._window_start = None
        return gone

    def deadline(self) -> float | None:
        """When the open batching window closes (None: no query waits, or no buffer
        pair is free: a batch leaving calls :meth:`poll` itself)."""
        if not self.waiting or self._window_start is None or self.pool.free_pair() is None:
            return None
        return self._window_start + self.cfg.window

    # -- meta-operations --------------------------------------------------------------
    def _try_stretch(self, q: Any, now: float) -> bool:
        row = self.table.stretchable()
        if row is None or not may_stretch(row.time, now, self.cfg.t_comp_wait):
            return False
        if self.cfg.class_of is not None and row.queries and \
                self.cfg.class_of(row.queries[0]) != self.cfg.class_of(q):
            return False                    # a batch never mixes classes
        if self.cfg.stretch_idle_only and not self._first_stage_free():
            return False
        need = self.cfg.stages_of
        if need is not None and row.queries and need(q) > need(row.queries[-1]):
            return False                    # behind the tail, it would hold the tail's exit
        if self.cfg.length_buckets:
            b = length_bucket(q.seq_len, self.cfg.length_buckets)
            if b > row.seq_len or (self.cfg.group_lengths and b != row.seq_len):
                return False                # joining would pad it (policy I first)
        start = row.bs
        self.table.stretch(row.id, [q], row.seq_len, busy=self.executors[0].current)
        self.pool.load_inputs(row.pair, row.row0 + start, 1)
        if self.on_join is not None:
            self.on_join(q, row.pair, row.row0 + start, row.seq_len)
        self.stats.stretch += 1
        return True

    def _first_stage_free(self) -> bool:
        """The first stage could start a catch-up now: idle, or its queue ends with
        an item of the newest batch not started yet (the new rows join that item)."""
        ex, q = self.executors[0], self.table.queues[0]
        if not q:
            return ex.state != "working"
        last = q[-1]
        return last is not ex.current and last.id == self.table.newest

    def _form(self, now: float) -> None:
        """*new*: batches of the waiting queries once the window closed (or a full
        batch waits) and a buffer pair is free; one batch per length group."""
        cfg = self.cfg
        while self.waiting:
            due = None if self._window_start is None else self._window_start + cfg.window
            if len(self.waiting) < cfg.bs_max and due is not None and now < due:
                return
            pair = self.pool.free_pair()
            if pair is None:
                return
            waiting = self.waiting
            if cfg.class_of is not None:   # the most urgent class first, never mixed
                top = min(map(cfg.class_of, waiting))
                waiting = [q for q in waiting if cfg.class_of(q) == top]
            take = waiting[:cfg.bs_max]
            if cfg.group_lengths:         # the oldest query's group first (no starving)
                first = length_bucket(take[0].seq_len, cfg.length_buckets)
                bucket, group = next(g for g in group_by_length(take, cfg.length_buckets)
                                     if g[0] == first)
            else:
                bucket, group = length_bucket(max(q.seq_len for q in take),
                                              cfg.length_buckets), take
            ids = {id(q) for q in group}
            self.waiting = [q for q in self.waiting if id(q) not in ids]
            if cfg.stages_of is not None:    # the queries leaving first at the tail
                group.sort(key=cfg.stages_of, reverse=True)
            row = self.table.new(group, now, pair, seq_len=bucket)
            self.pool.claim(pair, row.id)
            self.pool.load_inputs(pair, row.row0, row.bs)
            if self.on_join is not None:
                for k, q in enumerate(row.queries):
                    self.on_join(q, pair, row.row0 + k, row.seq_len)
            self.stats.new += 1
            # The rest of the window's queries are due at once (their window closed).
            self._kick(now)
        self._window_start = None

    # -- executors --------------------------------------------------------------------
    def _kick(self, now: float) -> None:
        for ex in self.executors:
            if ex.state == "working":
                continue
            item = self.table.pull(ex.stage)
            if item is None:
                ex.state = "idle"
                continue
            row = self.table.rows[item.id]
            if not self._legitimate(row, ex.stage, item):
                ex.state = "checking"
                continue
            self._start(ex, row, item, now)

    def _legitimate(self, row: BatchRow, stage: int, item: QueueItem) -> bool:
        # Serial manner: batches sharing a pair (a split's children) run in order.
        if row.id != min(self.pool.owners[row.pair]):
            return False
        return self.pool.legitimate(row.pair, stage, row.row0 + item.start, item.num)

    def _start(self, ex: Executor, row: BatchRow, item: QueueItem, now: float) -> None:
        ex.state, ex.current = "working", item
        self.pool.begin_stage(row.pair, ex.stage, row.row0 + item.start, item.num)
        acc = Access(ex.stage, row.pair, row.row0 + item.start, item.num, now, batch=row.id)
        self.accesses.append(acc)
        st = self.stats
        st.stage_runs += 1
        st.rows_run += item.num
        st.stage_rows.append(item.num)
        if row.seq_len:
            st.padded_tokens += sum(row.seq_len - q.seq_len
                                    for q in row.queries[item.start:item.start + item.num])
        def done(error: str | None = None) -> None:
            self._done(ex, row, item, acc, error)
        if self._run_at is not None:
            self._run_at(ex.stage, row.pair, row.row0 + item.start, item.num, row.seq_len, done)
        else:
            self.runner.run(ex.stage, item.num, row.seq_len, done)

    def _done(self, ex: Executor, row: BatchRow, item: QueueItem, acc: Access,
              error: str | None = None) -> None:
        now = self.clock()
        acc.t1 = now
        if error is not None:
            self.stats.failed_runs += 1
            if self.on_error is not None:
                for q in row.queries[item.start:item.start + item.num]:
                    self.on_error(q, error)
        ex.state, ex.current = "idle", None
        stage = ex.stage
        self.pool.end_stage(row.pair, stage, row.row0 + item.start, item.num)
        outcome = self.table.complete(stage, item)
        if outcome == "exit":
            self.pool.take_outputs(row.pair, row.row0 + item.start, item.num)
            for q in row.queries[item.start:item.start + item.num]:
                self.in_flight -= 1
                self.on_exit(q, now)
            if self.table.finished(row.id):
                self.table.remove(row.id)
                self.pool.release(row.pair, row.id)
        elif outcome == "ready":
            self._advance(row, stage + 1, now)
        self._form(now)
        self._kick(now)

    def _advance(self, row: BatchRow, stage: int, now: float) -> None:
        """Early exits, then policy II, before the push to ``stage`` -- only when the
        whole batch moves on: late rows of a stretch catching up to where the batch's
        first rows already are just follow them."""
        if row.sent[stage]:
            self.table.forward(row.id, stage)
            return
        row = self._exit_early(row, stage, now)
        if row is None:
            return
        sizes = [row.bs]
        if self.cfg.split:
            sizes = split_sizes(row.bs, lambda b: self.cfg.t_remain(stage, b, row.seq_len),
                                self.cfg.split_factor)
        if len(sizes) == 1:
            self.table.forward(row.id, stage)
            return
        self.stats.split += 1
        for child in self.table.split(row.id, stage, sizes):
            self.pool.claim(child.pair, child.id)
            self.table.forward(child.id, stage)

    def _exit_early(self, row: BatchRow, stage: int, now: float) -> BatchRow | None:
        """The batch's tail rows whose queries need no stage from ``stage`` on leave now
        (split off and taken from buffer ``stage``); returns what goes on, or None."""
        need = self.cfg.stages_of
        if need is None:
            return row
        k = 0
        for q in reversed(row.queries):
            if need(q) > stage:
                break
            k += 1
        if k == 0:
            return row
        if k < row.bs:
            self.stats.split += 1
            rest, tail = self.table.split(row.id, stage, [row.bs - k, k])
            self.pool.claim(tail.pair, tail.id)
        else:
            rest, tail = None, row
        self.pool.take_outputs(tail.pair, tail.row0, tail.bs, boundary=stage)
        for q in tail.queries:
            self.in_flight -= 1
            self.on_exit(q, now)
        self.table.leave(tail.id)
        self.pool.release(tail.pair, tail.id)
        return rest

    @property
    def idle(self) -> bool:
        return self.in_flight == 0


def check_hazards(accesses: Sequence[Access]) -> list[str]:
    """Independent of the buffer states: every pair of stage executions that overlap in
    time and touch overlapping rows of one buffer (one writing it) is a hazard, as is a
    read of rows no earlier execution wrote (stage > 0). Returns the hazards found."""
    found = []
    acc = sorted(accesses, key=lambda a: a.t0)
    eps = 1e-12
    for i, a in enumerate(acc):
        for b in acc[i + 1:]:
            if b.t0 >= a.t1 - eps:
                break
            if a.pair != b.pair or a.row + a.num <= b.row or b.row + b.num <= a.row:
                continue
            a_bufs = {a.stage: "r", a.stage + 1: "w"}
            b_bufs = {b.stage: "r", b.stage + 1: "w"}
            for buf in set(a_bufs) & set(b_bufs):
                if "w" in (a_bufs[buf], b_bufs[buf]):
                    kind = "RAW" if (a_bufs[buf], b_bufs[buf]) == ("w", "r") else \
                        "WAR" if (a_bufs[buf], b_bufs[buf]) == ("r", "w") else "WAW"
                    found.append(f"{kind} on pair {a.pair} buffer {buf}: stage {a.stage} "
                                 f"[{a.t0}, {a.t1}) and stage {b.stage} [{b.t0}, {b.t1})")
    for a in acc:
        if a.stage == 0:
            continue
        for r in range(a.row, a.row + a.num):
            writers = [w for w in acc if w.stage == a.stage - 1 and w.pair == a.pair
                       and w.row <= r < w.row + w.num and w.t1 <= a.t0 + eps]
            if not writers:
                found.append(f"RAW on pair {a.pair} buffer {a.stage}: row {r} read at "
                             f"{a.t0} before any write finished")
    return found


__all__ = ["Access", "DvaConfig", "DvaPipeline", "Executor", "PipelineStats", "StageRunner",
           "check_hazards"]
