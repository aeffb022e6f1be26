"""Shared fixtures: small simulated GPUs and kernels in virtual time."""
from __future__ import annotations

import pytest

from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher.devices.sim import SimDevice


def _load(dev: SimDevice, *infos: KernelInfo):
    funcs = dev.load_module(ModuleImage("test", list(infos)))
    return [funcs[i.name] for i in infos]


@pytest.fixture
def kernels():
    """``kernels(dev, KernelInfo(...), ...)`` loads kernels and returns them in order."""
    return _load


@pytest.fixture
def gtx():
    return SimDevice("gtx1660s")
