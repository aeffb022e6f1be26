"""``paella trace`` around runs in virtual time: an experiment (``--experiment``, the same
as ``paella experiment NAME --trace``) and a benchmark (``--benchmark``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PAELLA = str(Path(sys.executable).with_name("paella"))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PAELLA, *args], capture_output=True, text=True, timeout=600)


def test_an_experiment_run_is_traced_one_group_of_tracks_per_dispatcher(tmp_path):
    out = tmp_path / "t.json"
    r = _run("trace", "--experiment", "timelines", "-o", str(out), "--runs", "3", "--",
             "--quick")
    assert r.returncode == 0, r.stderr
    assert "3 dispatcher run(s)" in r.stderr
    doc = json.loads(out.read_text())
    assert doc["otherData"]["runs"] == 3 and doc["otherData"]["source"].endswith("timelines")
    names = [e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"]
    assert names[:3] == [f"run 1 (paella on two-sm): {p}" for p in ("requests", "GPU", "policy")]
    # The first run is Figure 1's toy under paella: 4 tasks of 3 kernels (+ the profiling
    # runs' own requests, one per task).
    first = [e for e in doc["traceEvents"] if e.get("cat") == "kernel" and e["pid"] == 2]
    assert len(first) == 12 + 4 * 3


def test_a_benchmark_run_is_traced_and_a_bad_name_is_a_clear_error(tmp_path):
    out = tmp_path / "b.json"
    r = _run("trace", "--benchmark", "bench_trace", "-o", str(out), "--runs", "1", "--",
             "--jobs", "60", "--repeat", "1")
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["otherData"]["runs"] == 1 and doc["otherData"]["kernels"] >= 60 * 8
    r = _run("trace", "--benchmark", "../../etc/passwd", "-o", str(out))
    assert r.returncode == 2 and "no benchmark" in r.stderr and "Traceback" not in r.stderr


def test_instruments_for_every_dispatcher_only_while_registered():
    from paella.dispatcher.core import Dispatcher
    from paella.dispatcher.devices.sim import SimDevice
    from paella.dispatcher.instruments import Instrument, instrument_every_dispatcher

    class Seen(Instrument):
        def job_finished(self, job): ...
    made = []
    with instrument_every_dispatcher(lambda d: made.append(Seen()) or made[-1]):
        d1 = Dispatcher(SimDevice("t4"), "paella")
    d2 = Dispatcher(SimDevice("t4"), "paella")
    assert len(made) == 1 and made[0] in d1.instruments["job_finished"]
    assert "job_finished" not in d2.instruments


def test_bad_trace_options_are_usage_errors(tmp_path):
    for args, msg in ((["--runs", "0", "--experiment", "timelines"], "--runs must be >= 1"),
                      (["--seconds", "0", "--socket", str(tmp_path / "none.sock")],
                       "a trace lasts 0.001 to 600 seconds"),
                      (["--", "--quick"], "unexpected arguments")):
        r = _run("trace", "-o", str(tmp_path / "t.json"), *args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
