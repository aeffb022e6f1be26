"""The dispatcher's own stream map steers around a stream the device holds (issue 37):
in ``single`` mode a new job, in ``sticky`` mode a new virtual stream, goes to the next
stream without a gate; a job's ops stay on the stream it got; ``pool`` never hands out a
held stream (it is busy). As the kernel cores' ``_ungated``."""
from __future__ import annotations

from types import SimpleNamespace

from paella.dispatcher.streams import StreamMap


def op(job, vstream=None):
    return SimpleNamespace(job=job, vstream=vstream, stream=-1)


def job():
    return SimpleNamespace(pin=-1, home=-1)


def test_single_mode_gives_a_new_job_the_next_stream_without_a_gate():
    held = {0}
    m = StreamMap(4, "single")
    m.gated = held.__contains__
    a, b = job(), job()
    assert m.assign(op(a)) == 1                  # stream 0 is held: the next one
    held.add(1)
    assert m.assign(op(a)) == 1                  # a job's ops stay on its stream
    assert m.assign(op(b)) == 2
    held.clear()
    assert m.assign(op(job())) == 0              # nothing held: stream 0, as fifo's
    held.update(range(4))
    assert m.assign(op(job())) == 0              # every stream held: wait behind the first


def test_without_a_device_that_holds_single_mode_is_stream_0():
    m = StreamMap(4, "single")
    assert [m.assign(op(job())) for _ in range(3)] == [0, 0, 0]


def test_sticky_mode_binds_a_new_virtual_stream_past_held_streams():
    held = {1, 2}
    m = StreamMap(4, "sticky")
    m.gated = held.__contains__
    vs = [SimpleNamespace(real=-1) for _ in range(3)]
    got = [m.assign(op(job(), v)) for v in vs]
    assert got == [0, 3, 0]                      # 1 and 2 skipped; round robin goes on
    held.clear()
    assert m.assign(op(job(), vs[1])) == 3       # bound for its life


def test_pool_mode_never_hands_out_a_busy_stream():
    m = StreamMap(2, "pool")
    m.gated = lambda s: True                     # (a held stream is busy: not free)
    a = m.assign(op(job()))
    b = m.assign(op(job()))
    assert {a, b} == {0, 1} and not m.available()


def test_a_new_job_or_virtual_stream_waits_while_every_stream_holds_a_gate():
    held = set(range(4))
    for mode in ("single", "sticky"):
        m = StreamMap(4, mode)
        m.gated = held.__contains__
        j = job()
        first = op(j, SimpleNamespace(real=-1))
        assert m.must_wait(first)                 # nowhere without a gate: it waits
        held.discard(2)
        assert not m.must_wait(first) and m.assign(first) == 2
        held.add(2)
        # Once it has its stream, its later ops go there, gate or not (stream order).
        assert not m.must_wait(op(j, first.vstream))
    pool = StreamMap(4, "pool")
    pool.gated = held.__contains__
    assert not pool.must_wait(op(job()))          # (pool never shares a stream)
    pinned = StreamMap(4, "sticky")
    pinned.gated = held.__contains__
    named = SimpleNamespace(pin=3, home=-1)
    assert not pinned.must_wait(op(named, SimpleNamespace(real=-1)))   # its named stream
    assert not StreamMap(4, "single").must_wait(op(job()))             # a device without gates
