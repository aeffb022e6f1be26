"""The per-client segment: request ring, completion ring, data arena.

One segment per client connection, created by the daemon as a sealed memfd (see
``paella.dispatcher.frontend``: ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``, so no
one can change its size) and handed to the client over the control socket (see
``paella.wire``). It has no name in any file system and goes away with the last
descriptor and mapping. Both sides map it and see it through numpy views; nothing is
serialized.

Layout (all integers little-endian, offsets in bytes)::

    0     header     uint32 magic 'PAEL', uint32 version, uint32 req_slots,
                     uint32 cmp_slots, uint64 arena_offset, uint64 arena_bytes
    64    sleeping   uint64  daemon writes 1 before it blocks, 0 when it runs again
    128   req_head   uint64  consumer index of the request ring     (daemon writes)
    192   req_tail   uint64  producer index of the request ring     (client writes)
    256   cmp_head   uint64  consumer index of the completion ring  (client writes)
    320   cmp_tail   uint64  producer index of the completion ring  (daemon writes)
    384   request ring      req_slots x 4 uint64 {req_id, model_id | options << 32,
                                                  offset, length}
    ...   completion ring   cmp_slots x 2 uint64 {req_id, status | msg_len << 32}
                                                 (PROGRESS: {req_id, PROGRESS | n << 32})
    ...   completion text   cmp_slots x MSG_BYTES  the daemon's reason for an error
    ...   arena             arena_bytes, 4096-aligned: inputs and outputs live here

Each index sits on its own 64-byte line so producer and consumer never share one.
Indices run freely (mod 2**64); slot = index & (slots - 1). Both rings are single-
producer single-consumer: the producer writes the entry, then stores the new tail; the
consumer reads the tail, the entry, then stores the new head. On x86 (total store
order) the two stores become visible in program order, which is all an SPSC ring
needs; a weakly ordered CPU would need a release/acquire fence here.

**Index stores are single aligned 8-byte stores**, on both sides: every index is
written through the aligned native-endian uint64 view ``Segment.hdr`` (numpy's
setitem then stores through a ``uint64*``: one ``mov``), never byte by byte
(``struct.pack_into`` copies through ``memcpy``, which may split the word). A reader
can therefore never see half of an old index and half of a new one; a client whose
stores tear breaks this contract and is dropped like any other corrupt ring.

**Progress entries** (streaming): for a request sent with ``paella.wire.STREAM``, the
daemon may push entries of status :data:`PROGRESS` before its completion; the upper
32 bits carry ``n``, the number of outputs valid in the request's io region so far
(cumulative, never decreasing). They are not completions: the request's one
completion still follows. The front end reserves one completion slot per request in
flight and pushes a progress entry only into a slot beyond those reservations; when
the ring has none free (a client that does not read), the entry is skipped, and the
next one -- or the completion -- covers it. So a client that never reads its ring
can never stall the daemon, and the final answer is never dropped.

The daemon never trusts what a client may write, at any moment, to any byte: it keeps
its own copy of the layout (:class:`Layout`) and of the indices it owns, reads each
client-written index (``req_tail``, ``cmp_head``) and each request entry exactly once
into a private copy and validates that copy (:class:`RingCorrupt`), never reading the
same word twice. The head of the completion ring may only move forward, and never
past the tail.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAGIC = 0x4C454150  # b"PAEL" little-endian
VERSION = 1

HEADER_BYTES = 384
#: The largest data arena a segment may have (offsets and lengths are checked against it).
MAX_ARENA_BYTES = 1 << 40
SLEEPING = 64 // 8       # uint64 word indices into the header
REQ_HEAD = 128 // 8
REQ_TAIL = 192 // 8
CMP_HEAD = 256 // 8
CMP_TAIL = 320 // 8

REQ_WORDS = 4            # uint64 words per request entry
CMP_WORDS = 2            # uint64 words per completion entry
MSG_BYTES = 120          # reason text per completion slot (UTF-8, truncated)
ARENA_ALIGN = 4096
U64 = (1 << 64) - 1
U32 = (1 << 32) - 1

# --- completion status codes (0 is success; the text area carries the detail) -------
OK = 0
E_MODEL = 1        # unknown model id
E_RANGE = 2        # [offset, offset + length) not inside the client's arena
E_LENGTH = 3       # length differs from the model's io size
E_OPTIONS = 4      # refused as asked: unknown option bits, a bad shape or variant, bad values
E_DUPLICATE = 5    # request id already in flight for this client
E_FAILED = 6       # the job failed while running
E_CANCELLED = 7    # the daemon cancelled the job (shutdown deadline)
E_INTERNAL = 8     # a daemon bug; the text says what
PROGRESS = 9       # not a completion: n outputs valid so far (n in the text-length word)

STATUS_NAMES = {OK: "OK", E_MODEL: "unknown model", E_RANGE: "io region outside the arena",
                E_LENGTH: "wrong io length", E_OPTIONS: "refused (bad options or values)",
                E_DUPLICATE: "duplicate request id", E_FAILED: "job failed",
                E_CANCELLED: "cancelled", E_INTERNAL: "internal error", PROGRESS: "progress"}


class RingCorrupt(RuntimeError):
    """A ring index in shared memory is impossible (e.g. more entries than slots)."""


@dataclass(frozen=True)
class Layout:
    """Sizes of one client segment; the offsets follow from them."""
    req_slots: int = 1024
    cmp_slots: int = 1024
    arena_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        for name in ("req_slots", "cmp_slots", "arena_bytes"):
            if type(getattr(self, name)) is not int:      # (a bool is an int subclass)
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("req_slots", "cmp_slots"):
            v = getattr(self, name)
            if v < 2 or v & (v - 1) or v > (1 << 20):
                raise ValueError(f"{name} must be a power of two in 2..2**20, got {v}")
        if not 0 < self.arena_bytes <= MAX_ARENA_BYTES:
            raise ValueError(f"arena_bytes must be in 1..2**40, got {self.arena_bytes}")

    @property
    def req_offset(self) -> int:
        return HEADER_BYTES

    @property
    def cmp_offset(self) -> int:
        return self.req_offset + 8 * REQ_WORDS * self.req_slots

    @property
    def msg_offset(self) -> int:
        return self.cmp_offset + 8 * CMP_WORDS * self.cmp_slots

    @property
    def arena_offset(self) -> int:
        end = self.msg_offset + MSG_BYTES * self.cmp_slots
        return -(-end // ARENA_ALIGN) * ARENA_ALIGN

    @property
    def total_bytes(self) -> int:
        return self.arena_offset + self.arena_bytes

    def to_dict(self) -> dict:
        return {"req_slots": self.req_slots, "cmp_slots": self.cmp_slots,
                "arena_bytes": self.arena_bytes}

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        try:
            return cls(d["req_slots"], d["cmp_slots"], d["arena_bytes"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad segment layout {d!r}: {e}") from None


class Segment:
    """numpy views over one mapped segment. ``buf`` is any writable buffer (an mmap).

    ``hdr`` is the aligned uint64 view through which both sides load and store the
    indices (one 8-byte access each, see the module docstring)."""

    def __init__(self, buf, layout: Layout):
        if len(buf) < layout.total_bytes:
            raise ValueError(f"segment of {len(buf)} bytes is smaller than its layout "
                             f"({layout.total_bytes} bytes)")
        self.layout = layout
        self.buf = buf
        self.hdr = np.ndarray((HEADER_BYTES // 8,), np.uint64, buf, 0)
        if not self.hdr.flags.aligned:
            raise ValueError("segment buffer is not 8-byte aligned: index stores could tear")
        self.req = np.ndarray((layout.req_slots, REQ_WORDS), np.uint64, buf, layout.req_offset)
        self.cmp = np.ndarray((layout.cmp_slots, CMP_WORDS), np.uint64, buf, layout.cmp_offset)
        self.msg = np.ndarray((layout.cmp_slots, MSG_BYTES), np.uint8, buf, layout.msg_offset)
        self.arena = np.ndarray((layout.arena_bytes,), np.uint8, buf, layout.arena_offset)
        self.req_mask = layout.req_slots - 1
        self.cmp_mask = layout.cmp_slots - 1

    def init_header(self) -> None:
        """Daemon side, once, on a fresh (zeroed) segment."""
        h32 = np.ndarray((4,), np.uint32, self.buf, 0)
        h32[:] = (MAGIC, VERSION, self.layout.req_slots, self.layout.cmp_slots)
        self.hdr[2] = self.layout.arena_offset
        self.hdr[3] = self.layout.arena_bytes

    def check_header(self) -> None:
        """Client side: the segment really is what the daemon said it is."""
        h32 = np.ndarray((4,), np.uint32, self.buf, 0)
        got = (int(h32[0]), int(h32[1]), int(h32[2]), int(h32[3]),
               int(self.hdr[2]), int(self.hdr[3]))
        want = (MAGIC, VERSION, self.layout.req_slots, self.layout.cmp_slots,
                self.layout.arena_offset, self.layout.arena_bytes)
        if got != want:
            raise RingCorrupt(f"segment header {got} does not match the announced layout {want}")

    def release(self) -> None:
        """Drop the numpy views so the underlying mmap can be closed."""
        self.hdr = self.req = self.cmp = self.msg = self.arena = None  # type: ignore[assignment]


class _RingEnd:
    """One end of one ring: the views it touches, cached as attributes (hot path)."""

    def __init__(self, seg: Segment, requests: bool):
        self.seg = seg
        self.hdr = seg.hdr
        self.ring = seg.req if requests else seg.cmp
        self.msg = seg.msg
        self.mask = seg.req_mask if requests else seg.cmp_mask
        self.slots = seg.layout.req_slots if requests else seg.layout.cmp_slots


# --- client side ------------------------------------------------------------------
class RequestProducer(_RingEnd):
    """Client end of the request ring. Not thread-safe by itself: the client locks."""

    def __init__(self, seg: Segment):
        super().__init__(seg, requests=True)
        self.tail = int(seg.hdr[REQ_TAIL])

    def push(self, req_id: int, model_id: int, offset: int, length: int, options: int) -> bool:
        """Append one entry; False when the ring is full (the daemon is behind)."""
        if self.tail - int(self.hdr[REQ_HEAD]) >= self.slots:
            return False
        self.ring[self.tail & self.mask] = (req_id, model_id | (options << 32), offset, length)
        self.tail = (self.tail + 1) & U64
        self.hdr[REQ_TAIL] = self.tail          # publish after the entry (TSO)
        return True

    def daemon_sleeping(self) -> bool:
        return bool(self.hdr[SLEEPING])


class CompletionConsumer(_RingEnd):
    """Client end of the completion ring."""

    def __init__(self, seg: Segment):
        super().__init__(seg, requests=False)
        self.head = int(seg.hdr[CMP_HEAD])

    def ready(self) -> bool:
        return int(self.hdr[CMP_TAIL]) != self.head

    def pop(self) -> tuple[int, int, str | int] | None:
        """(req_id, status, reason) of the oldest completion, or None when empty; for a
        :data:`PROGRESS` entry, (req_id, PROGRESS, n) with n the outputs valid so far."""
        if int(self.hdr[CMP_TAIL]) == self.head:
            return None
        slot = self.head & self.mask
        req_id, word = self.ring[slot].tolist()
        status, n = word & U32, (word >> 32) & 0xFF
        if status == PROGRESS:
            self.head = (self.head + 1) & U64
            self.hdr[CMP_HEAD] = self.head
            return req_id, PROGRESS, word >> 32
        reason = bytes(self.msg[slot, :min(n, MSG_BYTES)]).decode("utf-8", "replace") if status else ""
        self.head = (self.head + 1) & U64
        self.hdr[CMP_HEAD] = self.head
        return req_id, status, reason


# --- daemon side ------------------------------------------------------------------
class RequestConsumer(_RingEnd):
    """Daemon end of the request ring. Checks the client-written tail."""

    def __init__(self, seg: Segment):
        super().__init__(seg, requests=True)
        self.head = 0

    def pending(self) -> int:
        """Entries waiting; raises RingCorrupt when the client's tail is impossible."""
        n = (int(self.hdr[REQ_TAIL]) - self.head) & U64
        if n > self.slots:
            raise RingCorrupt(f"request ring tail is {n} entries ahead of head "
                              f"(ring has {self.slots} slots)")
        return n

    def pop(self) -> list[int]:
        """[req_id, model_id|options<<32, offset, length] of the next entry (caller
        checked :meth:`pending`)."""
        entry = self.ring[self.head & self.mask].tolist()
        self.head = (self.head + 1) & U64
        self.hdr[REQ_HEAD] = self.head
        return entry


class CompletionProducer(_RingEnd):
    """Daemon end of the completion ring.

    ``head`` is the last client head that passed validation. The client may only move
    it forward, up to the tail: a head that went backwards (or a torn store that looks
    like it) would let the client claim it never read completions, and the daemon would
    overwrite them; one past the tail claims completions never written."""

    def __init__(self, seg: Segment):
        super().__init__(seg, requests=False)
        self.tail = 0
        self.head = 0

    def unread(self) -> int:
        """Completions the client has not consumed yet; RingCorrupt if its head is
        impossible. The head is read once; only that copy is checked and kept."""
        head = int(self.hdr[CMP_HEAD])
        if (head - self.head) & U64 > (self.tail - self.head) & U64:
            raise RingCorrupt(f"completion ring head {head} is outside [{self.head}, "
                              f"{self.tail}]: moved backwards or past the tail")
        self.head = head
        return (self.tail - head) & U64

    def push(self, req_id: int, status: int, reason: str = "") -> None:
        """Append one completion. The front end reserves a slot for every entry it
        takes, so the ring cannot be full here unless the client's head is corrupt:
        RingCorrupt then, before anything is written."""
        if self.unread() >= self.slots:
            raise RingCorrupt(f"completion ring full ({self.slots} unread): the client's "
                              f"head is inconsistent with what the daemon admitted")
        slot = self.tail & self.mask
        n = 0
        if status:
            data = reason.encode("utf-8")[:MSG_BYTES]
            n = len(data)
            self.msg[slot, :n] = np.frombuffer(data, np.uint8)
        self.ring[slot] = (req_id & U64, (status & U32) | (n << 32))
        self.tail = (self.tail + 1) & U64
        self.hdr[CMP_TAIL] = self.tail

    def push_progress(self, req_id: int, n: int) -> None:
        """Append a progress entry (the caller checked there is a free slot beyond the
        ones reserved for completions)."""
        if self.unread() >= self.slots:
            raise RingCorrupt(f"completion ring full ({self.slots} unread) on a progress entry")
        self.ring[self.tail & self.mask] = (req_id & U64, PROGRESS | ((n & U32) << 32))
        self.tail = (self.tail + 1) & U64
        self.hdr[CMP_TAIL] = self.tail

    def set_sleeping(self, flag: bool) -> None:
        self.hdr[SLEEPING] = 1 if flag else 0
