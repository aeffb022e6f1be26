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


def _settled(c, dp, models: int, memory: int | None, timeout: float = 20.0) -> dict:
    """The daemon's status once the dispatcher holds ``models`` models (and ``memory``
    bytes of device memory, if given)."""
    deadline = time.monotonic() + timeout
    while True:
        st = c.status()["dispatcher"]
        if st["models"] == models and memory in (None, st["device_memory_bytes"]):
            return st
        assert time.monotonic() < deadline, (st, dp.log())
        time.sleep(0.05)


def test_reloads_free_the_versions_they_replace_and_remove(repo):
    """A changed bundle reloaded again and again, each time with requests in flight:
    every request is answered once, and the daemon ends up holding one version's
    device memory and dispatcher models, not one per reload. Removing the folder frees
    the last one."""
    extra = tempfile.mkdtemp(prefix="plrepo3")
    folder = os.path.join(extra, "tiny_mlp")
    shutil.copytree(os.path.join(repo, "tiny_mlp"), folder)
    dp = start_daemon("--models", extra, "--no-echo", "--no-noop")
    try:
        with connect(dp.socket) as c:
            first = _settled(c, dp, 1, None)
            held = first["device_memory_bytes"]
            assert held > 0
            n = c.models["tiny_mlp"].variants[0].io_bytes
            offs = [c.alloc(n) for _ in range(8)]
            for k in range(4):
                for o in offs:
                    c.arena[o:o + 128].view(np.float32)[:] = k
                    c.predict("tiny_mlp", n, o)
                manifest = os.path.join(folder, "manifest.json")
                os.utime(manifest, (time.time() + 10 * (k + 1),) * 2)   # a changed bundle
                reads = dp.log().count("SIGHUP: repository read")
                dp.proc.send_signal(signal.SIGHUP)
                assert all(c.read_result(timeout=20) > 0 for _ in offs)
                deadline = time.monotonic() + 30
                while dp.log().count("SIGHUP: repository read") == reads:
                    assert time.monotonic() < deadline, dp.log()
                    time.sleep(0.05)
                _settled(c, dp, 1, held)             # the old version is gone
            x = np.ones((2, 16), np.float32)
            assert c.infer("tiny_mlp", {"x": x})["output0"].shape == (2, 8)
            shutil.rmtree(folder)
            dp.proc.send_signal(signal.SIGHUP)
            _settled(c, dp, 0, 0)
        assert dp.log().count("registered tiny_mlp") == 5
        assert dp.stop() == 0
    finally:
        cleanup(dp)
        shutil.rmtree(extra, ignore_errors=True)


def test_a_retired_bundle_is_freed_by_reference_counting_alone(repo):
    """The daemon freezes its heap after a reload, so a replaced version whose objects
    form a reference cycle would never be collected: its adaptor, its bundle (weights,
    CPU build) and its dispatcher model must go by reference counting once the last
    request on it is done."""
    import gc
    import weakref
    from paella.bundle import load_bundle
    from paella.dispatcher.core import Dispatcher, Request
    from paella.dispatcher.daemon.bundles import FunctionalCache, bundle_adaptor
    from paella.dispatcher.devices.sim import SimDevice

    dev = SimDevice("t4")
    disp = Dispatcher(dev, "paella", profile_runs=1)
    cache = FunctionalCache()

    def register(k):
        b = load_bundle(os.path.join(repo, "tiny_mlp"))
        ad = bundle_adaptor(b, f"tiny#{k}", dev, cache)
        ad.warm()
        disp.register_model(f"tiny#{k}/v", ad, model_id=5)
        return [weakref.ref(ad), weakref.ref(b), weakref.ref(disp.models[5])]

    def serve(n):
        for i in range(n):
            disp.submit(Request(i, 0, 5, np.zeros(disp.models[5].adaptor.io_bytes, np.uint8)))
            disp.run_until_idle()

    old = register(1)
    serve(3)
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        register(2)                          # retires #1, idle: removed now
        # (the policy's arrival-order heap lets go of finished jobs lazily, bounded)
        serve(200)
        assert [r() is None for r in old] == [True, True, True]
        assert dev.allocated_bytes == sum(
            nb for name, nb in disp.models[5].adaptor.plan.buffers.items()
            if name in disp.models[5].adaptor.plan.params) + \
            sum(disp.models[5].adaptor.plan.request_buffers.values()) * disp.models[5].pool.created
    finally:
        gc.enable()
        gc.unfreeze()


def test_a_daemon_kept_to_its_device_memory_makes_requests_wait_and_refuses_what_never_fits(repo):
    """``--device-memory``: a burst that needs more buffer sets than fit waits for
    memory, every request is answered right; a model whose weights do not fit is not
    served, with the reason in the log, and the daemon serves the rest."""
    from paella.bundle import load_bundle
    from paella.dispatcher.adaptor import plan_from_bundle
    b = load_bundle(os.path.join(repo, "tiny_mlp"))
    plan = plan_from_bundle(b)
    params = sum(plan.buffers[n] for n in plan.params)
    one_set = sum(plan.request_buffers.values())
    limit = 64 + params + 2 * one_set        # noop's set, the weights, two requests' sets
    dp = start_daemon("--models", repo, "--device-memory", str(limit))
    try:
        rng = np.random.default_rng(5)
        xs = [rng.standard_normal((2, 16)).astype(np.float32) for _ in range(24)]
        with connect(dp.socket) as c:
            n = c.models["tiny_mlp"].variants[0].io_bytes
            offs = [c.alloc(n) for _ in xs]
            # Twice: a new input's job waits for its answer before it asks for memory
            # (Dispatcher._await_answer), so the first burst's jobs start as their answers
            # come in; the second, all cached, starts at once and must wait for memory.
            for _ in range(2):
                for off, x in zip(offs, xs):
                    c.io_views("tiny_mlp", off)[0]["x"][...] = x
                ids = [c.predict("tiny_mlp", n, off) for off in offs]   # all at once
                for rid, off, x in zip(ids, offs, xs):
                    c.wait(rid, timeout=30)
                    got = c.io_views("tiny_mlp", off)[1]["output0"]
                    np.testing.assert_allclose(got, b.run_cpu({"x": x})["output0"], rtol=1e-6,
                                               atol=1e-6)
            full = c.status()
            st = full["dispatcher"]
        assert st["device_memory_total_bytes"] == limit
        assert st["device_memory_bytes"] <= limit
        # each model's share: its weights and the sets it holds (a variant's, under the
        # name clients use); noop's idle set may have been freed to make room
        mem = {m["name"]: m["device_memory_bytes"] for m in full["models"]}
        assert mem["tiny_mlp"] >= params + one_set and mem["noop"] in (0, 64)
        assert sum(mem.values()) == st["device_memory_bytes"]
        assert st["memory_waits"] >= 1 and st["memory_failures"] == 0
    finally:
        cleanup(dp)
    # Weights that do not fit: the repository's only bundle cannot be served, which
    # start-up refuses (exit 2) with the reason.
    dp = start_daemon("--models", repo, "--device-memory", str(64 + params // 2), ready=False)
    try:
        assert dp.proc.wait(timeout=60) == 2
        log = dp.log()
        assert "no bundle of the model repository" in log
        assert "OutOfMemory: out of device memory" in log and "(device_memory)" in log
        assert "Traceback" not in log
    finally:
        cleanup(dp)
