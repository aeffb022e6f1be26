"""The daemon serving compiled bundles through the Dispatcher on the real-time
simulated GPU: answers equal the bundle's CPU reference, across real processes."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from paella.client import NONBLOCK, connect
from service_daemon import cleanup, start_daemon


@pytest.fixture(scope="module")
def repo():
    """A model repository with the tiny MLP (compiled once; the compile cache makes
    later runs quick)."""
    from paella.compiler_pass.build import compile_bundle
    from paella.models.tiny import tiny_mlp
    d = tempfile.mkdtemp(prefix="plrepo")
    compile_bundle(tiny_mlp(), os.path.join(d, "tiny_mlp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def served(repo):
    dp = start_daemon("--models", repo)
    yield dp
    cleanup(dp)


def test_infer_equals_cpu_reference(served, repo):
    from paella.bundle import load_bundle
    b = load_bundle(os.path.join(repo, "tiny_mlp"))
    rng = np.random.default_rng(3)
    with connect(served.socket) as c:
        assert set(c.models) == {"echo", "noop", "tiny_mlp"}
        assert c.models["tiny_mlp"].variants[0].io_bytes == b.io_bytes
        for _ in range(20):
            x = rng.standard_normal((2, 16)).astype(np.float32)
            got = c.infer("tiny_mlp", {"x": x})["output0"]
            np.testing.assert_allclose(got, b.run_cpu({"x": x})["output0"], rtol=1e-6, atol=1e-6)
    assert "stepped from the dispatcher loop" in served.log()
    assert "backend auto: sim" in served.log()


def test_nonblock_eagain_while_the_jobs_run(served):
    """NONBLOCK polling of 64 jobs that take milliseconds of simulated GPU time sees
    EAGAIN while they run (a count, so a descheduled test process cannot flake it)."""
    with connect(served.socket) as c:
        n = c.models["tiny_mlp"].variants[0].io_bytes
        offs = [c.alloc(n) for _ in range(64)]
        ids = [c.predict("tiny_mlp", n, o) for o in offs]
        got, eagain = [], 0
        deadline = time.monotonic() + 20
        while len(got) < len(ids) and time.monotonic() < deadline:
            r = c.read_result(NONBLOCK)
            if r == -errno.EAGAIN:
                eagain += 1
            else:
                got.append(r)
        assert sorted(got) == ids
        assert eagain > 0
        assert c.read_result(NONBLOCK) == -errno.EAGAIN


CHECKER = """
import numpy as np, sys
from paella.client import connect
from paella.bundle import load_bundle
b = load_bundle(REPO + "/tiny_mlp")
c = connect(SOCK, mode=MODE)
rng = np.random.default_rng(SEED)
xs = [rng.standard_normal((2, 16)).astype(np.float32) for _ in range(40)]
for x in xs:
    got = c.infer("tiny_mlp", {"x": x})["output0"]
    assert np.allclose(got, b.run_cpu({"x": x})["output0"], rtol=1e-6, atol=1e-6)
print("ok")
"""


def test_concurrent_client_processes_get_right_answers(served, repo):
    procs = []
    for k, mode in enumerate(("hybrid", "polling", "socket", "hybrid")):
        code = (f"SOCK = {served.socket!r}\nREPO = {repo!r}\nMODE = {mode!r}\nSEED = {k}\n"
                + CHECKER)
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok", err


KILLABLE = """
import numpy as np
from paella.client import connect
c = connect(SOCK)
n = c.models["tiny_mlp"].variants[0].io_bytes
offs = [c.alloc(n) for _ in range(32)]
for o in offs:
    c.predict("tiny_mlp", n, o)
print(c.segment_name, flush=True)
import time; time.sleep(60)
"""


def test_sigkill_with_jobs_on_the_gpu(served):
    p = subprocess.Popen([sys.executable, "-c", f"SOCK = {served.socket!r}\n" + KILLABLE],
                         stdout=subprocess.PIPE, text=True)
    name = p.stdout.readline().strip()
    p.kill()
    p.wait()
    p.stdout.close()
    segment = name.removeprefix("memfd:")
    assert segment.startswith(f"paella.{served.pid}.")
    deadline = time.monotonic() + 10                     # the daemon lets go of the segment
    while segment in served.segments() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert segment not in served.segments()
    with connect(served.socket) as c:                    # still serving
        assert c.infer("tiny_mlp", {"x": np.ones((2, 16), np.float32)})["output0"].shape == (2, 8)


def test_sigterm_finishes_gpu_jobs_then_exits_zero(repo):
    dp = start_daemon("--models", repo)
    try:
        c = connect(dp.socket)
        n = c.models["tiny_mlp"].variants[0].io_bytes
        offs = [c.alloc(n) for _ in range(16)]
        for o in offs:
            c.arena[o:o + 128].view(np.float32)[:] = 1.0
            c.predict("tiny_mlp", n, o)
        dp.proc.send_signal(signal.SIGTERM)
        assert dp.proc.wait(30) == 0
        ok = sum(1 for _ in range(16) if c.read_result() > 0)
        assert ok == 16                                  # drained, not cancelled
        assert dp.segments() == []
        c.close()
    finally:
        cleanup(dp)


def test_sighup_picks_up_a_new_bundle(repo):
    extra = tempfile.mkdtemp(prefix="plrepo2")
    shutil.copytree(os.path.join(repo, "tiny_mlp"), os.path.join(extra, "tiny_mlp"))
    dp = start_daemon("--models", extra, "--no-echo", "--no-noop")
    try:
        with connect(dp.socket) as c:
            assert set(c.models) == {"tiny_mlp"}
            shutil.rmtree(os.path.join(extra, "tiny_mlp"))
            dp.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while c.list_models() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.models == {}
            shutil.copytree(os.path.join(repo, "tiny_mlp"), os.path.join(extra, "tiny_mlp"))
            dp.proc.send_signal(signal.SIGHUP)
            while "tiny_mlp" not in c.list_models() and time.monotonic() < deadline:
                time.sleep(0.05)
            x = np.ones((2, 16), np.float32)
            assert c.infer("tiny_mlp", {"x": x})["output0"].shape == (2, 8)
    finally:
        cleanup(dp)
        shutil.rmtree(extra, ignore_errors=True)
