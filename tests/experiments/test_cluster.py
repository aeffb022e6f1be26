"""``paella experiment cluster`` on a tiny setting: N = 1 and 2 simulated GPUs, a few
hundred requests; the summary's contract keys, sane efficiencies, and the loop's
bookkeeping (every request answered once, the router's in-flight counts back to 0)."""
from __future__ import annotations

import json
import math

import pytest

from paella.cluster.router import ROUTERS
from paella.experiments import cluster


@pytest.fixture(scope="module")
def tiny():
    return cluster.run([1, 2], [0.2, 0.4, 0.6, 0.8], list(ROUTERS), cluster.CASES,
                       per_gpu=200, min_requests=200, sigma=0.0, slo_x=10.0, seed=1)


def test_summary_keys_and_efficiency(tiny):
    s = tiny["summary"]
    for key in ("p99_at_load", "scaling_efficiency", "router_gain"):
        assert key in s
    for case in cluster.CASES:
        assert set(s["p99_at_load"][case]) == set(ROUTERS)
    assert set(s["p99_at_load"]["homogeneous"]["p2c-work"]) == {"1", "2"}
    assert set(s["p99_at_load"]["heterogeneous"]["p2c-work"]) == {"2"}      # N >= 2 only
    assert set(s["p99_at_load"]["homogeneous"]["random"]["2"]) == {"0.2", "0.4", "0.6", "0.8"}
    eff = s["scaling_efficiency"]
    assert set(eff) == {"1", "2"} and eff["1"] == 1.0
    for router, e in s["scaling_efficiency_by_router"].items():
        assert 0 < e["2"] and math.isfinite(e["2"]), router
    # Randomly split Poisson arrivals make N independent one-GPU queues: about N x one
    # GPU's throughput at the bound (a few hundred requests: a loose window).
    assert 0 < s["scaling_efficiency_by_router"]["random"]["2"] <= 1.6
    # Pooling: a load-aware router over two GPUs meets the bound at more than the random split.
    assert eff["2"] >= s["scaling_efficiency_by_router"]["random"]["2"]
    assert s["router_gain"] and all(g > 0 for g in s["router_gain"].values())
    assert s["router_gain_n_gpus"] == 2


def test_one_gpu_is_the_same_whatever_the_router(tiny):
    """With one replica every router sends everything to it: identical points."""
    per = tiny["results"]["homogeneous"]
    base = [p["p99_ms"] for p in per["random"]["1"]]
    for router in ROUTERS:
        assert [p["p99_ms"] for p in per[router]["1"]] == base


def test_load_aware_routers_balance_and_prefer_the_faster_gpu(tiny):
    het = tiny["results"]["heterogeneous"]
    top = {r: max(het[r]["2"], key=lambda p: p["load"]) for r in ROUTERS}
    # round-robin splits evenly whatever the speeds; the load-aware routers send the
    # V100 more (p2c-work by work: it sends it the long requests), with a lower p99.
    assert abs(top["round-robin"]["share_fast"] - 0.5) < 0.05
    for r in ("p2c-queue", "p2c-work"):
        assert top[r]["share_fast"] > 0.5
        assert top[r]["p99_ms"] < top["round-robin"]["p99_ms"]


def test_a_point_answers_every_request_and_settles_the_counts():
    plans = {n: cluster.synthetic_plan(n, ms) for n, ms in list(cluster.TABLE2_MS.items())[:3]}
    c = cluster.Cluster(["t4", "v100", "t4"], plans)
    pt = cluster.run_point(c, "p2c-work", 150.0, 300, 0.0, 3)
    assert pt["throughput"] > 0 and pt["p99_ms"] >= pt["p50_ms"] > 0
    assert pt["count"] == 270                                              # 10% warm-up
    assert 0 < pt["share_min"] <= pt["share_max"] < 1


def test_queued_work_is_what_the_daemon_reports():
    """The experiment's replicas read the daemon's own function on their dispatcher."""
    from paella.dispatcher.daemon.server import queued_work_us
    plans = {"a": cluster.synthetic_plan("a", 2.0)}
    g = cluster.SimGpu(0, "t4", plans, 0)
    assert g.queued_work_us() == queued_work_us(g.disp) == 0
    from paella.dispatcher.core import Request
    for i in range(3):
        g.disp.submit(Request(i, 0, g.mids["a"], g.io, on_complete=lambda *a: None))
    assert g.queued_work_us() == pytest.approx(3 * g.estimates_us["a"], abs=1)
    g.advance(g.dev.now() + 1e-3)            # part of the way through the first job
    assert 0 < g.queued_work_us() <= 3 * g.estimates_us["a"] + 1
    g.drain()
    assert g.queued_work_us() == 0


def test_the_command_writes_json_and_a_plot(tmp_path, capsys):
    from paella.cli import main
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    assert main(["experiment", "cluster", "--gpus", "1,2", "--loads", "0.3,0.7",
                 "--routers", "random,p2c-queue,p2c-work", "--requests-per-gpu", "100",
                 "--min-requests", "100", "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert {"p99_at_load", "scaling_efficiency", "router_gain"} <= set(data["summary"])
    assert png.stat().st_size > 10_000 and data["wall_seconds"] > 0


def test_bad_options_are_refused(capsys):
    from paella.cli import main
    assert main(["experiment", "cluster", "--routers", "least-loaded", "--gpus", "1"]) != 0
    assert "unknown least-loaded" in capsys.readouterr().err
    assert main(["experiment", "cluster", "--placement", "resnet18=x", "--gpus", "1"]) != 0
    assert "bad part 'resnet18=x'" in capsys.readouterr().err
    assert main(["experiment", "cluster", "--placement", "nope=1", "--gpus", "1"]) != 0
    assert "unknown model(s) nope" in capsys.readouterr().err


def test_placement_caps_counts_at_the_replicas():
    assert cluster._capped("3", 2) == "2" and cluster._capped("resnet18=4,*=1", 2) == "resnet18=2,*=1"
    assert cluster._capped("all", 5) == "all"
    assert cluster.presets_for("heterogeneous", 5) == ["t4", "v100", "t4", "v100", "t4"]
