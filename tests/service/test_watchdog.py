"""The loop's watchdog in this process (the daemon's own use is in test_plugins.py):
it interrupts a plug-in call that runs too long, and nothing else."""
from __future__ import annotations

import contextlib
import sys
import time

import pytest

from paella.dispatcher.daemon.watchdog import PluginHung, PluginTimeout, Watchdog
from paella.plugins import PLUGIN_PACKAGES

PLUGIN = '''
import time

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
def watching(timeout: float):
    wd = Watchdog(timeout)
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
        spin(1.5)                            # the daemon's own code: never interrupted
        for _ in range(15):                  # many short plug-in calls: none is too long
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
