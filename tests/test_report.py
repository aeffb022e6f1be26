"""docs/EXPERIMENTS.md is generated from the JSON files, and says which are missing."""
import json

from paella.experiments import report


def test_report_renders_from_json_and_names_what_is_missing(tmp_path):
    cal = {"setting": {"gpu": "t4", "model": "timing model"},
           "timing_model": {"launch_latency_us": 0.5, "mem_latency_ns": 500.0, "ilp": 4,
                            "warps_to_hide_arithmetic": 4.0, "peak_tflops": 8.1, "mem_bw_gbs": 320.0},
           "models": {"m": {"kernels": 3, "gflops": 1.0, "simulated_ms": 2.0, "paper_ms": 4.0, "ratio": 0.5,
                            "bound": {"compute": 0.5, "memory": 0.25, "latency": 0.25}}},
           "summary": {"worst_relative_error": 0.5, "goal": 0.25, "within_goal": False,
                       "same_ordering": True, "paper_order": ["m"], "simulated_order": ["m"],
                       "geomean_ratio": 0.5, "ratio_spread": 1.0, "scaled": {"factor": 2.0, "worst_relative_error": 0.0},
                       "feature_bound": {"bound": 0.0, "slower": "m", "faster": "m", "paper_ratio": 1.0,
                                         "max_feature_ratio": 1.0}}}
    (tmp_path / "calibrate.json").write_text(json.dumps(cal))
    text = report.render(tmp_path)
    assert "| m | 3 | 1.00 | 2.00 | 4.00 | 0.50 | 50% / 25% / 25% |" in text
    assert "**not met**" in text
    assert "hol.json` is missing" in text


def test_the_committed_figures_render():
    """docs/EXPERIMENTS.md is generated from docs/figures/*.json: every committed JSON must
    still render with the current report code (a format change needs a re-run)."""
    from pathlib import Path

    from paella.experiments import report
    figures = Path(__file__).resolve().parents[1] / "docs" / "figures"
    text = report.render(figures)
    for name, title, _, _ in report.SECTIONS:
        assert title in text
        assert (figures / f"{name}.json").is_file(), f"docs/figures/{name}.json is missing"


def test_saturation_follows_the_arrivals_a_point_had():
    """A run whose lognormal arrivals came at 0.85x the nominal rate and were all served
    is not saturated; one served at half the rate its arrivals had is."""
    from paella.experiments.harness import saturated
    assert not saturated({"offered": 100.0, "arrival_rate": 85.0, "throughput": 84.0})
    assert saturated({"offered": 100.0, "arrival_rate": 150.0, "throughput": 100.0})
    assert saturated({"offered": 100.0, "throughput": 85.0})       # (older JSON: nominal)


def test_experiment_json_is_strict(tmp_path):
    """NaN and infinities (a class with no request after warm-up, a ratio of two zeros)
    are written as null: strict JSON parsers read the file."""
    import math
    from types import SimpleNamespace

    from paella.experiments.cli import save_outputs
    out = tmp_path / "x.json"
    save_outputs({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": -math.inf}, "e": 2},
                 SimpleNamespace(json=str(out), plot=None), None)
    assert json.loads(out.read_text(), parse_constant=lambda c: 1 / 0) == \
        {"a": None, "b": [1.0, None], "c": {"d": None}, "e": 2}


def test_arrival_rate_is_the_rate_the_arrivals_had():
    import numpy as np

    from paella.experiments.workload import arrival_rate, lognormal_arrivals
    assert arrival_rate(np.array([1.0, 1.5, 2.0, 3.0]), 99.0) == 1.5      # 3 gaps in 2 s
    assert arrival_rate(np.array([1.0]), 99.0) == 99.0
    a = lognormal_arrivals(100.0, 2.5, 200, 9)
    assert arrival_rate(a, 100.0) > 1.3 * 100.0                          # the heavy-tailed draw: 1.32x
