"""``paella experiment priority`` (issue 38): the command's JSON contract, and that this
project's mechanism protects the latency-critical tenant where the others do not."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PAELLA = str(Path(sys.executable).with_name("paella"))


def test_the_command_reports_each_mechanism_beside_the_solo_runs(tmp_path):
    out = tmp_path / "p.json"
    r = subprocess.run([PAELLA, "experiment", "priority", "--quick", "--requests", "300",
                        "--json", str(out), "--plot", str(tmp_path / "p.png"),
                        "--trace", str(tmp_path / "p_trace.json"), "--trace-runs", "1"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())["summary"]
    per = s["per_mechanism"]
    assert set(per) == {"paella-classes", "paella", "ms-jbj", "stream-priority"}
    assert s["hp_p99_over_solo"] == per["paella-classes"]["hp_p99_over_solo"]
    assert s["be_throughput_over_solo"] == per["paella-classes"]["be_throughput_over_solo"]
    # classes and slicing protect the latency-critical model; ordering alone does not
    assert per["paella-classes"]["hp_p99_over_solo"] < 1.5
    for other in ("paella", "ms-jbj", "stream-priority"):
        assert per[other]["hp_p99_over_solo"] > 2 * per["paella-classes"]["hp_p99_over_solo"]
    # while the best-effort tenant keeps most of its throughput
    assert per["paella-classes"]["be_throughput_over_solo"] > 0.5
    assert all(0 < m["be_throughput_over_solo"] < 1.2 for m in per.values())
    assert (tmp_path / "p.png").stat().st_size > 10_000
    trace = json.loads((tmp_path / "p_trace.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])
