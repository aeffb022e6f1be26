"""TurboTransformers' Algorithm 1 (dispatcher/seqlen_allocator.py): no two live tensors
ever share a byte, chunks are reused across inferences, and the paper's Figure 6 example."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from paella.dispatcher.seqlen_allocator import (
    DEFAULT_CHUNK_SIZE, CachingAllocator, Chunk, ChunkAllocator, PerRequestAllocator,
    TensorUsage, find_gap)


@st.composite
def usage_lists(draw, max_tensors: int = 24, max_ops: int = 16, max_size: int = 3 << 20):
    n = draw(st.integers(1, max_tensors))
    out = []
    for i in range(n):
        a = draw(st.integers(0, max_ops))
        b = draw(st.integers(a, max_ops))
        out.append(TensorUsage(f"t{i}", a, b, draw(st.integers(0, max_size))))
    return out


def _assert_no_overlap(alloc: ChunkAllocator, usages, placements) -> None:
    for i, t in enumerate(usages):
        pt = placements[t.name]
        c = alloc.chunks[pt.chunk]
        assert 0 <= pt.offset and pt.offset + t.size <= c.size, (t, pt, c.size)
        for u in usages[i + 1:]:
            pu = placements[u.name]
            if pu.chunk != pt.chunk or not t.overlaps(u) or not t.size or not u.size:
                continue
            assert (pt.offset + t.size <= pu.offset or pu.offset + u.size <= pt.offset), (t, pt, u, pu)


@settings(max_examples=300, deadline=None)
@given(st.lists(usage_lists(), min_size=1, max_size=4), st.integers(0, 2))
def test_live_tensors_never_share_a_byte(inferences, max_idle):
    alloc = ChunkAllocator(chunk_size=1 << 20, max_idle=max_idle)
    for usages in inferences:
        placements = alloc.plan(usages)
        assert set(placements) == {u.name for u in usages}
        _assert_no_overlap(alloc, usages, placements)
        # Every chunk kept is in use, or idle for at most max_idle inferences.
        assert all(c.records or c.idle <= max_idle for c in alloc.chunks)
    s = alloc.stats
    assert s.held_bytes == sum(c.size for c in alloc.chunks) <= s.peak_bytes
    alloc.close()
    assert alloc.stats.held_bytes == 0 and s.alloc_calls == s.free_calls


def test_find_gap_takes_the_smallest_gap_that_fits():
    c = Chunk(size=100, ptr=0)
    c.place(0, TensorUsage("a", 0, 5, 10))
    c.place(30, TensorUsage("b", 0, 5, 10))      # gap [10, 30): 20 bytes
    c.place(45, TensorUsage("c", 0, 5, 10))      # gap [40, 45): 5 bytes
    c.place(60, TensorUsage("d", 0, 5, 10))      # gap [55, 60): 5 bytes, then [70, 100)
    assert find_gap(TensorUsage("t", 1, 2, 5), c) == 40    # smallest fitting gap, first of ties
    assert find_gap(TensorUsage("t", 1, 2, 15), c) == 10
    assert find_gap(TensorUsage("t", 1, 2, 30), c) == 70   # the tail
    assert find_gap(TensorUsage("t", 1, 2, 31), c) is None
    # A tensor living after all of them may take offset 0.
    assert find_gap(TensorUsage("t", 6, 7, 100), c) == 0


def test_chunks_are_reused_and_released():
    a = ChunkAllocator()
    short = [TensorUsage("x", 0, 1, 500_000), TensorUsage("y", 1, 2, 500_000)]
    a.plan(short)
    a.plan(short)
    assert a.stats.alloc_calls == 1                 # one 2 MB chunk, reused
    assert a.chunks[0].size == DEFAULT_CHUNK_SIZE
    big = [TensorUsage("x", 0, 1, 3_000_000)]
    a.plan(big)                                     # 3 MB > 2 MB: a new chunk of 1.2x
    assert [c.size for c in a.chunks] == [int(3_000_000 * 1.2)]   # the unused 2 MB one released
    assert a.stats.free_calls == 1


def test_figure6_bert_layer_fits_the_papers_chunks():
    """The paper's Figure 6: one BERT layer at seq len 200 (batch 1, hidden 768, 12 heads,
    fp32) fits in two chunks of 2,949,120 B and 2 MB; at 240, in three."""
    def layer(seq: int) -> list[TensorUsage]:
        h, heads, f = 768, 12, 4
        sz = seq * h * f
        return [TensorUsage("qkv_out", 0, 1, 3 * sz), TensorUsage("Q", 1, 2, sz),
                TensorUsage("K", 1, 2, sz), TensorUsage("V", 1, 3, sz),
                TensorUsage("attn_score", 2, 3, heads * seq * seq * f),
                TensorUsage("ctx_layer", 3, 4, sz), TensorUsage("trans_out", 4, 5, sz),
                TensorUsage("attn_out", 5, 7, sz), TensorUsage("intermediate_out", 6, 7, 4 * sz),
                TensorUsage("layer_out", 7, 8, sz)]
    a = ChunkAllocator()
    a.plan(layer(200))
    assert [c.size for c in a.chunks] == [int(4 * 200 * 768 * 4 * 1.2), DEFAULT_CHUNK_SIZE]
    a.plan(layer(240))
    assert len(a.chunks) == 3


def test_baselines_count_what_they_hold():
    sizes = {"x": 1000, "y": 2000}
    pr = PerRequestAllocator(sizes)
    s1 = pr.acquire([TensorUsage("x", 0, 1, 10)])
    s2 = pr.acquire([TensorUsage("x", 0, 1, 10)])
    assert pr.stats.peak_bytes == 2 * 3000 and pr.stats.alloc_calls == 4
    pr.release(s1)
    pr.acquire([TensorUsage("y", 0, 1, 2000)])
    assert pr.stats.alloc_calls == 4                # the released set was reused
    with pytest.raises(ValueError, match="more than the largest length"):
        pr.acquire([TensorUsage("y", 0, 1, 2001)])
    del s2
    ca = CachingAllocator()
    ca.run([TensorUsage("x", 0, 0, 1000), TensorUsage("y", 1, 1, 1000)])
    assert ca.stats.alloc_calls == 1                # y reused x's freed block
    ca.run([TensorUsage("x", 0, 1, 1000), TensorUsage("y", 1, 1, 1000)])
    assert ca.stats.alloc_calls == 2 and ca.stats.held_bytes == 2048


def test_bad_records_are_refused():
    with pytest.raises(ValueError, match="bad usage record"):
        TensorUsage("t", 3, 2, 10)
    with pytest.raises(ValueError, match="share a tensor name"):
        ChunkAllocator().plan([TensorUsage("t", 0, 1, 1), TensorUsage("t", 1, 2, 1)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), usage_lists(max_tensors=8)), min_size=1, max_size=12),
       st.integers(0, 2))
def test_concurrent_jobs_never_share_a_live_byte(steps, max_idle):
    """Jobs placed beside each other (place_job) and finished in any order: a tensor of
    one live job never shares a byte with a tensor of another, nor with one of its own
    job whose lifetime overlaps."""
    alloc = ChunkAllocator(chunk_size=1 << 20, max_idle=max_idle)
    live: dict[int, tuple[list, dict]] = {}
    for k, (finish_one, usages) in enumerate(steps):
        if finish_one and live:
            job = min(live)
            alloc.release_job(job)
            del live[job]
        live[k] = (usages, alloc.place_job(k, usages))
        spans = [(j, u, addr[u.name]) for j, (us, addr) in live.items() for u in us if u.size]
        for i, (j1, u1, a1) in enumerate(spans):
            assert any(c.ptr <= a1 and a1 + u1.size <= c.ptr + c.size for c in alloc.chunks)
            for j2, u2, a2 in spans[i + 1:]:
                if j1 == j2 and not u1.overlaps(u2):
                    continue
                assert a1 + u1.size <= a2 or a2 + u2.size <= a1, (j1, u1, j2, u2)
    alloc.close()
    assert alloc.stats.held_bytes == 0 and alloc.stats.alloc_calls == alloc.stats.free_calls
