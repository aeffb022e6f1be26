"""``paella experiment fairness`` (Figure 13) on a small run: threshold 0 behaves like
fifo (Paella-SS), no threshold is SRPT (short jobs far ahead of long ones)."""
import pytest

from paella.experiments import fairness


@pytest.fixture(scope="module")
def small_run():
    return fairness.run([0.0, 1e9], rate=300.0, sigma=1.5, n=120, seed=1, cpu_scale=0.0)


def test_threshold_zero_approaches_fifo_and_no_threshold_is_srpt(small_run):
    s = small_run["summary"]
    assert len(s["thresholds"]) == len(s["short_mean_ms"]) == len(s["long_mean_ms"]) == 2
    fifo_ratio = s["fifo_long_short_ratio"]
    zero, srpt = s["long_short_ratio"]
    assert abs(zero - fifo_ratio) <= 0.25 * fifo_ratio
    assert abs(s["short_mean_ms"][0] - s["fifo_short_mean_ms"]) <= 0.25 * s["fifo_short_mean_ms"]
    assert srpt >= 3 * fifo_ratio
    assert s["short_mean_ms"][1] < 0.5 * s["short_mean_ms"][0]
    assert s["approaches_fifo"] is True


def test_per_client_deficits_at_zero_starve_the_heavier_client():
    # Documented contrast: equal kernel shares between a client sending 8-kernel jobs
    # and one sending 40-kernel jobs favour the former; this is not fifo.
    data = fairness.run([0.0], rate=300.0, sigma=1.5, n=120, seed=1, cpu_scale=0.0,
                        fairness_unit="client")
    s = data["summary"]
    assert s["long_short_ratio"][0] > 3 * s["fifo_long_short_ratio"]
    assert data["setting"]["fairness_unit"] == "client"
