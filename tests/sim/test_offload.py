"""The functional cache's comparison thread and sample digest (``devices/sim/_offload.c``):
the right candidate or none, for one or several buffers; refused arguments; buffers kept
alive until collected; many comparisons at once; a child after fork never waits for a
worker it does not have."""
from __future__ import annotations

import gc
import os
import signal

import numpy as np
import pytest

from paella.dispatcher.devices.sim import _offload


def test_the_result_is_the_first_equal_candidate_or_minus_one():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 255, 100_000, dtype=np.uint8)
    same, last_differs, first_differs = x.copy(), x.copy(), x.copy()
    last_differs[-1] ^= 1
    first_differs[0] ^= 1
    assert _offload.compare([x], [[first_differs], [last_differs], [same], [same]]).result() == 2
    assert _offload.compare([x], [[first_differs], [last_differs]]).result() == -1
    assert _offload.compare([x], []).result() == -1
    assert _offload.compare([x], [[x[:-1]]]).result() == -1          # shorter: never equal
    p = _offload.compare([x], [[same]])
    assert p.result() == 0 and p.done


def test_every_buffer_of_a_candidate_must_match():
    a, b = np.arange(64, dtype=np.float32), np.arange(7, dtype=np.int64)
    b2 = b.copy()
    b2[3] = -1
    assert _offload.compare([a, b], [[a.copy(), b2], [a.copy(), b.copy()]]).result() == 1
    assert _offload.compare([a, b], [[b.copy(), a.copy()]]).result() == -1   # order matters


def test_what_it_cannot_compare_is_refused_at_start():
    x = np.zeros((8, 8), np.uint8)
    with pytest.raises((BufferError, ValueError)):
        _offload.compare([x[:, ::2]], [])                 # not contiguous
    with pytest.raises(ValueError, match="expected 1"):
        _offload.compare([x], [[x, x]])
    with pytest.raises(TypeError):
        _offload.compare([x], [[object()]])
    with pytest.raises(TypeError):
        _offload.compare(5, [])


def test_buffers_live_until_the_comparison_is_collected():
    x = np.full(1 << 20, 7, np.uint8)
    p = _offload.compare([x], [[np.full(1 << 20, 7, np.uint8)]])
    del x                                               # only the pending one holds them
    gc.collect()
    assert p.result() == 0
    for _ in range(200):                                # dropped uncollected: no leak, no crash
        _offload.compare([np.ones(1000, np.uint8)], [[np.ones(1000, np.uint8)]])


def test_many_comparisons_in_flight_each_get_their_own_answer():
    rng = np.random.default_rng(2)
    inputs = [rng.integers(0, 255, 4096, dtype=np.uint8) for _ in range(50)]
    pendings = []
    for i in range(500):
        x = inputs[i % 50]
        cands = [[inputs[(i + k) % 50]] for k in range(1, 4)] + [[x.copy()]]
        pendings.append((_offload.compare([x], cands), 3))
    assert [p.result() for p, _ in pendings] == [want for _, want in pendings]


def test_a_child_after_fork_never_waits_for_a_worker_it_does_not_have():
    big = np.zeros(64 << 20, np.uint8)
    p = _offload.compare([big], [[big.copy()]] * 8)       # likely still running at the fork
    pid = os.fork()
    if pid == 0:                                        # the child: an answer, or the fallback
        signal.alarm(20)
        try:
            r = p.result()
            q = _offload.compare([np.ones(10, np.uint8)], [[np.ones(10, np.uint8)]]).result()
            os._exit(0 if r in (-1, 0) and q == 0 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert p.result() == 0


def test_the_digest_sees_the_length_the_order_and_the_sampled_bytes():
    x = np.zeros(602_112, np.uint8)
    d = _offload.digest([x], 4096)
    assert len(d) == 16 and d == _offload.digest([x.copy()], 4096)
    step = x.size // 4096
    y = x.copy()
    y[step * 10] = 1                                    # a sampled byte
    assert _offload.digest([y], 4096) != d
    assert _offload.digest([x[:-1]], 4096) != d         # the length
    a, b = np.arange(5, dtype=np.uint8), np.arange(9, dtype=np.uint8)
    assert _offload.digest([a, b], 4096) != _offload.digest([b, a], 4096)
    small = np.arange(100, dtype=np.uint8)
    for i in range(100):                                # a small input is sampled whole
        z = small.copy()
        z[i] ^= 0x80
        assert _offload.digest([z], 4096) != _offload.digest([small], 4096)
    with pytest.raises(ValueError):
        _offload.digest([x], 0)


def test_a_comparison_collected_before_the_worker_begins_it_is_done_by_the_caller():
    """Behind a long comparison, a short one collected at once is taken out of the queue
    and compared by the caller (its answer, and the long one's, still right)."""
    big = np.zeros(32 << 20, np.uint8)
    long_one = _offload.compare([big], [[big.copy()]] * 4)
    x = np.arange(1000, dtype=np.uint16)
    y = x.copy()
    y[999] = 0
    short = [_offload.compare([x], [[y], [x.copy()]]) for _ in range(20)]
    assert [p.result() for p in reversed(short)] == [1] * 20
    assert long_one.result() == 0 and all(p.done for p in short)


def test_two_threads_collecting_one_comparison_both_get_the_answer():
    """One thread takes the queued comparison and does it; the other, waiting on it,
    is woken (it waited forever before the broadcast)."""
    import threading
    big = np.zeros(32 << 20, np.uint8)
    for _ in range(5):
        long_one = _offload.compare([big], [[big.copy()]] * 4)
        x = np.arange(1 << 16, dtype=np.uint8)
        p = _offload.compare([x], [[x.copy()]])
        got = []
        threads = [threading.Thread(target=lambda: got.append(p.result())) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert got == [0, 0] and long_one.result() == 0
