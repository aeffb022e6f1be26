"""The head-of-line experiment is the test of the model: both effects must show."""
from paella.experiments import hol


def test_naive_submission_is_capped_near_the_queue_count_and_aware_release_is_not():
    data = hol.run([12e3, 16e3, 60e3], n_jobs=1500, sigma=1.5, seed=3, slo_ms=24.0)
    assert data["possible_resident_blocks"] == 176
    # 32 queues, one running kernel each, plus brief overlap when a queue's head
    # moves to the next job's first kernel.
    assert data["naive_peak_resident_blocks"] <= 40
    assert data["aware_peak_resident_blocks"] >= 140
    assert data["goodput_ratio"] >= 2.0
    naive_hi = data["results"]["naive"][-1]
    assert naive_hi["throughput"] < 0.3 * 60e3     # naive saturates near 14k jobs/s
