"""``paella experiment short-long`` (Figure 12): the summary's definition, the synthetic
models' Table 2 times, and one small run."""
import math

from paella.experiments import short_long as sl


def point(offered, throughput, r18_p99):
    return {"offered": offered, "throughput": throughput,
            "per_model": {"resnet18": {"p99_ms": r18_p99}, "inception_v3": {"p99_ms": 50.0}}}


def test_speedup_is_the_max_over_unsaturated_paella_loads():
    results = {"sigma=2.0": {
        "paella": [point(100, 100, 4.0), point(200, 195, 5.0), point(300, 200, 1.0)],
        "ms-jbj": [point(100, 100, 6.0), point(200, 195, 12.5), point(300, 200, 90.0)]}}
    s = sl.summarize(results, cpu_scale=0.0)
    # 300 req/s is saturated for paella (200 < 0.9 * 300): its 90x does not count.
    assert s["short_p99_speedup"] == 2.5
    assert s["short_p99_speedup_at"] == {"sigma": "sigma=2.0", "offered": 200}
    assert s["meets_2x"] is True and s["cpu_scale"] == 0.0


def test_synthetic_models_add_up_to_table_2():
    assert math.isclose(sl.resnet18().isolated_time, 1.58e-3, rel_tol=1e-9)
    assert math.isclose(sl.inception_v3().isolated_time, 31.2e-3, rel_tol=1e-9)
    w = {x.name: x.weight for x in sl.workloads()}
    assert math.isclose(w["resnet18"] / w["inception_v3"], 31.2 / 1.58)


def test_a_small_run_reports_each_models_p99_per_policy():
    data = sl.run([200.0], [1.5], n=80, seed=1, policies=["paella", "ms-jbj"], cpu_scale=0.0)
    per = data["results"]["sigma=1.5"]
    for pol in ("paella", "ms-jbj"):
        assert set(per[pol][0]["per_model"]) == {"resnet18", "inception_v3"}
        assert per[pol][0]["per_model"]["resnet18"]["p99_ms"] >= 1.58
    assert data["summary"]["short_p99_speedup"] > 0
    assert data["setting"]["cpu_scale"] == 0.0
