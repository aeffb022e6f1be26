"""The shared-memory ring layout, the control-socket frames and the arena allocator,
exercised in-process over real mmaps (no daemon)."""
from __future__ import annotations

import mmap
import struct

import pytest

from paella import rings, wire
from paella.client.arena import ArenaAllocator
from paella.client.errors import ArenaFull


def make_segment(req_slots: int = 4, cmp_slots: int = 4, arena: int = 8192):
    layout = rings.Layout(req_slots, cmp_slots, arena)
    mm = mmap.mmap(-1, layout.total_bytes)
    seg = rings.Segment(mm, layout)
    seg.init_header()
    return layout, mm, seg


def test_layout_offsets_are_disjoint_and_aligned():
    lay = rings.Layout(1024, 512, 1 << 20)
    assert lay.req_offset == rings.HEADER_BYTES
    assert lay.cmp_offset == lay.req_offset + 1024 * 32
    assert lay.msg_offset == lay.cmp_offset + 512 * 16
    assert lay.arena_offset % rings.ARENA_ALIGN == 0
    assert lay.arena_offset >= lay.msg_offset + 512 * rings.MSG_BYTES
    assert lay.total_bytes == lay.arena_offset + (1 << 20)
    with pytest.raises(ValueError, match="power of two"):
        rings.Layout(1000, 512, 1)
    with pytest.raises(ValueError, match="arena_bytes"):
        rings.Layout(4, 4, 0)


def test_request_ring_wraps_and_reports_full():
    _, _, seg = make_segment()
    prod, cons = rings.RequestProducer(seg), rings.RequestConsumer(seg)
    got = []
    for round_ in range(5):                     # 20 entries through a 4-slot ring
        for i in range(4):
            assert prod.push(round_ * 4 + i, 7, 64 * i, 128, 3)
        assert not prod.push(99, 0, 0, 0, 0)    # full
        assert cons.pending() == 4
        while cons.pending():
            got.append(cons.pop())
    assert [e[0] for e in got] == list(range(20))
    assert got[5] == [5, 7 | (3 << 32), 64, 128]


def test_completion_ring_carries_reason_text():
    _, _, seg = make_segment()
    prod, cons = rings.CompletionProducer(seg), rings.CompletionConsumer(seg)
    assert cons.pop() is None
    prod.push(1, rings.OK)
    prod.push(2, rings.E_RANGE, "x" * 500)       # truncated to the slot's text area
    prod.push(3, rings.E_MODEL, "no model with id 9")
    assert cons.pop() == (1, 0, "")
    rid, st, reason = cons.pop()
    assert (rid, st, reason) == (2, rings.E_RANGE, "x" * rings.MSG_BYTES)
    assert cons.pop() == (3, rings.E_MODEL, "no model with id 9")
    assert cons.pop() is None
    assert prod.unread() == 0


def test_daemon_side_detects_impossible_indices():
    _, _, seg = make_segment()
    cons, cprod = rings.RequestConsumer(seg), rings.CompletionProducer(seg)
    seg.hdr[rings.REQ_TAIL] = 5                  # 5 entries in a 4-slot ring
    with pytest.raises(rings.RingCorrupt, match="ahead"):
        cons.pending()
    seg.hdr[rings.REQ_TAIL] = rings.U64         # "behind" the head: wraps to huge
    with pytest.raises(rings.RingCorrupt):
        cons.pending()
    seg.hdr[rings.CMP_HEAD] = 3                  # client claims to have read unwritten slots
    with pytest.raises(rings.RingCorrupt, match="past the tail"):
        cprod.unread()


def test_client_checks_the_header():
    lay, mm, seg = make_segment()
    seg.check_header()
    other = rings.Segment(mm, rings.Layout(4, 4, 4096))
    with pytest.raises(rings.RingCorrupt, match="does not match"):
        other.check_header()


def test_frames_round_trip_in_pieces():
    r = wire.FrameReader()
    frames = (wire.encode(wire.HELLO, {"version": 1, "mode": "hybrid"})
              + wire.encode_id(wire.WAKE, 2 ** 63 + 5) + wire.KICK_FRAME
              + wire.error("bad_json", "nope"))
    out = []
    for i in range(0, len(frames), 3):          # byte-dribbled stream
        out += r.feed(frames[i:i + 3])
    assert out == [(wire.HELLO, {"version": 1, "mode": "hybrid"}), (wire.WAKE, 2 ** 63 + 5),
                   (wire.KICK, {}), (wire.ERROR, {"error": "bad_json", "message": "nope"})]
    assert not r.buf


@pytest.mark.parametrize("raw, code", [
    (struct.pack("<HHI", 99, 0, 0), "unknown_type"),
    (struct.pack("<HHI", wire.HELLO, 1, 0), "bad_flags"),
    (struct.pack("<HHI", wire.HELLO, 0, wire.MAX_PAYLOAD + 1), "too_large"),
    (struct.pack("<HHI", wire.HELLO, 0, 3) + b"\xff\xfe\xfd", "bad_json"),
    (struct.pack("<HHI", wire.HELLO, 0, 2) + b"[]", "bad_json"),
    (struct.pack("<HHI", wire.WAKE, 0, 4) + b"abcd", "bad_length"),
])
def test_malformed_frames_raise_with_a_code(raw, code):
    with pytest.raises(wire.WireError) as e:
        wire.FrameReader().feed(raw)
    assert e.value.code == code


def test_model_info_round_trip():
    x = wire.TensorInfo("x", (2, 3), "float32", 0)
    y = wire.TensorInfo("y", (4,), "int64", 64)
    m = wire.ModelInfo(3, "m", (wire.VariantInfo(96, (x,), (y,)),))
    assert wire.ModelInfo.from_dict(m.to_dict()) == m
    assert x.nbytes == 24 and y.nbytes == 32
    with pytest.raises(wire.WireError, match="malformed model"):
        wire.ModelInfo.from_dict({"id": 1})


def test_arena_allocator_first_fit_and_merge():
    a = ArenaAllocator(1024)
    offs = [a.alloc(100) for _ in range(8)]     # 128 each after rounding
    assert offs == [i * 128 for i in range(8)]
    with pytest.raises(ArenaFull, match="no free region"):
        a.alloc(1)
    a.free(offs[1]); a.free(offs[3]); a.free(offs[2])   # merges into [128, 512)
    assert a.alloc(384) == 128
    for o in (offs[0], 128, *offs[4:]):
        a.free(o)
    assert a.free_bytes == 1024 and a.alloc(1024) == 0
    with pytest.raises(ValueError, match="not an allocated region"):
        a.free(12)
