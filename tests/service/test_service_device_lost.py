"""A lost GPU (a sticky error): the daemon fails every in-flight request with the reason,
exits non-zero so that systemd restarts it, and leaves nothing behind."""
import pytest

from paella.client import RequestFailed, connect
from paella.dispatcher.daemon import EXIT_DEVICE_LOST
from service_daemon import cleanup, start_daemon


def test_a_lost_device_fails_requests_clearly_and_exits_non_zero():
    # The noop model's two profiling runs at start-up take launches 1 and 2; the device
    # is lost at the first client's launch.
    dp = start_daemon(env={"PAELLA_SIM_LOSE_DEVICE_AFTER": "2"})
    try:
        with connect(dp.socket) as c:
            off = c.alloc(64)
            rid = c.predict("noop", 64, off)
            with pytest.raises(RequestFailed) as err:
                c.read_result()
            assert err.value.req_id == rid
            assert "GPU failed" in str(err.value) and "sticky error" in str(err.value)
        assert dp.proc.wait(15) == EXIT_DEVICE_LOST
        assert "the device is lost" in dp.log()
        assert dp.segments() == []
    finally:
        cleanup(dp)
