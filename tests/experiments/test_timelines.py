"""``paella experiment timelines``: the schedules drawn from traces are the schedules the
dispatcher made (Figure 1's ideal completion times; Figure 2's queueing under ms-jbj)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PAELLA = str(Path(sys.executable).with_name("paella"))


def test_the_figure_1_toy_is_drawn_from_the_ideal_schedule():
    from paella.experiments.timelines import figure1
    rec, done = figure1("paella")
    assert [round(done[t] * 1e3, 1) for t in range(4)] == [3.0, 3.0, 6.0, 6.0]
    kernels = [e for e in rec.events() if e.get("cat") == "kernel"]
    assert len(kernels) == 12 and all(abs(e["dur"] - 1000) < 5 for e in kernels)
    _, naive = figure1("ms-jbj")
    assert sum(naive.values()) > sum(done.values())


def test_the_command_writes_json_plots_and_traces(tmp_path):
    out = tmp_path / "t.json"
    r = subprocess.run([PAELLA, "experiment", "timelines", "--quick", "--json", str(out),
                        "--plot", str(tmp_path / "t.png"), "--trace-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["figure2"]["paella"]["p99_ms"] < d["figure2"]["ms-jbj"]["p99_ms"]
    assert (tmp_path / "t.png").stat().st_size > 10_000
    assert (tmp_path / "t_hol.png").stat().st_size > 10_000
    assert (tmp_path / "t_priority.png").stat().st_size > 10_000
    p = d["priority"]                  # a stretch of the priority experiment (issue 38)
    assert p["paella-classes"]["hp_p99_ms"] < p["paella"]["hp_p99_ms"] / 2
    doc = json.loads((tmp_path / "timeline_priority_paella-classes.json").read_text())
    assert any(e.get("name") == "slice" for e in doc["traceEvents"])
    doc = json.loads((tmp_path / "timeline_figure1_paella.json").read_text())
    assert sum(1 for e in doc["traceEvents"] if e.get("cat") == "kernel") == 12
