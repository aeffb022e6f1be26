"""Fixtures for the cuda backend's tests: the recording stand-in driver and a device on it."""
from __future__ import annotations

import pytest

from cuda_fake_driver import FakeDriver, fake_cubin, fake_ptx, kernel_spec  # noqa: F401
from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher.devices.cuda import CudaDevice

SLOTS, PAIRS = 64, 8


@pytest.fixture
def drv() -> FakeDriver:
    return FakeDriver()


@pytest.fixture
def dev(drv):
    d = CudaDevice(driver=drv, n_streams=4, notifq_slots=SLOTS, counter_pairs=PAIRS)
    yield d
    d.close()


#: An instrumented kernel (float* x, int n, notifQ, launch id) that adds 1 to x[:n],
#: an uninstrumented one, and one with a float and an 8-byte scalar.
KERNELS = [
    kernel_spec("add1", [8, 4, 8, 4], regs=24, body="add1_f32"),
    kernel_spec("plain", [8], instrumented=False, regs=16),
    kernel_spec("mixed", [4, 8, 8, 4], regs=40, smem=1024),
]
INFOS = [KernelInfo("add1", regs_per_thread=24), KernelInfo("plain", regs_per_thread=16),
         KernelInfo("mixed", regs_per_thread=32, static_smem=0)]


def image(arch: int = 75, *, cubin: bool = True, ptx: bool = True) -> ModuleImage:
    return ModuleImage("m", INFOS, cubin=fake_cubin(arch, KERNELS) if cubin else None,
                       ptx=fake_ptx(KERNELS, terminate=False) if ptx else None)
