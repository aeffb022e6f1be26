"""The overhead experiment (Figure 10): its arithmetic on a hand-made trace, and a real
run through the traced daemon with a tiny compiled model and a real client."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from paella.experiments import overhead as ov

US = 1e-6


def test_breakdown_partitions_a_known_trace():
    """Client 0..100 us; daemon admits at 10, pushes at 90; GPU: H2D 20-30, kernel
    40-60, D2H 70-80; simulator calls 12-16, 25-35 (half over the H2D), 62-66; the CPU
    build 16-19. Only simulator time while the GPU is idle counts as device time."""
    samples = [ov.Sample(1, 7, 0.0, 100 * US)]
    trace = {"requests": np.array([[1, 7, 10 * US, 60 * US, 90 * US]]),
             "ops": np.array([[20, 30, 1], [40, 60, 0], [70, 80, 2]], float) * [US, US, 1],
             "sim": np.array([[12, 16], [25, 35], [62, 66]], float) * US,
             "functional": np.array([[16, 19]], float) * US}
    (r,) = ov.breakdown(samples, trace)
    want = {"comm_in": 10, "comm_out": 10, "device_busy": 40, "device_span": 60,
            "sched_start": 3, "sched_gaps": 11, "sched_completion": 10,
            "sim_cpu_idle": 13, "functional_cpu_idle": 3,
            "communication": 20, "scheduling_framework": 24, "device": 56, "e2e": 100,
            "kernels": 1, "wake_before_push": 30}
    for k, v in want.items():
        assert r[k] == pytest.approx(v, abs=1e-6), k
    assert r["residual"] == pytest.approx(0, abs=1e-6)


def test_breakdown_refuses_a_request_without_device_work():
    trace = {"requests": np.array([[1, 1, 10 * US, np.nan, 20 * US]]), "ops": np.zeros((0, 3)),
             "sim": np.zeros((0, 2)), "functional": np.zeros((0, 2))}
    with pytest.raises(RuntimeError, match="no device operation"):
        ov.breakdown([ov.Sample(1, 1, 0.0, 30 * US)], trace)


@pytest.fixture(scope="module")
def tiny_bundle():
    from paella.compiler_pass.build import compile_bundle
    from paella.models.tiny import tiny_mlp
    d = tempfile.mkdtemp(prefix="ploverhead")
    compile_bundle(tiny_mlp(), os.path.join(d, "tiny_mlp"))
    yield Path(d) / "tiny_mlp"
    shutil.rmtree(d, ignore_errors=True)


def test_real_daemon_breakdown_adds_up(tiny_bundle):
    """Real daemon and client processes: every component of every request is positive,
    they add up to the client's end-to-end latency, and the GPU-busy component is
    exactly the simulated GPU's time for the request alone (virtual time) less the launch
    latencies between its operations."""
    setting = ov.Setting("tiny_mlp", "t4", "paella", n=30, idle_n=5, echo_n=30, spin_n=5,
                         idle_gap_ms=5.0, sim_mode="stepped",
                         daemon_args=["--cpu", "none", "--rt-priority", "0"], seed=1)
    data = ov.run(tiny_bundle, setting, progress=lambda m: None, untraced=False)
    assert {k: c["n"] for k, c in data["cases"].items()} == {"back_to_back": 30, "after_idle": 5,
                                                                   "spin_back_to_back": 5}
    for name, case in data["cases"].items():
        st = case["stats_us"]
        # comm_out too: the daemon's share ends just before the completion is pushed
        # (job_finished), so no client, however fast it spins, can read it earlier.
        for k in ("comm_in", "comm_out", "sched_start", "sched_gaps", "sched_completion",
                  "device_busy", "e2e"):
            assert st[k]["min"] > 0, (name, k)
        for k in ("sim_cpu_idle", "functional_cpu_idle"):
            assert st[k]["min"] >= 0, k
        assert max(abs(st["residual"]["min"]), abs(st["residual"]["max"])) < 0.01
        parts = sum(st[k]["mean"] for k in ov.COMPONENTS)
        assert parts == pytest.approx(st["e2e"]["mean"], rel=1e-6)
        # busy: exactly the request alone. The traced device records each op from its
        # submission (the device is idle then, one request at a time) to its completion, so
        # the front end's launch latency before each kernel is device time, as it is in the
        # isolated time.
        assert st["device_busy"]["min"] == pytest.approx(data["isolated_device_us"], rel=1e-6)
        assert st["device_busy"]["max"] == pytest.approx(data["isolated_device_us"], rel=1e-6)
    assert data["echo"]["n"] == 30
    assert 0 < data["echo"]["communication_p50_us"] <= data["echo"]["e2e_p50_us"]
    assert data["summary"]["max_abs_residual_us"] < 0.01


def test_report_section_renders_the_committed_run(tmp_path):
    """docs/EXPERIMENTS.md's Figure 10 section is made from docs/figures/overhead.json."""
    import json
    from paella.experiments import report
    src = Path(__file__).resolve().parents[2] / "docs" / "figures" / "overhead.json"
    shutil.copy(src, tmp_path / "overhead.json")
    text = report.render(tmp_path)
    d = json.loads(src.read_text())
    med = d["summary"]["median_us"]
    assert "## Overhead breakdown of one request (Figure 10)" in text
    assert f"| communication | {med['communication']:.0f} us |" in text
    assert f"| scheduling and framework | {med['scheduling_framework']:.0f} us |" in text
    assert "overhead.json` is missing" not in text
