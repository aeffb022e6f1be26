"""The loop's watchdog in this process (the daemon's own use is in test_plugins.py):
it interrupts a plug-in call that runs too long, and nothing else."""
from __future__ import annotations

import contextlib
import sys
import threading
import time

import pytest

from paella.dispatcher.daemon.watchdog import PluginHung, PluginTimeout, Watchdog
from paella.plugins import PLUGIN_PACKAGES

PLUGIN = '''
import ctypes
import io
import logging
import time

lg = logging.getLogger("wd_test_plugin")       # a handler of its own, with its lock
lg.propagate = False
lg.addHandler(logging.StreamHandler(io.StringIO()))
stop = False

def log_forever():
    while True:
        lg.warning("still looping")

def in_c(seconds):
    """One C call that does not return early on a signal (system() waits for its child)."""
    ctypes.CDLL(None).system(f"sleep {seconds}".encode())
    return "returned"

def catch_everything():
    while not stop:
        try:
            time.sleep(0.01)
        except BaseException:
            pass

def loop_forever():
    while True:
        pass

def swallow_forever():
    while True:
        try:
            time.sleep(0.01)
        except Exception:
            pass

def busy(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "wd_test_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    import wd_test_plugin
    PLUGIN_PACKAGES.add("wd_test_plugin")
    yield wd_test_plugin
    PLUGIN_PACKAGES.discard("wd_test_plugin")
    sys.modules.pop("wd_test_plugin", None)


@contextlib.contextmanager
def watching(timeout: float, last_resort=None):
    wd = Watchdog(timeout, last_resort)
    wd.start()
    try:
        yield wd
    finally:
        wd.stop()


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_only_a_plugin_call_that_outlives_the_timeout_is_interrupted(plugin):
    with watching(0.4) as wd:
        t0 = time.monotonic()
        with pytest.raises(PluginTimeout, match=r"wd_test_plugin\.loop_forever .*wd_test_plugin"
                                                r"\.py:\d+\) ran for more than 0.4 s"):
            plugin.loop_forever()
        assert 0.4 <= time.monotonic() - t0 < 3
        spin(1.0)                            # the daemon's own code: never interrupted
        for _ in range(8):                   # many short plug-in calls: none is too long
            plugin.busy(0.1)
    assert wd.interrupted == 1


def test_a_plugin_that_keeps_swallowing_gets_a_base_exception(plugin):
    with watching(0.2) as wd:
        with pytest.raises(PluginHung, match="wd_test_plugin.swallow_forever .* kept running "
                                             "after 2 interruptions"):
            plugin.swallow_forever()
    assert wd.interrupted == 2


def test_off_at_zero(plugin):
    with watching(0) as wd:
        plugin.busy(0.3)
    assert wd.interrupted == 0


def test_a_plugin_logging_in_its_loop_is_interrupted_in_its_own_code(plugin):
    """The exception is raised only at a line of the plug-in: raised inside logging's
    handler, it would leave the handler's lock held and the next log line (any thread's)
    would wait forever."""
    with watching(0.3) as wd:
        with pytest.raises(PluginTimeout):
            plugin.log_forever()
    logged = []
    t = threading.Thread(target=lambda: (plugin.lg.warning("after"), logged.append(1)))
    t.start()
    t.join(5)
    assert logged == [1], "a logging lock was left held"
    assert wd.interrupted == 1


def test_a_long_c_call_gets_one_timeout_when_it_returns_not_a_hang_verdict(plugin):
    """Signals sent while the loop sits in C are not interruptions: it gets PluginTimeout
    once it is back in Python, not PluginHung for the signals that piled up."""
    with watching(0.25) as wd:
        with pytest.raises(PluginTimeout):
            plugin.in_c(0.7)
    assert wd.interrupted == 1


def test_a_plugin_that_catches_everything_ends_in_the_last_resort(plugin):
    said = []

    def last_resort(message):                # (the daemon's exits the process)
        said.append(message)
        plugin.stop = True
    with watching(0.2, last_resort):
        t0 = time.monotonic()
        plugin.catch_everything()
    assert said and "wd_test_plugin.catch_everything" in said[0]
    assert "could not be interrupted" in said[0]
    assert time.monotonic() - t0 >= 0.8     # (STRIKES + 2) timeouts


def test_another_thread_in_a_plugin_call_gets_the_timeout_too(plugin):
    """A SIGHUP reload builds batchers in a thread of its own; no signal reaches it."""
    got = []

    def load():
        try:
            plugin.loop_forever()
        except PluginTimeout as e:
            got.append(str(e))
    with watching(0.3):
        t = threading.Thread(target=load)
        t.start()
        t.join(5)
    assert got and not t.is_alive()
