"""Fixtures of the service tests (helpers in service_daemon.py)."""
from __future__ import annotations

import pytest

from service_daemon import DaemonProc, cleanup, start_daemon


@pytest.fixture(scope="module")
def daemon():
    dp = start_daemon()
    yield dp
    cleanup(dp)


@pytest.fixture
def fresh_daemon():
    """A daemon of the test's own, for tests that stop or kill it."""
    made: list[DaemonProc] = []

    def make(*args: str, **kw) -> DaemonProc:
        dp = start_daemon(*args, **kw)
        made.append(dp)
        return dp
    yield make
    for dp in made:
        cleanup(dp)
