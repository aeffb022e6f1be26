"""``paella perf`` against a real daemon: local rings and KServe, both sweeps, the
outputs (JSON, CSV, plot), and the arrival processes' statistics."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paella.client.perf import arrival_gaps
from service_daemon import start_kserve

PAELLA = str(Path(sys.executable).with_name("paella"))


def perf(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PAELLA, "perf", *args], capture_output=True, text=True, timeout=120)


def test_concurrency_sweep_over_the_rings_writes_json_csv_and_plot(daemon, tmp_path):
    r = perf("echo", "--socket", daemon.socket, "--concurrency", "1,2", "--seconds", "1",
             "--warmup", "0.2", "--json", str(tmp_path / "p.json"), "--csv",
             str(tmp_path / "p.csv"), "--plot", str(tmp_path / "p.png"))
    assert r.returncode == 0, r.stderr
    assert "[concurrency 2]" in r.stderr                     # progress while it runs
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["transport"] == "local-rings" and [p["concurrency"] for p in res["points"]] == [1, 2]
    for p in res["points"]:
        assert p["requests"] > 0 and p["errors"] == 0
        assert 0 < p["p50_ms"] <= p["p90_ms"] <= p["p99_ms"]
        assert p["throughput_rps"] == pytest.approx(p["requests"] / p["seconds"])
    rows = list(csv.DictReader(open(tmp_path / "p.csv")))
    assert [r["Concurrency"] for r in rows] == ["1", "2"]
    assert int(rows[0]["p99 latency"]) == round(res["points"][0]["p99_ms"] * 1e3)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("arrivals", ["poisson", "lognormal"])
def test_rate_sweep(daemon, arrivals, tmp_path):
    # 3 points x 30 workers: more connections than a uid may hold at once (64), unless
    # each point's are closed before the next
    r = perf("noop", "--socket", daemon.socket, "--rate", "40,40,40", "--arrivals", arrivals,
             "--sigma", "0.5", "--seconds", "1", "--warmup", "0.1", "--workers", "30",
             "--json", str(tmp_path / "r.json"), "-q")
    assert r.returncode == 0, r.stderr
    points = json.loads((tmp_path / "r.json").read_text())["points"]
    assert len(points) == 3
    for p in points:
        assert p["rate"] == 40 and p["errors"] == 0
        assert 8 <= p["throughput_rps"] <= 120        # 40/s on average, random arrivals


def test_over_kserve(daemon, tmp_path):
    proc, hp, _gp, log = start_kserve(daemon.socket)
    try:
        r = perf("echo", "--kserve", f"127.0.0.1:{hp}", "--concurrency", "2", "--seconds", "1",
                 "--warmup", "0.2", "--json", str(tmp_path / "k.json"), "-q")
        assert r.returncode == 0, r.stderr
        [p] = json.loads((tmp_path / "k.json").read_text())["points"]
        assert p["requests"] > 0 and p["errors"] == 0
        r = perf("nope", "--kserve", f"127.0.0.1:{hp}", "-q")
        assert r.returncode == 2 and "unknown model 'nope'" in r.stderr
        # Triton's priority request parameter, accepted by the front end and the daemon
        r = perf("echo", "--kserve", f"127.0.0.1:{hp}", "--concurrency", "1", "--seconds",
                 "0.5", "--warmup", "0", "--priority", "2", "--json", str(tmp_path / "q.json"),
                 "-q")
        assert r.returncode == 0, r.stderr
        res = json.loads((tmp_path / "q.json").read_text())
        assert res["priority"] == 2 and res["points"][0]["errors"] == 0
    finally:
        proc.terminate()
        proc.wait(15)


def test_bad_targets_are_clear_errors(daemon, tmp_path):
    r = perf("nope", "--socket", daemon.socket, "-q")
    assert r.returncode == 2 and "serves no model 'nope'" in r.stderr
    r = perf("echo", "--socket", str(tmp_path / "none.sock"), "-q")
    assert r.returncode == 2 and "no paella daemon listens" in r.stderr
    r = perf("echo", "--socket", daemon.socket, "--rate", "0")
    assert r.returncode == 2 and "positive numbers" in r.stderr
    assert "Traceback" not in r.stderr
    for bad in ("256", "-1"):
        r = perf("echo", "--socket", daemon.socket, "--priority", bad, "-q")
        assert r.returncode == 2 and "--priority must be 1 (most urgent) .. 255" in r.stderr
        assert "Traceback" not in r.stderr
    # found by review: tracebacks after (or instead of) the whole run
    for args, text in ((["--rate", "nan"], "expected positive numbers"),
                       (["--rate", "inf"], "expected positive numbers"),
                       (["--seconds", "nan"], "must be positive"),
                       (["--csv", str(tmp_path / "no" / "x.csv")], "not a file in an existing"),
                       (["--json", str(tmp_path)], "not a file in an existing directory")):
        r = perf("echo", "--socket", daemon.socket, *args, "-q")
        assert r.returncode == 2 and text in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = perf("echo", "--kserve", "127.0.0.1:\u00b2", "-q")      # str.isdigit takes "²"
    assert r.returncode == 2 and "--kserve wants HOST:PORT" in r.stderr, r.stderr
    for t in ("nan", "-1"):
        r = subprocess.run([PAELLA, "status", "--socket", daemon.socket, "--timeout", t],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--timeout must be a number of seconds" in r.stderr
    for args in (["hol", "--jobs", "-1"], ["hol", "--sigma", "nan"], ["mix", "--requests", "0"]):
        r = subprocess.run([PAELLA, "experiment", *args], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "must be a finite number" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_a_priority_over_the_rings(daemon, tmp_path):
    r = perf("echo", "--socket", daemon.socket, "--concurrency", "2", "--seconds", "0.5",
             "--warmup", "0", "--priority", "1", "--json", str(tmp_path / "p.json"), "-q")
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["priority"] == 1 and res["points"][0]["requests"] > 0
    assert res["points"][0]["errors"] == 0


@pytest.mark.parametrize("arrivals,cv", [("poisson", 1.0), ("lognormal", np.sqrt(np.e - 1)),
                                         ("constant", 0.0)])
def test_arrival_processes_have_the_asked_mean_and_spread(arrivals, cv):
    gaps = arrival_gaps(250.0, arrivals, 1.0, 200_000)
    assert gaps.mean() == pytest.approx(1 / 250, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, abs=0.06)
