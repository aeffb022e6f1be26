"""``paella experiment mix`` (Figure 11): the summary's definition, and one small run of
three compiled zoo models through the dispatcher and straight to the device."""
import math

import pytest

from paella.experiments import mix
from paella.experiments.zoo import DEFAULT_ZOO_DIR


def point(offered, throughput, p99, short=None):
    """A load point of a two-model mix; ``short``'s p99 defaults to the overall one."""
    short = p99 if short is None else short
    return {"offered": offered, "throughput": throughput, "p99_ms": p99, "mean_ms": p99 / 4,
            "per_model": {"long": {"p99_ms": p99}, "short": {"p99_ms": short}}}


SLO = {"long": 50.0, "short": 10.0}


def test_sustained_load_needs_every_model_within_its_slo_and_no_saturation():
    pts = [point(100, 100, 10.0, 5.0), point(200, 199, 40.0, 8.0), point(300, 250, 45.0, 5.0),
           point(400, 390, 45.0, 12.0)]
    ok = lambda p: mix.meets_slo(p, SLO)    # noqa: E731
    # 300 meets both SLOs but is saturated (250 < 0.9 * 300); at 400 the short model misses.
    assert mix.sustained_load(pts, ok) == 200
    assert mix.sustained_load(pts, lambda p: mix.meets_slo(p, {"long": 5.0, "short": 10.0})) == 0.0
    assert mix.worst_slo_ratio(pts[3], SLO) == pytest.approx(1.2)


def test_a_load_counts_only_when_every_lower_load_passed():
    # 200 fails (the short model misses), 300 passes by luck: the sustained load is 100.
    pts = [point(300, 300, 20.0, 5.0), point(100, 100, 10.0, 5.0), point(200, 200, 20.0, 15.0)]
    assert mix.sustained_load(pts, lambda p: mix.meets_slo(p, SLO)) == 100


def test_summary_ratio_is_paella_over_ms_jbj_and_the_worse_sigma():
    results = {
        "sigma=1.5": {"paella": [point(100, 100, 10.0, 2.0), point(200, 200, 20.0, 4.0)],
                      "ms-jbj": [point(100, 100, 30.0, 6.0), point(200, 200, 40.0, 11.0)]},
        "sigma=2.0": {"paella": [point(100, 100, 10.0, 2.0), point(200, 200, 60.0, 3.0)],
                      "ms-jbj": [point(100, 100, 20.0, 5.0), point(200, 200, 45.0, 30.0)]},
    }
    s = mix.summarize(results, SLO, overall_slo_ms=42.0)
    assert s["sustained_load"] == {"sigma=1.5": {"paella": 200, "ms-jbj": 100},
                                   "sigma=2.0": {"paella": 100, "ms-jbj": 100}}
    assert s["load_ratio_vs_ms_jbj_per_sigma"] == {"sigma=1.5": 2.0, "sigma=2.0": 1.0}
    assert s["load_ratio_vs_ms_jbj"] == 1.0 and s["paella_beats_ms_jbj"] is False
    # p99 compared at ms-jbj's sustained load (100 req/s): 30/10 and 20/10.
    assert s["p99_ratio_ms_jbj_over_paella_at_ms_jbj_load"] == {"sigma=1.5": 3.0, "sigma=2.0": 2.0}
    # One overall bound of 42 ms: ms-jbj's 40 ms at 200 passes where its short model failed.
    o = s["overall_slo"]
    assert o["slo_ms"] == 42.0
    assert o["sustained_load"] == {"sigma=1.5": {"paella": 200, "ms-jbj": 200},
                                   "sigma=2.0": {"paella": 100, "ms-jbj": 100}}
    # mean latency at ms-jbj's sustained load, throughput at saturation, and the claims
    assert s["mean_ratio_ms_jbj_over_paella_at_ms_jbj_load"] == {"sigma=1.5": 3.0, "sigma=2.0": 2.0}
    assert s["saturation"]["ratio_vs_ms_jbj"] == 1.0
    claims = {c["claim"].split(" (")[0]: c for c in s["claims"]}
    assert claims["1.4x the load"]["paper"] == 1.4
    assert [c["reproduced"] for c in s["claims"]] == [False, False, True, True, None]


def test_unknown_system_is_refused():
    with pytest.raises(ValueError, match="unknown systems"):
        mix.run({}, [100.0], [1.5], 10, 1, ["cuda-xx"], 0.0, 10.0)


SMALL = ["resnet18", "squeezenet1_1", "mobilenetv2"]


@pytest.fixture(scope="module")
def small_run():
    missing = [m for m in SMALL if not (DEFAULT_ZOO_DIR / m / "manifest.json").exists()]
    if missing:
        pytest.skip(f"zoo bundles {missing} not compiled in {DEFAULT_ZOO_DIR}; "
                    f"run `paella experiment calibrate` once to compile them")
    from paella.experiments.zoo import ensure_bundles
    bundles = ensure_bundles(SMALL, progress=False)
    return mix.run(bundles, [100.0, 3000.0], [1.5], 60, 1, ["cuda-ss", "cuda-ms", "paella", "ms-jbj"],
                   cpu_scale=0.0, slo_x=10.0)


def test_small_run_structure_and_summary_from_points(small_run):
    data = small_run
    st = data["setting"]
    assert st["models"] == SMALL and st["cpu_scale"] == 0.0
    assert set(st["slo_ms"]) == set(SMALL)
    assert all(math.isclose(st["slo_ms"][m], 10.0 * st["isolated_ms"][m]) for m in SMALL)
    assert math.isclose(st["overall_slo_ms"], 10.0 * st["mean_isolated_ms"])
    per = data["results"]["sigma=1.5"]
    assert list(per) == ["cuda-ss", "cuda-ms", "paella", "ms-jbj"]
    kept = 60 - int(60 * mix.WARMUP)
    for system, pts in per.items():
        assert [p["offered"] for p in pts] == [100.0, 3000.0]
        for p in pts:
            assert set(p["per_model"]) == set(SMALL)
            assert sum(m["count"] for m in p["per_model"].values()) == kept
            # No request beats its model alone on an idle GPU.
            for name, m in p["per_model"].items():
                if m["count"]:
                    assert m["p50_ms"] >= 0.99 * min(st["isolated_ms"].values())
    # Direct and dispatcher points serve the same request sequence.
    for a, b in zip(per["cuda-ss"], per["paella"]):
        assert {k: v["count"] for k, v in a["per_model"].items()} == \
               {k: v["count"] for k, v in b["per_model"].items()}
    s = data["summary"]
    for system, pts in per.items():
        assert s["sustained_load"]["sigma=1.5"][system] == \
            mix.sustained_load(pts, lambda p: mix.meets_slo(p, st["slo_ms"]))
    assert s["load_ratio_vs_ms_jbj"] == mix._ratio(s["sustained_load"]["sigma=1.5"]["paella"],
                                                   s["sustained_load"]["sigma=1.5"]["ms-jbj"])


def test_cuda_ss_saturates_below_paella(small_run):
    per = small_run["results"]["sigma=1.5"]
    ss, pa = per["cuda-ss"][-1], per["paella"][-1]
    # One stream runs one kernel at a time: below 3000 req/s of models 0.4-1.2 ms alone.
    assert ss["throughput"] < 0.9 * ss["offered"]
    assert ss["throughput"] < 0.8 * pa["throughput"]
    assert ss["p99_ms"] > pa["p99_ms"]


def test_report_section_renders_the_run(small_run):
    from paella.experiments import report
    text = "\n".join(report._mix(small_run))
    s = small_run["summary"]
    assert "per-model" in text
    r = s["load_ratio_vs_ms_jbj"]
    assert (f"| 1.4x the load (every model's p99 within 10x its isolated time) | 1.4x | "
            f"{'n/a' if math.isnan(r) else f'{r:.2f}x'} |") in text
    assert "| CUDA-SS | " in text and "| **Paella** | " in text
