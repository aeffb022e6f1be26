"""``paella experiment turbo`` on a tiny encoder: every request answered, the DP batcher
at least as fast as no batching where batching pays, and the allocators' figures
consistent with what they did."""
from __future__ import annotations

import numpy as np
import pytest

from paella.bundle import load_bundle
from paella.experiments import turbo

TINY = turbo.Setting(buckets=(8, 16), sizes=(1, 2), rates={}, n_requests=0,
                     encoder={"layers": 1, "hidden": 16, "heads": 2, "ffn": 32})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    bundle = load_bundle(turbo.build_bundle(TINY, out_dir=tmp_path_factory.mktemp("zoo")))
    return bundle, turbo.variant_costs(bundle)


def test_cost_table_grows_with_length_and_batch(tiny):
    bundle, costs = tiny
    by = {(v.seq_len, v.rows): c for v, c in zip(bundle.variants, costs)}
    assert set(by) == {(8, 1), (8, 2), (16, 1), (16, 2)}
    assert by[(16, 2)] > by[(8, 2)] and by[(16, 2)] >= by[(16, 1)]
    # Batching amortizes: two rows cost less than two requests alone.
    assert by[(16, 2)] < 2 * by[(16, 1)]


def test_dp_batches_and_beats_no_batching_at_overload(tiny, monkeypatch):
    bundle, costs = tiny
    monkeypatch.setitem(turbo.RANGES, "tiny", (2, 16))
    rate = 3.0 / min(costs)                     # three times what one request alone allows
    nob = turbo.run_point(bundle, costs, "nobatch", "tiny", rate, 120, seed=3)
    dp = turbo.run_point(bundle, costs, "dp", "tiny", rate, 120, seed=3)
    assert nob["batches"] == 120 and dp["batches"] < 120 and dp["mean_batch"] > 1
    assert dp["throughput"] >= nob["throughput"]
    assert dp["min_ms"] > 0 and dp["max_ms"] >= dp["p99_ms"] >= dp["p50_ms"]


def test_allocator_comparison_counts_what_happened(tiny, monkeypatch):
    bundle, costs = tiny
    monkeypatch.setitem(turbo.RANGES, "5-500", (2, 16))
    out = turbo.compare_allocators(bundle, costs, rate=1.0 / min(costs), n=60, seed=2)
    assert out["jobs"] >= 1 and out["requests"] == 60
    for k in ("per_request_sets", "chunked", "caching", "chunked_one_at_a_time"):
        assert out[k]["peak_bytes"] > 0 and out[k]["alloc_calls"] >= 1
    # Chunks persist across jobs: far fewer device allocations than a set per variant.
    assert out["chunked"]["alloc_calls"] < out["per_request_sets"]["alloc_calls"]
    assert np.isclose(out["chunked"]["alloc_calls_per_request"], out["chunked"]["alloc_calls"] / 60)
