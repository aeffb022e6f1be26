"""DVABatch's buffer pairs (paper section 6.1) and their state machine, per row.

Stage ``k`` of an ``N``-stage model reads boundary buffer ``k`` and writes boundary
buffer ``k + 1`` of the *pair* its batch runs on (boundary 0 is the batch's inputs,
boundary ``N`` its outputs). Stage ``k``'s output buffer is stage ``k + 1``'s input
buffer: that is where the read-after-write (RAW) and write-after-read (WAR) hazards
between stages are, and what the states prevent.

The paper keeps one state per buffer as one executor sees it. Here every buffer keeps
one state *per row*, because DVABatch's own operations work on row ranges: a stretched
batch's late rows catch up through the same buffers while its first rows are read by a
later stage, and the children of a split read disjoint rows of one buffer. The four
states keep the paper's names and its legitimacy rule (an executor runs only with an
*available* input and an *invalid* output):

* ``INVALID``     -- holds nothing a stage may read (initial; consumed). May be written.
* ``IN_WRITING``  -- a stage writes it. Nobody may read or write it.
* ``AVAILABLE``   -- written and complete, not yet read: the next stage may read it,
                     nobody may write it (that would lose unread data: WAR).
* ``IN_READING``  -- a stage reads it. Nobody may write it.

Legal transitions, per row: INVALID -> IN_WRITING -> AVAILABLE -> IN_READING -> INVALID.
Anything else raises :class:`HazardError`. (The paper also lets an executor write into
an output it calls available; its states are per executor's view, ours per buffer, so
an AVAILABLE row here always holds unread data and writing it would be a WAR hazard.)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class BufferState(enum.Enum):
    INVALID = "invalid"
    IN_WRITING = "in-writing"
    AVAILABLE = "available"
    IN_READING = "in-reading"


#: The only state changes a row may make.
LEGAL = {
    (BufferState.INVALID, BufferState.IN_WRITING),
    (BufferState.IN_WRITING, BufferState.AVAILABLE),
    (BufferState.AVAILABLE, BufferState.IN_READING),
    (BufferState.IN_READING, BufferState.INVALID),
}


class HazardError(RuntimeError):
    """A stage tried to read a row not written yet (RAW), to write a row not read yet
    (WAR), or to touch a row another stage is using."""


@dataclass
class Buffer:
    """One boundary buffer of one pair: ``rows`` rows, each with its state."""
    pair: int
    boundary: int
    rows: int
    states: list[BufferState] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.states:
            self.states = [BufferState.INVALID] * self.rows

    def can(self, start: int, num: int, to: BufferState) -> bool:
        """Whether rows ``start .. start+num-1`` may all move to ``to`` now."""
        if start < 0 or num < 1 or start + num > self.rows:
            return False
        return all((s, to) in LEGAL for s in self.states[start:start + num])

    def move(self, start: int, num: int, to: BufferState) -> None:
        if not self.can(start, num, to):
            seen = sorted({s.value for s in self.states[max(start, 0):start + num]})
            raise HazardError(f"pair {self.pair} buffer {self.boundary}: rows {start}.."
                              f"{start + num - 1} cannot become {to.value} (they are "
                              f"{', '.join(seen) or 'out of range'})")
        for r in range(start, start + num):
            self.states[r] = to

    @property
    def state(self) -> BufferState:
        """The buffer's state as the paper names one: the busiest of its rows'."""
        for s in (BufferState.IN_WRITING, BufferState.IN_READING, BufferState.AVAILABLE):
            if s in self.states:
                return s
        return BufferState.INVALID

    @property
    def clean(self) -> bool:
        return all(s is BufferState.INVALID for s in self.states)


class BufferPool:
    """``pairs`` buffer pairs of an ``n_stages``-stage model, ``rows`` rows each.

    A batch owns one pair from its *new* until its last row has left the last stage;
    the children of its *split* and the late rows of its *stretch* use the same pair at
    other row offsets. A new batch needs a pair no batch owns: with one pair the
    batches run one after another (the paper's serial manner), with two one batch can
    enter while the other is still in later stages (its parallel manner)."""

    def __init__(self, n_stages: int, pairs: int, rows: int):
        if n_stages < 1 or pairs < 1 or rows < 1:
            raise ValueError(f"need >= 1 stage, pair and row (got {n_stages}, {pairs}, {rows})")
        self.n_stages, self.rows = n_stages, rows
        self.buffers = [[Buffer(p, b, rows) for b in range(n_stages + 1)] for p in range(pairs)]
        self.owners: list[set[int]] = [set() for _ in range(pairs)]   # batch ids per pair

    @property
    def pairs(self) -> int:
        return len(self.buffers)

    def free_pair(self) -> int | None:
        """A pair no batch owns (lowest first), or None."""
        for p, owners in enumerate(self.owners):
            if not owners:
                return p
        return None

    def claim(self, pair: int, batch_id: int) -> None:
        self.owners[pair].add(batch_id)

    def release(self, pair: int, batch_id: int) -> None:
        """A batch left the pipeline; its pair is free once no batch owns it (every row
        must be INVALID again by then: nothing written is left unread)."""
        self.owners[pair].discard(batch_id)
        if not self.owners[pair]:
            dirty = [b.boundary for b in self.buffers[pair] if not b.clean]
            if dirty:
                raise HazardError(f"pair {pair} freed with unread rows in buffers {dirty}")

    # -- the stage-facing operations ---------------------------------------------------
    def legitimate(self, pair: int, stage: int, start: int, num: int) -> bool:
        """The paper's rule: stage ``stage`` may run rows ``start .. start+num-1`` on
        ``pair`` when those rows of its input are available and of its output invalid."""
        bufs = self.buffers[pair]
        return (bufs[stage].can(start, num, BufferState.IN_READING)
                and bufs[stage + 1].can(start, num, BufferState.IN_WRITING))

    def begin_stage(self, pair: int, stage: int, start: int, num: int) -> None:
        bufs = self.buffers[pair]
        if not self.legitimate(pair, stage, start, num):
            # Let move() say which side is wrong.
            bufs[stage].move(start, num, BufferState.IN_READING)
            bufs[stage + 1].move(start, num, BufferState.IN_WRITING)
        bufs[stage].move(start, num, BufferState.IN_READING)
        bufs[stage + 1].move(start, num, BufferState.IN_WRITING)

    def end_stage(self, pair: int, stage: int, start: int, num: int) -> None:
        bufs = self.buffers[pair]
        bufs[stage].move(start, num, BufferState.INVALID)
        bufs[stage + 1].move(start, num, BufferState.AVAILABLE)

    def load_inputs(self, pair: int, start: int, num: int) -> None:
        """The batch's inputs are gathered into boundary 0 (new, stretch)."""
        b = self.buffers[pair][0]
        b.move(start, num, BufferState.IN_WRITING)
        b.move(start, num, BufferState.AVAILABLE)

    def take_outputs(self, pair: int, start: int, num: int, boundary: int | None = None) -> None:
        """The rows' outputs are scattered to their requests from boundary N (or from
        an earlier one: queries that need no more stages leave there)."""
        b = self.buffers[pair][self.n_stages if boundary is None else boundary]
        b.move(start, num, BufferState.IN_READING)
        b.move(start, num, BufferState.INVALID)


__all__ = ["LEGAL", "Buffer", "BufferPool", "BufferState", "HazardError"]
