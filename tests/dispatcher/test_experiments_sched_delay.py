"""Figure 9: a delay per scheduling decision shows up in the latency, and the headroom
summary is computed from the points."""
from paella.experiments import sched_delay


def test_a_long_delay_per_decision_raises_latency_and_bounds_the_headroom():
    data = sched_delay.run([0, 200], [300], sigma=1.5, n=150, seed=2)
    base, slow = data["points"]["0"][0], data["points"]["200"][0]
    # 200 us per release on ~23-kernel ResNet-18 jobs adds milliseconds to every request.
    assert slow["per_model"]["resnet18"]["p50_ms"] > base["per_model"]["resnet18"]["p50_ms"] + 2.0
    ratio = data["summary"]["p99_ratio_to_no_delay"]
    assert ratio["0"] == [1.0]
    assert ratio["200"][0] > sched_delay.TOLERANCE
    assert data["summary"]["headroom_us"] == 0


def test_the_report_sets_the_headroom_beside_what_a_kernel_costs_each_path():
    from paella.experiments.report import _decision_cost
    data = sched_delay.run([0], [300], sigma=1.5, n=60, seed=2)
    s = data["summary"]
    assert s["core_decision_us"] == sched_delay.CORE_DECISION_US
    assert s["python_decision_us"] == sched_delay.PYTHON_DECISION_US
    said = _decision_cost({**s, "headroom_us": 10})
    assert f"about {s['core_decision_us']:g} us" in said and "within that headroom" in said
    assert "beyond that headroom" in _decision_cost({**s, "headroom_us": 2})
    # JSON written before the core's figure was recorded names only the Python path's.
    old = {k: v for k, v in s.items() if k != "core_decision_us"}
    assert "headroom" not in _decision_cost(old) and "Python path" in _decision_cost(old)
