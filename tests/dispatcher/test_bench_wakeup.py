"""benchmarks/bench_wakeup: each way wakes the other process every time (the benchmark
would hang otherwise, each wake-up waiting for the sleeper's answer) and reports a
positive cost per way, in its JSON too."""
from __future__ import annotations

import json
import os

import pytest

from paella.benchmarks import bench_wakeup


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="the benchmark wakes a process asleep on another CPU: this "
                    "machine has one")
def test_every_way_wakes_the_sleeper_and_is_timed(tmp_path):
    out = tmp_path / "w.json"
    before = os.sched_getaffinity(0)
    assert bench_wakeup.main(["--n", "20", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["n"] == 20 and set(data["ways"]) == {"socket", "eventfd", "futex"}
    for row in data["ways"].values():
        assert 0 < row["p50_us"] <= row["p90_us"] < 1e5
    assert os.sched_getaffinity(0) == before          # its pinning is undone


def test_too_few_wake_ups_are_refused():
    with pytest.raises(SystemExit):
        bench_wakeup.main(["--n", "3"])
