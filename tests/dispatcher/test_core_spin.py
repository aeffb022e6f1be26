"""The kernel core's loop in C (``Core.spin``, session 22): in real time the daemon lets
the core make pass after pass in C until the control plane is due. What must hold:
every request is answered as by single passes; the spin gives the loop back when a
client pushes (a probe word changes), when its deadline passes, when nothing is in
flight and when the device's next event is far; the reference core makes one pass."""
from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing import shared_memory

import numpy as np
import pytest

from paella.dispatcher.core import Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice

from dispatch_helpers import chain


def _served(core: str, spin: float, n: int = 12) -> list[tuple[int, int]]:
    dev = SimDevice("t4", seed=0, realtime=True)
    d = Dispatcher(dev, "paella", profile_runs=0, kernel_core=core)
    mid = d.register_model("c", chain("c", 6, seconds=30e-6))
    done: list[tuple[int, int]] = []
    for i in range(n):
        io = np.zeros(512, np.uint8)
        d.submit(Request(i, 0, mid, io, on_complete=lambda r, st, err: done.append((r.req_id, st))))
    deadline = time.monotonic() + 30
    while len(done) < n and time.monotonic() < deadline:
        if spin:
            d.spin_until = time.monotonic() + spin
        d.step()
    return done


@pytest.mark.parametrize("core", ["c", "python"])
def test_spinning_answers_every_request_once_as_single_passes_do(core):
    spun, passes = _served(core, 100e-6), _served(core, 0.0)
    assert sorted(spun) == sorted(passes) == [(i, 0) for i in range(12)]


def _long_job(core: str = "c") -> tuple[Dispatcher, list]:
    """A dispatcher in real time with one job in flight whose kernel lasts 0.2 s."""
    dev = SimDevice("t4", seed=0, realtime=True)
    d = Dispatcher(dev, "paella", profile_runs=0, kernel_core=core)
    mid = d.register_model("long", chain("long", 1, seconds=0.2, io=False))
    done: list = []
    d.submit(Request(0, 0, mid, np.zeros(64, np.uint8),
                     on_complete=lambda r, st, err: done.append(st)))
    for _ in range(3):              # admitted, started, its kernel released
        d.step()
    assert d.core.jobs == 1 and not done
    return d, done


def test_the_spin_ends_at_its_deadline_while_a_kernel_runs():
    d, done = _long_job()
    t = time.monotonic()
    assert d.core.spin(t + 0.02, None, 1.0) is None      # near: the kernel's end is "near"
    took = time.monotonic() - t
    assert 0.02 <= took < 0.15 and not done


def test_the_spin_gives_the_loop_back_when_the_next_event_is_far():
    d, _ = _long_job()
    t = time.monotonic()
    d.core.spin(t + 5.0, None, 250e-6)                  # the kernel ends 0.2 s from now
    assert time.monotonic() - t < 0.1


def _push_later(name: str, delay: float) -> None:
    shm = shared_memory.SharedMemory(name)
    time.sleep(delay)
    np.ndarray((1,), np.uint64, shm.buf)[0] += 1
    del shm


def test_a_push_seen_through_the_probe_ends_the_spin():
    """Another process bumps a watched word (a client's request-ring tail) 30 ms in: the
    spin, given 5 s, returns soon after."""
    d, _ = _long_job()
    shm = shared_memory.SharedMemory(create=True, size=8)
    try:
        word = np.ndarray((1,), np.uint64, shm.buf)
        word[0] = 7
        probe = np.array([word.ctypes.data], np.uint64)
        child = mp.get_context("fork").Process(target=_push_later, args=(shm.name, 0.03))
        child.start()
        t = time.monotonic()
        d.core.spin(t + 5.0, probe, 1.0)
        took = time.monotonic() - t
        child.join(10)
        assert word[0] == 8 and took < 1.0
        del word, probe
    finally:
        shm.close()
        shm.unlink()


def test_an_unchanged_probe_lets_the_spin_run_to_its_deadline():
    d, done = _long_job()
    words = np.arange(100, dtype=np.uint64)          # more than the spin's 64 on its stack
    probe = np.array([words.ctypes.data + 8 * i for i in range(100)], np.uint64)
    t = time.monotonic()
    d.core.spin(t + 0.02, probe, 1.0)
    assert time.monotonic() - t >= 0.02 and not done


def test_with_nothing_in_flight_the_spin_returns_at_once():
    dev = SimDevice("t4", realtime=True)
    d = Dispatcher(dev, "paella", profile_runs=0, kernel_core="c")
    d.register_model("c", chain("c", 2))
    t = time.monotonic()
    d.core.spin(t + 5.0, None, 1.0)
    assert time.monotonic() - t < 0.1


@pytest.mark.parametrize("core", ["c", "python"])
def test_spin_needs_a_real_time_engine(core):
    d = Dispatcher(SimDevice("t4"), "paella", profile_runs=0, kernel_core=core)
    d.register_model("c", chain("c", 2))
    with pytest.raises(RuntimeError, match="real-time engine"):
        d.core.spin(time.monotonic() + 0.01, None, 1.0)


def test_the_reference_core_makes_one_pass():
    d, done = _long_job("python")
    t = time.monotonic()
    d.core.spin(t + 5.0, None, 1.0)
    assert time.monotonic() - t < 0.1 and not done


def test_the_engine_logs_its_ops_and_its_own_work_when_asked():
    """``Gpu.logging``: each completed kernel and copy as (start, end, kind) in device
    time, each stretch of the simulator's work as (start, end) in CLOCK_MONOTONIC."""
    dev = SimDevice("t4", seed=0, realtime=True)
    d = Dispatcher(dev, "paella", profile_runs=0, kernel_core="c")
    mid = d.register_model("c", chain("c", 3))
    assert dev.gpu.logging is False
    dev.gpu.logging = True
    t0 = time.monotonic()
    done: list = []
    d.submit(Request(0, 0, mid, np.zeros(512, np.uint8),
                     on_complete=lambda r, st, err: done.append(st)))
    while not done:
        d.step()
    ops_b, sim_b = dev.gpu.log_take()
    ops = np.frombuffer(ops_b).reshape(-1, 3)
    sim = np.frombuffer(sim_b).reshape(-1, 2)
    assert sorted(ops[:, 2].tolist()) == [0, 0, 0, 1, 2]   # 3 kernels, H2D, D2H
    assert np.all(ops[:, 1] >= ops[:, 0])
    kernels = ops[ops[:, 2] == 0]
    assert np.all(np.diff(kernels[np.argsort(kernels[:, 0]), 0]) > 0)
    assert len(sim) >= 5 and np.all(sim[:, 1] >= sim[:, 0]) and sim[0, 0] >= t0
    assert dev.gpu.log_take() == (b"", b"")               # taken: cleared
    dev.gpu.logging = False


def test_a_signal_handler_runs_in_the_spin_and_its_exception_ends_it():
    """Signals are handled within the spin's 100 us turns: a handler that raises ends
    the spin with its exception at once, not at the spin's deadline."""
    import signal

    class Stop(Exception):
        pass

    def handler(signum, frame):
        raise Stop()
    d, done = _long_job()
    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.02)
        t = time.monotonic()
        with pytest.raises(Stop):
            d.core.spin(t + 5.0, None, 1.0)
        assert time.monotonic() - t < 1.0 and not done
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    # The core goes on: its job still completes.
    while not done:
        d.step()
    assert done == [0]


def test_the_devices_python_work_goes_into_its_self_log_while_logging():
    """``Gpu.log_work(t0)``: the simulated device's functional model (its answer lookup as
    an effect kernel is launched, in Python) joins the engine's self-log, so that
    ``paella experiment overhead`` counts it as the simulator's, not the scheduler's."""
    dev = SimDevice("t4", realtime=True)
    t0 = time.perf_counter()
    dev.gpu.log_work(t0)                                  # not logging: nothing kept
    dev.gpu.logging = True
    dev.gpu.log_work(t0)
    _, sim_b = dev.gpu.log_take()
    sim = np.frombuffer(sim_b).reshape(-1, 2)
    assert len(sim) == 1 and sim[0, 0] == t0 and t0 <= sim[0, 1] <= time.perf_counter()
    with pytest.raises(TypeError):
        dev.gpu.log_work("soon")
    dev.gpu.logging = False
