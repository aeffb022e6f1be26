"""Dispatcher fixtures: a simulated GPU in virtual time with a dispatcher on it."""
from __future__ import annotations

import pytest

from paella.dispatcher.core import Dispatcher
from paella.dispatcher.devices.sim import SimDevice


@pytest.fixture
def make():
    """``make(policy, **kw) -> (device, dispatcher)`` on a small GPU, virtual time."""
    def build(policy="paella", gpu="gtx1660s", n_streams=64, notifq_slots=1 << 12, seed=0,
              **kw):
        dev = SimDevice(gpu, n_streams=n_streams, notifq_slots=notifq_slots, seed=seed)
        kw.setdefault("profile_runs", 1)
        return dev, Dispatcher(dev, policy, **kw)
    return build
