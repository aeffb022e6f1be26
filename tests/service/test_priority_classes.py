"""Priority classes per tenant (issue 38, item 1): ``[access] class_default`` gives a
request that names no class its tenant's, ``class_highest`` bounds what a tenant may ask
for. A hostile client asking for the top class is clamped to its bound, the clamp is
counted and logged a few lines at most, and ``paella status`` and the metrics show the
requests per class."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

import paella
from paella.client.status import daemon_status, format_status
from service_daemon import cleanup, free_port, start_daemon

#: A client as uid 65534 (nobody): SO_PEERCRED reports the effective uid at connect.
_AS_NOBODY = """
import os, sys
import numpy as np
import paella
paella.connect(sys.argv[1]).close()          # (imports everything while root can read it)
os.setresuid(-1, 65534, -1)
c = paella.connect(sys.argv[1])
os.setresuid(-1, 0, -1)
for p in map(int, sys.argv[2].split(",")):
    c.infer("noop", {"x": np.zeros(64, np.uint8)}, timeout=30, priority=p)
c.close()
"""


@pytest.fixture(scope="module")
def classed():
    port = free_port()
    dp = start_daemon("--allow-user", "nobody", "--metrics-port", str(port),
                      "--class-highest", "nobody=100", "--class-default", "nobody=150",
                      "--class-default", "*=40")
    os.chmod(dp.dir, 0o755)
    dp.metrics_port = port
    yield dp
    cleanup(dp)


def _classes(dp) -> tuple[dict, int]:
    time.sleep(0.06)                  # (a STATUS reply is reused for 50 ms)
    c = daemon_status(dp.socket)["classes"]
    return {int(k): v for k, v in c["accepted"].items()}, c["clamped"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_a_hostile_tenant_asking_for_the_top_class_is_clamped_counted_and_logged(classed):
    before, clamped0 = _classes(classed)
    asks = [1] * 40 + [0, 0, 120]
    r = subprocess.run([sys.executable, "-c", _AS_NOBODY, classed.socket,
                        ",".join(map(str, asks))], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    after, clamped = _classes(classed)
    got = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # 1 -> clamped to nobody's highest (100); 0 -> nobody's default (150); 120 as asked
    assert got.get(100) == 40 and got.get(150) == 2 and got.get(120) == 1, got
    assert got.get(1, 0) == 0
    assert clamped - clamped0 == 40
    lines = [ln for ln in classed.log().splitlines() if "clamped" in ln and "class_highest" in ln]
    assert 1 <= len(lines) <= 10, lines           # rate-limited, not one line per request
    assert "asked for priority class 1" in lines[0] and "(100" in lines[0]
    text = format_status(daemon_status(classed.socket))
    assert "priority classes (accepted)" in text and "clamped" in text


def test_the_owner_is_not_bounded_and_gets_the_default_of_everyone(classed):
    before, clamped0 = _classes(classed)
    with paella.connect(classed.socket) as c:
        c.infer("noop", {"x": np.zeros(64, np.uint8)}, timeout=30, priority=1)
        c.infer("noop", {"x": np.zeros(64, np.uint8)}, timeout=30)
    after, clamped = _classes(classed)
    assert after.get(1, 0) - before.get(1, 0) == 1          # no bound for "*"
    assert after.get(40, 0) - before.get(40, 0) == 1        # "*"'s default
    assert clamped == clamped0
    # Every request answered: none left in flight in any class (the count goes down).
    assert daemon_status(classed.socket)["classes"]["in_flight"] == {}


def test_the_metrics_count_requests_per_class(classed):
    with paella.connect(classed.socket) as c:
        c.infer("noop", {"x": np.zeros(64, np.uint8)}, timeout=30, priority=7)
    with urllib.request.urlopen(f"http://127.0.0.1:{classed.metrics_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    assert 'paella_requests_by_class_total{class="7"}' in text
    assert "paella_priority_clamped_total" in text


@pytest.mark.parametrize("toml, msg", [
    ('class_highest = { "*" = 0 }', "a class is an int 1..255"),
    ('class_default = { "bob smith" = 3 }', "is not a tenant"),
    ('class_default = { "*" = 300 }', "a class is an int 0..255"),
    ('class_default = { "*" = 2 }\nclass_highest = { "*" = 5 }', "every request of"),
    ('class_highest = 5', "must be dict"),
])
def test_bad_class_tables_are_refused_naming_the_cause(tmp_path, toml, msg):
    conf = tmp_path / "paella.toml"
    conf.write_text("[access]\n" + toml + "\n")
    r = subprocess.run([sys.executable, "-m", "paella.dispatcher.daemon", "--config", str(conf),
                        "--socket", str(tmp_path / "s.sock")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_class_option_that_is_not_who_equals_n_is_a_usage_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "paella.dispatcher.daemon", "--class-highest", "bob",
                        "--socket", str(tmp_path / "s.sock")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "expected WHO=N" in r.stderr
