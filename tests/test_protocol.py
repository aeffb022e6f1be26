import numpy as np
import pytest

from paella import protocol as p


def test_encode_decode_roundtrip_and_layout():
    w = p.encode(p.COMPLETION, 21, 16, 0xDEADBEEF)
    assert w == (2 << 56) | (21 << 48) | (16 << 40) | 0xDEADBEEF
    assert p.decode(w) == (p.COMPLETION, 21, 16, 0xDEADBEEF)
    assert (w >> 32) & 0xFF == 0          # reserved bits stay zero


@pytest.mark.parametrize("args", [(0, 1, 1, 1), (3, 1, 1, 1), (1, 256, 1, 1), (1, 1, 0, 1),
                                  (1, 1, 17, 1), (1, 1, 1, 1 << 32), (1, -1, 1, 1)])
def test_encode_rejects_out_of_range(args):
    with pytest.raises(ValueError):
        p.encode(*args)


def test_decode_array_matches_scalar_decode():
    rng = np.random.default_rng(0)
    words = np.array([p.encode(int(k), int(s), int(c), int(l)) for k, s, c, l in zip(
        rng.integers(1, 3, 200), rng.integers(0, 256, 200), rng.integers(1, 17, 200),
        rng.integers(0, 1 << 32, 200))], dtype=np.uint64)
    kinds, sms, counts, lids = p.decode_array(words)
    for i, w in enumerate(words):
        assert p.decode(w) == (kinds[i], sms[i], counts[i], lids[i])


@pytest.mark.parametrize("group", [1, 5, 16])
def test_group_posts_cover_every_block_once(group):
    rng = np.random.default_rng(group)
    for _ in range(200):
        total = int(rng.integers(1, 200))
        # Split the blocks into random consecutive batches, as placements arrive.
        cuts = sorted(set(rng.integers(1, total + 1, 5).tolist()) | {total})
        start, posts = 0, []
        for end in cuts:
            posts += p.group_posts(start, end - start, total, group)
            start = end
        assert len(posts) == p.entries_per_kernel(total, group)
        assert sum(c for _, c in posts) == total
        assert all(c == group for _, c in posts[:-1])


def test_notifq_region_layout():
    assert p.notifq_counters_offset(1024) == 64 + 8 * 1024
    assert p.notifq_region_bytes(1024, 16) == 64 + 8 * 1024 + 8 * 16
