"""The simulated GPU's answer workers (``EffectWorkers``): results, failures confined to
their task, crashed and hung workers replaced, a bounded queue, and no process left behind.

The task functions are module-level here: a spawned worker imports this module by name,
which works because pytest puts this folder on ``sys.path`` and spawn hands the parent's
``sys.path`` to the child.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from paella.dispatcher.devices.sim import effect_workers
from paella.dispatcher.devices.sim.effect_workers import (EffectFailed, EffectQueueFull,
                                                          EffectWorkers, InlineEffects,
                                                          default_workers)

WAIT = 30           # seconds a result may take at most (a worker starts in about 0.5 s)


# -- tasks (run in the workers) ---------------------------------------------------------------
def square(x):
    return x * x


def pid_and_square(x):
    time.sleep(0.01)
    return os.getpid(), x * x


def fail(msg):
    raise ValueError(msg)


def segfault():
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))     # no core file
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)


def exit_3():
    os._exit(3)


def sleep(seconds):
    time.sleep(seconds)
    return seconds


def unpicklable_result():
    return threading.Lock()


def getenv(name):
    return os.environ.get(name)


def dies_at_start(conn, env, parent_pid):
    """Stands in for the worker's main: a worker that cannot start."""
    os._exit(5)


# -- helpers ------------------------------------------------------------------------------
def wait_until(cond, timeout: float = WAIT) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def children(name: str) -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith(name + "-")]


def gone(pid: int) -> bool:
    """No such process (a zombie counts as gone: it computes nothing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def pools():
    """Make pools; every one is closed at the end of the test, and none leaves a child."""
    made = []

    def make(*args, **kw) -> EffectWorkers:
        kw.setdefault("name", f"ew-test-{len(made)}")
        made.append(EffectWorkers(*args, **kw))
        return made[-1]
    yield make
    for p in made:
        p.close()
        assert children(p.name) == []


# -- the pool ------------------------------------------------------------------------------
def test_results_come_back(pools):
    pool = pools(1)
    assert pool.stats()["alive"] == 0                    # lazy: nothing before a submit
    assert pool.submit(square, 7).result(WAIT) == 49
    a = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(pool.submit(square, a).result(WAIT), a * a)
    st = pool.stats()
    assert st == {"workers": 1, "alive": 1, "queued": 0, "running": 0, "completed": 2,
                  "failed": 0, "crashed": 0, "timed_out": 0, "restarts": 0, "evicted": 0}
    assert pool.queued == 0 and pool.running == 0


def test_workers_start_at_the_first_task_or_when_warmed(pools):
    """A started pool (its manager thread) starts no process until a task comes: a daemon
    of built-in models never pays for one; ``warm()`` starts them ahead of the first."""
    idle = pools(1)
    idle.start()
    time.sleep(0.5)
    assert idle.stats()["alive"] == 0 and children(idle.name) == []
    assert idle.submit(square, 3).result(WAIT) == 9
    assert idle.stats()["alive"] == 1
    warm = pools(1)
    warm.warm()
    end = time.monotonic() + WAIT
    while warm.stats()["alive"] == 0 and time.monotonic() < end:
        time.sleep(0.05)
    assert warm.stats()["alive"] == 1 and warm.stats()["completed"] == 0


def test_many_tasks_over_two_workers_all_correct(pools):
    pool = pools(2)
    futures = {i: pool.submit(pid_and_square, i) for i in range(50)}
    got = {i: f.result(WAIT) for i, f in futures.items()}
    assert {i: v for i, (_, v) in got.items()} == {i: i * i for i in range(50)}
    pids = {pid for pid, _ in got.values()}
    assert 1 <= len(pids) <= 2 and os.getpid() not in pids
    assert pool.stats()["completed"] == 50 and pool.stats()["alive"] == 2


def test_done_callbacks_run_in_the_manager_thread(pools):
    pool = pools(1, name="ew-cb")
    seen = []
    done = threading.Event()
    f = pool.submit(square, 3)
    f.add_done_callback(lambda fut: (seen.append((threading.current_thread().name, fut.result())),
                                     done.set()))
    assert done.wait(WAIT)
    assert seen == [("ew-cb-manager", 9)]


def test_an_exception_fails_its_task_and_the_worker_keeps_serving(pools):
    pool = pools(1)
    pid = pool.submit(pid_and_square, 1).result(WAIT)[0]
    with pytest.raises(EffectFailed, match=r"^ValueError: bad input 42$"):
        pool.submit(fail, "bad input 42").result(WAIT)
    with pytest.raises(EffectFailed, match=r"result could not be sent back .*lock"):
        pool.submit(unpicklable_result).result(WAIT)
    with pytest.raises(EffectFailed, match=r"task could not be sent to an effect worker"):
        pool.submit(square, threading.Lock()).result(WAIT)
    assert pool.submit(pid_and_square, 2).result(WAIT) == (pid, 4)     # the same worker
    st = pool.stats()
    assert (st["completed"], st["failed"], st["crashed"], st["restarts"]) == (2, 3, 0, 0)


def test_a_crashing_worker_fails_only_its_task(pools):
    pool = pools(1)                              # one worker: the others wait behind them
    futures = [pool.submit(square, 2), pool.submit(segfault), pool.submit(square, 3),
               pool.submit(exit_3), pool.submit(square, 4)]
    with pytest.raises(EffectFailed, match=r"effect worker \d+ died of signal SIGSEGV "
                                           r"while computing this"):
        futures[1].result(WAIT)
    with pytest.raises(EffectFailed, match=r"effect worker \d+ exited with status 3 "
                                           r"while computing this"):
        futures[3].result(WAIT)
    assert [futures[i].result(WAIT) for i in (0, 2, 4)] == [4, 9, 16]
    assert pool.submit(square, 5).result(WAIT) == 25                   # later ones too
    st = pool.stats()
    assert (st["completed"], st["failed"], st["crashed"], st["timed_out"]) == (4, 2, 2, 0)
    assert st["restarts"] == 2 and st["alive"] == 1 and st["running"] == 0


def test_a_hanging_task_is_killed_at_the_deadline(pools):
    pool = pools(1, deadline=1)
    pool.submit(square, 1).result(WAIT)          # started: the deadline counts from here
    t0 = time.monotonic()
    hung, after = pool.submit(sleep, 60), pool.submit(square, 6)
    with pytest.raises(EffectFailed, match=r"ran past the deadline \(1 s, .*effect_deadline_seconds\)"):
        hung.result(WAIT)
    assert 0.9 < time.monotonic() - t0 < 8
    assert after.result(WAIT) == 36
    st = pool.stats()
    assert (st["timed_out"], st["failed"], st["crashed"], st["restarts"]) == (1, 1, 0, 1)


def test_one_owners_flood_neither_refuses_nor_delays_another_owners_task(pools):
    """The queue is shared by owners (FairQueue): a full queue of one owner's tasks
    evicts its newest for another owner's (told as an overload, a refusal), refuses
    only the owner holding the most, and the other owner's task runs next."""
    from paella.dispatcher.devices.sim.effect_workers import Evicted, OwnedEffects
    pool = pools(1, max_queue=3)
    first = pool.submit(sleep, 0.5, owner="flood")
    wait_until(lambda: pool.running == 1)
    flood = [pool.submit(pid_and_square, i, owner="flood") for i in range(3)]
    with pytest.raises(EffectQueueFull):
        pool.submit(square, 9, owner="flood")
    assert pool.refuses("flood") and not pool.refuses("tenant")
    done_order: list = []
    mine = pool.submit(pid_and_square, 5, owner="tenant")
    with pytest.raises(Evicted, match="^overloaded: .*effect_queue") as e:
        flood[2].result(WAIT)
    assert e.value.refusal
    for f in (mine, flood[0], flood[1]):
        f.add_done_callback(lambda f: done_order.append(f))
    assert mine.result(WAIT)[1] == 25 and first.result(WAIT) == 0.5
    assert [f.result(WAIT)[1] for f in flood[:2]] == [0, 1]
    assert done_order[0] is mine                  # next after the running one, not last
    assert pool.stats()["evicted"] == 1 and pool.stats()["failed"] == 0
    # a scheduler's view submits as its own owner
    view = OwnedEffects(pool, ("model", "m"))
    assert view.submit(square, 4).result(WAIT) == 16 and view.max_queue == 3


def test_a_full_queue_refuses_and_close_fails_what_waits(pools):
    pool = pools(1, max_queue=2)
    running = pool.submit(sleep, 30)
    wait_until(lambda: pool.running == 1)
    waiting = [pool.submit(square, 1), pool.submit(square, 2)]
    assert pool.queued == 2
    with pytest.raises(EffectQueueFull, match=r"2 tasks are already waiting .*effect_queue"):
        pool.submit(square, 3)
    # a cancelled waiting task frees its place
    assert waiting[0].cancel()
    waiting.append(pool.submit(square, 4))
    pids = [p.pid for p in children(pool.name)]
    assert len(pids) == 1
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 5
    for f in (running, waiting[1], waiting[2]):
        with pytest.raises(EffectFailed, match="the daemon is stopping"):
            f.result(0)
    assert waiting[0].cancelled()
    assert children(pool.name) == [] and all(gone(pid) for pid in pids)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(square, 5)
    pool.close()                                 # idempotent
    assert pool.stats()["alive"] == 0


def test_a_cancelled_task_is_skipped(pools):
    pool = pools(1)
    first = pool.submit(sleep, 0.5)
    wait_until(lambda: pool.running == 1)       # the worker is busy: the next ones wait
    skipped, last = pool.submit(square, 2), pool.submit(square, 3)
    assert skipped.cancel()
    assert last.result(WAIT) == 9 and first.result(WAIT) == 0.5
    assert skipped.cancelled() and pool.stats()["completed"] == 2


def test_env_reaches_the_workers(pools):
    pool = pools(1, env={"PAELLA_EFFECT_TEST": "yes"})
    assert pool.submit(getenv, "PAELLA_EFFECT_TEST").result(WAIT) == "yes"
    assert "PAELLA_EFFECT_TEST" not in os.environ


def test_workers_that_cannot_start_fail_the_queue(pools, monkeypatch):
    monkeypatch.setattr(effect_workers, "_worker_main", dies_at_start)
    pool = pools(1)
    f = pool.submit(square, 2)
    with pytest.raises(EffectFailed, match=r"cannot start: 3 in a row exited with status 5"):
        f.result(WAIT)


_KILLED_PARENT = """
import os, signal, time
from paella.dispatcher.devices.sim.effect_workers import EffectWorkers
pool = EffectWorkers(1)
print(pool.submit(os.getpid).result(30), flush=True)
pool.submit(time.sleep, 60)
time.sleep(0.2)                                  # (the worker has taken it)
os.kill(os.getpid(), signal.SIGKILL)
"""

# A subreaper runs the parent above, so that its orphans (the worker, multiprocessing's
# resource tracker) become its children: it reports how the worker ended, and leaves no
# zombie behind for this machine's init.
_SUBREAPER = """
import ctypes, json, os, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)          # PR_SET_CHILD_SUBREAPER
parent = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True,
                        timeout=30)
reaped, end = {}, time.monotonic() + 5
while time.monotonic() < end:
    try:
        pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break                                    # no orphan left
    if pid:
        reaped[pid] = os.waitstatus_to_exitcode(status)
    else:
        time.sleep(0.01)
print(json.dumps({"rc": parent.returncode, "out": parent.stdout, "err": parent.stderr,
                  "reaped": reaped, "waited": round(5 - (end - time.monotonic()), 2)}))
"""


def test_workers_end_with_their_parent():
    """A parent killed with SIGKILL (no close) leaves no worker behind: the worker, busy
    for 60 s, is killed at once (PR_SET_PDEATHSIG)."""
    import json
    out = subprocess.run([sys.executable, "-c", _SUBREAPER, _KILLED_PARENT], capture_output=True,
                         text=True, timeout=WAIT)
    r = json.loads(out.stdout)
    assert r["rc"] == -signal.SIGKILL, r["err"]
    worker = r["out"].split()[0]
    assert r["reaped"].get(worker) == -signal.SIGKILL, r
    assert r["waited"] < 4.5, r                 # every orphan ended and was reaped


@pytest.mark.parametrize("kw", [dict(n=0), dict(n=True), dict(n=1.0), dict(deadline=0),
                                dict(deadline=float("inf")), dict(max_queue=0),
                                dict(name=""), dict(env={"A": 1})])
def test_arguments_are_checked(kw):
    kw.setdefault("n", 1)
    with pytest.raises(ValueError):
        EffectWorkers(kw.pop("n"), **kw)


def test_default_workers(monkeypatch):
    for cpus, want in ((None, 1), (1, 1), (2, 1), (3, 2), (5, 4), (64, 4)):
        monkeypatch.setattr(os, "cpu_count", lambda c=cpus: c)
        assert default_workers() == want


# -- inline -------------------------------------------------------------------------------
def test_inline_effects():
    fx = InlineEffects()
    f = fx.submit(square, 4)
    assert f.done() and f.result() == 16
    calls = []
    f.add_done_callback(lambda _: calls.append(threading.current_thread()))
    assert calls == [threading.current_thread()]
    bad = fx.submit(fail, "nope")
    assert bad.done()
    with pytest.raises(EffectFailed, match="^ValueError: nope$") as e:
        bad.result()
    assert isinstance(e.value.__cause__, ValueError)
    assert fx.queued == 0 and fx.running == 0 and fx.max_queue is None
    assert fx.stats()["completed"] == 1 and fx.stats()["failed"] == 1
    fx.close()
    fx.close()
    with pytest.raises(RuntimeError):
        fx.submit(square, 1)


_FORGOTTEN = """
import operator
from paella.dispatcher.devices.sim.effect_workers import EffectWorkers
pool = EffectWorkers(2)
print(pool.submit(operator.add, 1, 2).result(30), flush=True)
"""


def test_a_pool_never_closed_does_not_hang_the_interpreters_exit():
    # multiprocessing's exit hook SIGTERMs daemonic children and joins them; the workers
    # ignore SIGTERM, so without the pool's own exit hook this exit never ends (a test
    # run that leaked a pool once hung a CI run after its last test had passed).
    out = subprocess.run([sys.executable, "-c", _FORGOTTEN], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "3"


def _refused_with(effects, x) -> "object":
    from paella.dispatcher.devices.sim.effect_workers import submit_or_fail
    return submit_or_fail(effects, np.negative, x)


def test_a_refusal_keeps_no_frame_and_so_none_of_the_callers_memory_alive():
    """A refused submission is a future failed with the refusal. Its exception carries no
    traceback: one would keep the refusing call's frames, and through them the caller's
    (whose locals are views of a client's memory), alive in a reference cycle that only
    the cyclic collector frees; an idle daemon may not run it for minutes, and the
    fuzzer found a refused client's segment still mapped after it left (session 29)."""
    import gc
    import weakref

    class Full:
        def submit(self, fn, *args, bound=True, owner=None):
            raise RuntimeError("overloaded: the queue is full")

    gc.disable()
    try:
        x = np.zeros(16)
        alive = weakref.ref(x)
        f = _refused_with(Full(), x)
        del x
        assert alive() is None, "the refusal keeps the caller's array alive"
        assert "queue is full" in str(f.exception())
        assert f.exception().__traceback__ is None
    finally:
        gc.enable()


def test_an_inline_failure_keeps_no_frame_alive():
    import gc
    import weakref
    from paella.dispatcher.devices.sim.effect_workers import EffectFailed, InlineEffects

    def boom(a):
        raise ValueError("bad input")

    gc.disable()
    try:
        x = np.zeros(16)
        alive = weakref.ref(x)
        f = InlineEffects().submit(boom, x)
        del x
        assert alive() is None
        assert isinstance(f.exception(), EffectFailed) and "bad input" in str(f.exception())
    finally:
        gc.enable()
