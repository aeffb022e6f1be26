"""``paella experiment batching``'s pieces on the tiny MLP (compiled at batch 1, 2, 4):
a load point through the stage in virtual time, and the summary's arithmetic."""
from __future__ import annotations

import pytest

from paella.experiments import batching


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from paella.bundle import load_bundle
    from paella.compiler_pass.build import compile_bundle
    from paella.models import zoo
    out = tmp_path_factory.mktemp("exp") / "mlp"
    compile_bundle([zoo.get("tiny_mlp", batch=b) for b in (1, 2, 4)], out)
    return load_bundle(out)


def test_a_point_batches_under_load_and_serves_every_request(bundle, monkeypatch):
    monkeypatch.setattr(batching, "DYNAMIC", {"max_batch_size": 4, "max_queue_delay_us": 100,
                                              "max_inflight_batches": 1})
    un = batching.run_point(bundle, "identity", "paella", 200_000, 300, 1, 0.0)
    dy = batching.run_point(bundle, "dynamic", "paella", 200_000, 300, 1, 0.0)
    assert un["mean_batch"] == 1.0 and un["padding_waste"] == 0.0
    assert dy["mean_batch"] > 2.0 and dy["batches"] < 300
    assert 0.0 <= dy["padding_waste"] < 0.5
    for p in (un, dy):
        assert p["throughput"] > 0 and p["p99_ms"] >= p["p50_ms"] > 0


def test_the_summary_compares_at_saturation_and_at_equal_load():
    def pt(offered, tput, p99):
        return {"offered": offered, "throughput": tput, "p99_ms": p99}
    per = {"unbatched": [pt(100, 100, 1.0), pt(200, 150, 9.0)],
           "dynamic": [pt(100, 100, 2.0), pt(200, 199, 3.0)]}
    results = {"m": {"isolated_ms": 1.0, "points": {"paella": per, "fifo": per}}}
    s = batching.summarize(results)
    assert s["max_throughput_ratio"] == pytest.approx(199 / 150)
    eq = s["per_model"]["m"]["p99_at_equal_load"]["paella"]
    assert eq == {"load": 100, "unbatched_p99_ms": 1.0, "dynamic_p99_ms": 2.0}
