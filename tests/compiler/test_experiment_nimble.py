"""``paella experiment nimble`` on the smallest branchy model: single-stream and Nimble
plans served by the dispatcher on the simulated V100, isolated and together."""
from __future__ import annotations

import json

from paella.compiler_pass.build import compile_bundle
from paella.experiments import nimble

from test_streams import _fork_join


def test_nimble_experiment_on_a_fork_join(tmp_path, cache_dir):
    (tmp_path / "zoo").mkdir()
    compile_bundle(_fork_join(), tmp_path / "zoo" / "fork_join", cache_dir=cache_dir)
    data = nimble.run(True, zoo_dir=tmp_path / "zoo", models=["fork_join"], progress=False)
    row = data["models"]["fork_join"]
    # Two independent branches: two streams, two concurrent launches, one join.
    assert row["streams"] == 2 and row["degree"] == 2 and row["synchronizations"] >= 1
    assert row["speedup"] == data["summary"]["speedup"]["fork_join"]
    assert row["single_us"] / row["nimble_us"] == row["speedup"] > 0.95
    assert row["request_mb_nimble"] >= row["request_mb_single"]
    [point] = data["serving"]
    for mode in ("single", "nimble"):
        assert point[mode]["per_model"]["fork_join"]["count"] > 200
        assert point[mode]["mean_ms"] <= point[mode]["p99_ms"]
    # --cpu-scale 1: the same plans with this dispatcher's CPU charged to the clock.
    from paella.bundle import load_bundle
    b = load_bundle(tmp_path / "zoo" / "fork_join")
    plans = {"single": b, "nimble": nimble.with_variant(b, nimble.nimble(b.variants[0])[0])}
    c = nimble.charged(plans, row["single_us"], 20, 1, 1.0)
    assert c["single_p50_ms"] * 1e3 > row["single_us"] and c["nimble_p50_ms"] * 1e3 > row["nimble_us"]
    assert c["speedup"] == c["single_p50_ms"] / c["nimble_p50_ms"]
    nimble.plot(data, str(tmp_path / "n.png"))
    assert (tmp_path / "n.png").stat().st_size > 0
    json.dumps(data)
