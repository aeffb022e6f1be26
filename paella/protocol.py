"""The notifQ contract: one 64-bit word per notification, shared by every component.

The layout is fixed by ARCHITECTURE.md and mirrored, constant for constant, by the
device header ``compiler_pass/include/paella_notif.cuh``; a test checks the two agree.

    bits 63..56  kind     (0 INVALID, 1 PLACEMENT, 2 COMPLETION)
    bits 55..48  SM id of the posting block (%smid)
    bits 47..40  number of blocks the entry accounts for (1..16)
    bits 39..32  reserved, 0
    bits 31..0   launch id (unique per kernel launch, assigned by the dispatcher)

A whole entry is written with one 64-bit store, so a reader sees either INVALID or a
complete entry, never half of one. The reader stores INVALID back after consuming.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

INVALID = 0
PLACEMENT = 1
COMPLETION = 2

KIND_SHIFT = 56
SM_SHIFT = 48
COUNT_SHIFT = 40
LAUNCH_MASK = 0xFFFF_FFFF
BYTE_MASK = 0xFF

#: Largest group a single entry may account for (the compiler pass's default group).
MAX_GROUP = 16
DEFAULT_GROUP = 16

KIND_NAMES = {INVALID: "INVALID", PLACEMENT: "PLACEMENT", COMPLETION: "COMPLETION"}


class Notification(NamedTuple):
    kind: int
    sm: int
    count: int
    launch_id: int


def encode(kind: int, sm: int, count: int, launch_id: int) -> int:
    """Pack one notification word; raises ValueError on out-of-range fields."""
    if kind not in (PLACEMENT, COMPLETION):
        raise ValueError(f"notification kind must be PLACEMENT(1) or COMPLETION(2), got {kind}")
    if not 0 <= sm <= BYTE_MASK:
        raise ValueError(f"SM id {sm} does not fit in 8 bits")
    if not 1 <= count <= MAX_GROUP:
        raise ValueError(f"block count {count} outside 1..{MAX_GROUP}")
    if not 0 <= launch_id <= LAUNCH_MASK:
        raise ValueError(f"launch id {launch_id} does not fit in 32 bits")
    return (kind << KIND_SHIFT) | (sm << SM_SHIFT) | (count << COUNT_SHIFT) | launch_id


def decode(word: int) -> Notification:
    word = int(word)
    return Notification(
        (word >> KIND_SHIFT) & BYTE_MASK,
        (word >> SM_SHIFT) & BYTE_MASK,
        (word >> COUNT_SHIFT) & BYTE_MASK,
        word & LAUNCH_MASK,
    )


def decode_array(words: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised decode of a batch of words: (kind, sm, count, launch_id) arrays."""
    w = words.astype(np.uint64, copy=False)
    return (
        ((w >> np.uint64(KIND_SHIFT)) & np.uint64(BYTE_MASK)).astype(np.int64),
        ((w >> np.uint64(SM_SHIFT)) & np.uint64(BYTE_MASK)).astype(np.int64),
        ((w >> np.uint64(COUNT_SHIFT)) & np.uint64(BYTE_MASK)).astype(np.int64),
        (w & np.uint64(LAUNCH_MASK)).astype(np.int64),
    )


def group_posts(start: int, n: int, total: int, group: int) -> list[tuple[int, int]]:
    """Which of ``n`` consecutive blocks post an entry, and for how many blocks each.

    Blocks ``start+1 .. start+n`` (1-based counter values) of a kernel of ``total``
    blocks are counted; the block whose counter value is a multiple of ``group``, or
    equals ``total``, posts an entry accounting for the blocks since the previous
    post. Returns ``(offset_within_batch, count)`` pairs, offset 0-based. This is the
    rule the device header implements; the simulator uses it so both post alike.
    """
    posts = []
    end = start + n
    nxt = (start // group + 1) * group
    while nxt <= end:
        posts.append((nxt - start - 1, group))
        nxt += group
    if end == total and total % group:
        posts.append((n - 1, total % group))
    return posts


def entries_per_kernel(blocks: int, group: int = DEFAULT_GROUP) -> int:
    """Entries of one kind that a kernel of ``blocks`` blocks posts: ceil(blocks/group)."""
    return -(-blocks // group)


# --- The notifQ region in device-mapped memory ---------------------------------------
#
# One contiguous region; instrumented kernels receive a pointer to its start as their
# first extra parameter. The device header (compiler_pass/include/paella_notif.cuh)
# defines the same offsets. Counters are indexed by ``launch_id & counter_mask``; the
# backend zeroes a launch's pair before launching it, and the dispatcher never has more
# than ``counter_mask + 1`` instrumented launches in flight.
#
#   offset 0    uint32 tail           writer index, advanced with atomicAdd by the device
#   offset 4    uint32 slot_mask      slots - 1 (slots is a power of two)
#   offset 8    uint32 counter_mask   counter pairs - 1 (a power of two)
#   offset 12   uint32 reserved
#   offset 64   uint64 slots[slots]
#   then        uint32 counters[counter_pairs][2]   (blocks started, blocks ended)
NOTIFQ_HEADER_BYTES = 64
NOTIFQ_TAIL_OFFSET = 0
NOTIFQ_SLOT_MASK_OFFSET = 4
NOTIFQ_COUNTER_MASK_OFFSET = 8
DEFAULT_NOTIFQ_SLOTS = 1 << 16
DEFAULT_COUNTER_PAIRS = 1 << 12


def notifq_region_bytes(slots: int, counter_pairs: int) -> int:
    return NOTIFQ_HEADER_BYTES + 8 * slots + 8 * counter_pairs


def notifq_counters_offset(slots: int) -> int:
    return NOTIFQ_HEADER_BYTES + 8 * slots
