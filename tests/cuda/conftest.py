"""Fixtures for the cuda backend's tests: the recording stand-in driver and a device on it."""
from __future__ import annotations

import pytest

from cuda_fake_driver import FakeDriver
from cuda_fixtures import PAIRS, SLOTS
from paella.dispatcher.devices.cuda import CudaDevice


@pytest.fixture
def drv() -> FakeDriver:
    return FakeDriver()


@pytest.fixture
def dev(drv):
    d = CudaDevice(driver=drv, n_streams=4, notifq_slots=SLOTS, counter_pairs=PAIRS)
    yield d
    d.close()
